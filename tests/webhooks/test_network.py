"""The SSRF check on every form of address a webhook URL can name: IPv6 forms that carry an
IPv4 address are judged by it, reserved ranges are refused by name, port 0 is refused; public
addresses (and what an operator allows) stay accepted. Names go through the same check, with
the addresses the resolver gives (localhost, at creation and at every connect)."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.webhooks.network import UnsafeUrl, check_url
from tests.service.conftest import running_service
from tests.webhooks.conftest import FAST, announce
from tests.webhooks.receiver import Receiver, wait_for

REFUSED = [
    # IPv6 forms carrying a loopback or private IPv4 address
    "http://[::127.0.0.1]/",  # IPv4-compatible
    "http://[::ffff:127.0.0.1]/",  # IPv4-mapped
    "http://[::ffff:0:7f00:1]/",  # IPv4-translated
    "http://[::ffff:0:a00:1]/",  # IPv4-translated 10.0.0.1
    "http://[64:ff9b::7f00:1]/",  # NAT64 well-known prefix
    "http://[64:ff9b::a9fe:a9fe]/",  # NAT64 of the metadata address
    "http://[64:ff9b:1::7f00:1]/",  # NAT64 local-use prefix
    "http://[2002:7f00:1::1]/",  # 6to4
    "http://[2002:c0a8:1::1]/",  # 6to4 of 192.168.0.1
    "http://[2001:0:4136:e378:8000:63bf:80ff:fffe]/",  # Teredo, client 127.0.0.1
    # IPv6 ranges that are never a public receiver
    "http://[::]/",
    "http://[::1]/",
    "http://[fec0::1]/",  # site-local
    "http://[fc00::1]/",  # unique local
    "http://[fd00:ec2::254]/",  # unique local (a metadata service)
    "http://[fe80::1]/",  # link-local
    "http://[ff02::1]/",  # multicast
    "http://[2001:db8::1]/",  # documentation
    "http://[3fff::1]/",  # documentation
    "http://[2001:2::1]/",  # benchmarking
    "http://[100::1]/",  # discard-only
    "http://[5f00::1]/",  # segment routing
    # IPv4 ranges that are never a public receiver
    "http://0.0.0.0/",
    "http://0.1.2.3/",
    "http://10.1.2.3/",
    "http://100.64.0.1/",  # shared address space (CGNAT)
    "http://100.100.100.200/",  # a metadata service
    "http://127.0.0.1/",
    "http://169.254.169.254/",
    "http://172.16.0.1/",
    "http://192.0.0.8/",  # IETF protocol assignments
    "http://192.0.2.1/",  # documentation
    "http://192.88.99.1/",  # 6to4 relay anycast
    "http://192.168.0.10/",
    "http://198.18.0.1/",  # benchmarking
    "http://198.51.100.1/",  # documentation
    "http://203.0.113.1/",  # documentation
    "http://224.0.0.1/",  # multicast
    "http://240.0.0.1/",  # reserved
    "http://255.255.255.255/",  # broadcast
]
ACCEPTED = [
    ("http://8.8.8.8/hook", "8.8.8.8", 80),
    ("https://1.1.1.1:8443/hook", "1.1.1.1", 8443),
    ("http://[2606:4700:4700::1111]/hook", "2606:4700:4700::1111", 80),
    ("https://[::ffff:8.8.8.8]/hook", "::ffff:808:808", 443),  # IPv4-mapped public
    ("http://[64:ff9b::808:808]/hook", "64:ff9b::808:808", 80),  # NAT64 of a public address
    ("http://93.184.215.14:65535/hook", "93.184.215.14", 65535),
]


@pytest.mark.parametrize("url", REFUSED)
def test_reserved_and_embedded_addresses_are_refused(url: str) -> None:
    with pytest.raises(UnsafeUrl, match="resolves to"):
        check_url(url, [])


@pytest.mark.parametrize(("url", "address", "port"), ACCEPTED)
def test_public_addresses_are_accepted(url: str, address: str, port: int) -> None:
    target = check_url(url, [])
    assert (str(target.address), target.port) == (address, port)


@pytest.mark.parametrize(
    "url", ["http://8.8.8.8:0/", "http://[2606:4700:4700::1111]:0/", "http://8.8.8.8:65536/"]
)
def test_port_0_and_ports_out_of_range_are_refused(url: str) -> None:
    with pytest.raises(UnsafeUrl, match="port"):
        check_url(url, [])


def test_an_allowed_network_covers_the_forms_that_carry_its_addresses() -> None:
    networks = ["127.0.0.0/8"]
    for url in ("http://127.0.0.1:9/", "http://[::ffff:127.0.0.1]:9/", "http://[::ffff:0:7f00:1]/"):
        assert check_url(url, networks).port in (9, 80)
    for url in ("http://10.0.0.1/", "http://[::ffff:10.0.0.1]/", "http://[2002:a00:1::1]/"):
        with pytest.raises(UnsafeUrl):
            check_url(url, networks)


def test_a_name_is_checked_by_the_addresses_it_resolves_to() -> None:
    with pytest.raises(UnsafeUrl, match="localhost resolves to"):
        check_url("http://localhost:8080/hook", [])
    # Allowed, it goes to the address that was checked.
    target = check_url("http://localhost:8080/hook", ["127.0.0.0/8", "::1/128"])
    assert target.address.is_loopback and (target.host, target.port) == ("localhost", 8080)


def test_a_name_is_checked_again_at_every_connect(
    tmp_path: Path, database_url: str, examples: Path, receiver: Receiver
) -> None:
    """An endpoint named by a host name, accepted while loopback was allowed, is refused at
    connect time once it no longer is: the name is resolved and checked for each attempt."""
    loopback = {**FAST, "webhook_allowed_networks": ["127.0.0.0/8", "::1/128"]}
    named = f"http://localhost:{receiver.port}/hooks"
    with running_service(tmp_path, database_url, examples, **loopback) as service:
        created = service.client.post("/v1/webhooks", json={"url": named})
        assert created.status_code == 201, created.text
    strict = {**FAST, "webhook_allowed_networks": []}
    with running_service(tmp_path, database_url, examples, **strict) as service:
        announce(service.db, "default")
        listing = f"/v1/webhooks/{created.json()['id']}/deliveries"
        (delivery,) = wait_for(
            lambda: [d for d in service.client.get(listing).json()["items"] if d["attempts"]],
            "a refused attempt",
        )
        assert delivery["attempts"][0]["error"].startswith("refused: localhost resolves to")
    assert receiver.received == []
