"""Where a webhook may be sent: http(s) to public addresses only, unless the operator allows a
network (LAYERSWAP_WEBHOOK_ALLOWED_NETWORKS). Checked when an endpoint is created and again at
each connect, against the addresses the name resolves to then, and the request goes to the
address that was checked (no second lookup a DNS rebinding could answer differently)."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# Cloud metadata services that are not in a link-local or private range everywhere.
METADATA = {
    ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200")
}


class UnsafeUrl(ValueError):
    """A URL a webhook must not be sent to; the message says why."""


@dataclass(frozen=True)
class Target:
    url: str
    scheme: str
    host: str
    port: int
    address: IPAddress  # checked; the connection goes here


def allowed(address: IPAddress, networks: list[str]) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if any(address in ipaddress.ip_network(n, strict=False) for n in networks):
        return True
    return address.is_global and not address.is_multicast and address not in METADATA


def check_url(url: str, networks: list[str]) -> Target:
    """Parse `url`, resolve its host and check every address; the first is the one to use."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise UnsafeUrl("only http and https URLs are allowed")
    if not parts.hostname:
        raise UnsafeUrl("the URL names no host")
    if parts.username or parts.password:
        raise UnsafeUrl("credentials in the URL are not allowed; use the signature to authenticate")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise UnsafeUrl("the URL's port is not a number from 1 to 65535") from None
    try:
        found = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise UnsafeUrl(f"{parts.hostname} does not resolve") from None
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in found]
    refused = [a for a in addresses if not allowed(a, networks)]
    if refused:
        raise UnsafeUrl(
            f"{parts.hostname} resolves to {refused[0]}, a loopback, private, link-local or "
            "metadata address (an operator may allow networks in "
            "LAYERSWAP_WEBHOOK_ALLOWED_NETWORKS)"
        )
    return Target(url, parts.scheme, parts.hostname, port, addresses[0])
