"""API keys remembered per API process (service/auth.py, KeyCache): a key revoked through the
command line is refused by every process once auth.KEY_CACHE_S has passed, by each one's own
clock (injected here, so no test waits on the real one); a remembered key only ever stands for
its own tenant; concurrent requests share one lookup, and a lookup too old to vouch for a key
is not shared."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import event

from core.errors import Unauthorized
from layerswap.cli import cli
from service.auth import KEY_CACHE_S, KeyCache, create_key
from tests.service.conftest import Service, layer_swap, running_service
from tests.service.test_api_lifecycle import HeldExecutor


class Clock:
    """A monotonic clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def key_cache(service: Service) -> KeyCache:
    cache: KeyCache = service.client.app.state.context.keys  # type: ignore[attr-defined]
    return cache


def key_lookups(service: Service) -> list[str]:
    """The statements that read the keys table from now on (appended as they are sent)."""
    seen: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "FROM api_keys" in statement:
            seen.append(statement)

    event.listen(service.db.engine, "before_cursor_execute", count)
    return seen


@pytest.fixture
def processes(tmp_path: Path, database_url: str, examples: Path) -> Iterator[list[Service]]:
    """Two API processes' apps on one database, each with its own key cache and clock."""
    with ExitStack() as stack:
        opened = [
            running_service(
                tmp_path / name, database_url, examples, auth=True, job_executor=HeldExecutor()
            )
            for name in ("one", "two")
        ]
        yield [stack.enter_context(service) for service in opened]


def test_a_revoked_key_is_refused_by_every_process_within_the_bound(
    processes: list[Service], database_url: str, tmp_path: Path
) -> None:
    key = create_key(processes[0].db, "team-a")
    other = create_key(processes[0].db, "team-b")
    clocks = []
    for service in processes:
        clocks.append(clock := Clock())
        key_cache(service).clock = clock
    lookups = key_lookups(processes[0])
    for service in processes:
        for _ in range(20):
            assert service.client.get("/v1/merges", headers=bearer(key)).status_code == 200
        assert service.client.get("/v1/merges", headers=bearer(other)).status_code == 200
    assert len(lookups) == 2  # one per key in this process while the bound runs

    env = {"LAYERSWAP_DATABASE_URL": database_url, "LAYERSWAP_DATA_DIR": str(tmp_path / "cli")}
    revoked = CliRunner().invoke(cli, ["keys", "revoke", key], env=env, catch_exceptions=False)
    assert revoked.exit_code == 0, revoked.output
    # Within the bound a process may still answer from what it looked up before: the
    # documented price of not reading the keys table on every request.
    clocks[0].now += KEY_CACHE_S / 2
    assert processes[0].client.get("/v1/merges", headers=bearer(key)).status_code == 200
    for service, clock in zip(processes, clocks, strict=True):
        clock.now += KEY_CACHE_S  # past the bound of every lookup made before the revocation
        for _ in range(3):
            refused = service.client.get("/v1/merges", headers=bearer(key))
            assert refused.status_code == 401, refused.text
            assert refused.json()["error"]["code"] == "unauthorized"
        assert service.client.get("/v1/merges", headers=bearer(other)).status_code == 200


def test_a_remembered_key_stands_only_for_its_own_tenant(
    tmp_path: Path, database_url: str, examples: Path
) -> None:
    with running_service(
        tmp_path, database_url, examples, auth=True, job_executor=HeldExecutor()
    ) as service:
        key_cache(service).clock = Clock()  # nothing expires while the test runs
        a, b = create_key(service.db, "a"), create_key(service.db, "b")
        client = service.client
        mine = client.post("/v1/merges", json=layer_swap(), headers=bearer(a)).json()["id"]
        theirs = client.post("/v1/merges", json=layer_swap(), headers=bearer(b)).json()["id"]
        for _ in range(3):  # both remembered by now, and asked in turn
            assert client.get(f"/v1/merges/{mine}", headers=bearer(a)).status_code == 200
            assert client.get(f"/v1/merges/{mine}", headers=bearer(b)).status_code == 404
            assert client.get(f"/v1/merges/{theirs}", headers=bearer(a)).status_code == 404
            listed_b = client.get("/v1/merges", headers=bearer(b)).json()["items"]
            assert [job["id"] for job in listed_b] == [theirs]
        # an unknown key is looked up (and refused) however many valid ones are remembered,
        # including one that differs from a remembered key by a character
        for unknown in (a[:-1] + ("x" if a[-1] != "x" else "y"), "lsk_never-issued"):
            assert client.get("/v1/merges", headers=bearer(unknown)).status_code == 401


def test_concurrent_requests_share_one_lookup() -> None:
    async def run() -> tuple[list[str], int]:
        release = asyncio.Event()
        calls: list[str] = []

        async def lookup(key_hash: str) -> str:
            calls.append(key_hash)
            await release.wait()
            return "team-a"

        cache = KeyCache(lookup, clock=Clock())
        waiting = [asyncio.ensure_future(cache.tenant("Bearer lsk_k")) for _ in range(50)]
        await asyncio.sleep(0)  # one turn of the loop, no time: each task runs to its first await
        release.set()
        return list(await asyncio.gather(*waiting)), len(calls)

    tenants, lookups = asyncio.run(run())
    assert tenants == ["team-a"] * 50 and lookups == 1


def test_a_lookup_older_than_the_bound_is_not_shared_and_refusals_are_not_kept() -> None:
    """A request that comes KEY_CACHE_S after a lookup began, while it is still out, starts its
    own: the old one may have read the keys table before a revocation that is now past the
    bound. A refusal is never remembered: the next request asks again."""

    async def run() -> None:
        clock = Clock()
        answers: list[asyncio.Future[str]] = []

        def lookup(_key_hash: str) -> asyncio.Future[str]:
            answers.append(asyncio.get_running_loop().create_future())
            return answers[-1]

        cache = KeyCache(lookup, clock=clock)
        first = asyncio.ensure_future(cache.tenant("Bearer lsk_k"))
        await asyncio.sleep(0)  # one turn of the loop: the lookup has begun
        clock.now += KEY_CACHE_S
        second = asyncio.ensure_future(cache.tenant("Bearer lsk_k"))
        await asyncio.sleep(0)
        assert len(answers) == 2  # the second did not join the first
        answers[0].set_result("team-a")
        answers[1].set_exception(Unauthorized("unknown or revoked API key"))
        assert await first == "team-a"
        with pytest.raises(Unauthorized):
            await second
        third = asyncio.ensure_future(cache.tenant("Bearer lsk_k"))
        await asyncio.sleep(0)
        assert len(answers) == 3  # asked again: neither answer stands for it now
        answers[2].set_result("team-a")
        assert await third == "team-a"

    asyncio.run(run())
