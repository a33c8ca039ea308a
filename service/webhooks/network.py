"""Where a webhook may be sent: http(s) to public addresses only, unless the operator allows a
network (LAYERSWAP_WEBHOOK_ALLOWED_NETWORKS). Checked when an endpoint is created and again at
each connect, against the addresses the name resolves to then, and the request goes to the
address that was checked (no second lookup a DNS rebinding could answer differently).

An IPv6 address that carries an IPv4 one (mapped, compatible, translated, NAT64, 6to4, Teredo)
reaches that IPv4 address one way or another, so the IPv4 address is checked too; ranges that
are never a public receiver are refused by name, whatever the Python version's `is_global`
thinks of them."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# Cloud metadata services that are not in a link-local or private range everywhere.
METADATA = {
    ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200")
}
RESERVED: tuple[Network, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
        "172.16.0.0/12", "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24", "192.168.0.0/16",
        "198.18.0.0/15", "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4",
        "::/128", "::1/128", "64:ff9b:1::/48", "100::/64", "2001::/23",
        "2001:db8::/32", "2002::/16", "3fff::/20", "5f00::/16", "fc00::/7", "fe80::/10",
        "fec0::/10", "ff00::/8",
    )
)  # fmt: skip
# IPv6 forms that stand for the IPv4 address in their last 32 bits: IPv4-mapped,
# IPv4-translated (::ffff:0:a.b.c.d), IPv4-compatible, and NAT64's well-known prefix.
TRANSLATED: tuple[ipaddress.IPv6Network, ...] = tuple(
    ipaddress.IPv6Network(n) for n in ("::ffff:0:0/96", "::ffff:0:0:0/96", "::/96", "64:ff9b::/96")
)


class UnsafeUrl(ValueError):
    """A URL a webhook must not be sent to; the message says why."""


@dataclass(frozen=True)
class Target:
    url: str
    scheme: str
    host: str
    port: int
    address: IPAddress  # checked; the connection goes here


def carried(address: IPAddress) -> list[IPAddress]:
    """The addresses a connection to `address` may end up at: the IPv4 address a translated
    form stands for (instead of it), or the tunnel's own address and the IPv4 ones it
    carries (6to4, Teredo's server and client)."""
    if isinstance(address, ipaddress.IPv4Address) or address in ipaddress.ip_network("::/127"):
        return [address]  # :: and ::1 are themselves, not IPv4-compatible forms
    if any(address in network for network in TRANSLATED):
        return [ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)]
    if address.sixtofour is not None:
        return [address, address.sixtofour]
    if address.teredo is not None:
        return [address, *address.teredo]
    return [address]


def public(address: IPAddress) -> bool:
    return (
        address.is_global
        and not address.is_multicast
        and address not in METADATA
        and not any(address in network for network in RESERVED)
    )


def allowed(address: IPAddress, networks: list[str]) -> bool:
    """Every address the connection may reach is public or in a network the operator allows."""
    allowed_networks = [ipaddress.ip_network(n, strict=False) for n in networks]
    return all(
        public(a) or any(a in network for network in allowed_networks) for a in carried(address)
    )


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
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:  # a port that is not a number, or port 0: no receiver listens there
        raise UnsafeUrl("the URL's port is not a number from 1 to 65535")
    port = port or (443 if parts.scheme == "https" else 80)
    try:
        found = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise UnsafeUrl(f"{parts.hostname} does not resolve") from None
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in found]
    refused = [a for a in addresses if not allowed(a, networks)]
    if refused:
        raise UnsafeUrl(
            f"{parts.hostname} resolves to {refused[0]}, a loopback, private, link-local, "
            "reserved or metadata address (an operator may allow networks in "
            "LAYERSWAP_WEBHOOK_ALLOWED_NETWORKS)"
        )
    return Target(url, parts.scheme, parts.hostname, port, addresses[0])
