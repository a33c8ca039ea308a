"""`layerswap keys list / revoke` through the real command line against a real database: a
revoked key is refused over HTTP once the API's key cache lets go of it (auth.KEY_CACHE_S, on
the app's clock, moved here by the test), and nothing prints a secret or its hash."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner, Result

from layerswap.cli import cli
from service.auth import KEY_CACHE_S, hash_key
from tests.service.conftest import running_service
from tests.service.test_key_cache import Clock


def layerswap(env: dict[str, str], *args: str) -> Result:
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


def test_keys_list_and_revoke(tmp_path: Path, database_url: str, examples: Path) -> None:
    env = {"LAYERSWAP_DATABASE_URL": database_url, "LAYERSWAP_DATA_DIR": str(tmp_path / "cli")}
    created = [layerswap(env, "keys", "create", "--tenant", t) for t in ("team-a", "team-b")]
    assert all(result.exit_code == 0 for result in created)
    key_a, key_b = (result.stdout.strip() for result in created)

    listed = layerswap(env, "keys", "list")
    assert listed.exit_code == 0, listed.output
    rows = [line.split() for line in listed.stdout.splitlines()[1:]]
    assert [(row[1], row[3]) for row in rows] == [("team-a", "-"), ("team-b", "-")]
    for secret in (key_a, key_b):
        assert secret not in listed.output and hash_key(secret) not in listed.output
    id_a = rows[0][0]
    only_b = layerswap(env, "keys", "list", "--tenant", "team-b").stdout.splitlines()[1:]
    assert [line.split()[1] for line in only_b] == ["team-b"]

    with running_service(tmp_path, database_url, examples, auth=True) as service:
        clock = Clock()
        service.client.app.state.context.keys.clock = clock  # type: ignore[attr-defined]

        def status(key: str) -> int:
            headers = {"Authorization": f"Bearer {key}"}
            return service.client.get("/v1/merges", headers=headers).status_code

        assert status(key_a) == status(key_b) == 200

        revoked = layerswap(env, "keys", "revoke", id_a)
        assert revoked.exit_code == 0 and f"key {id_a} of tenant team-a revoked" in revoked.stdout
        clock.now += KEY_CACHE_S  # the bound: no restart needed
        assert status(key_a) == 401 and status(key_b) == 200

        again = layerswap(env, "keys", "revoke", id_a)
        assert again.exit_code == 0 and "already revoked" in again.stdout

        by_secret = layerswap(env, "keys", "revoke", key_b)  # a leaked key, its id not at hand
        assert by_secret.exit_code == 0 and "team-b revoked" in by_secret.stdout
        assert key_b not in by_secret.output
        clock.now += KEY_CACHE_S
        assert status(key_b) == 401

    unknown = layerswap(env, "keys", "revoke", "no-such-id")
    assert unknown.exit_code == 2
    assert "[not_found]" in unknown.stderr and "no-such-id" in unknown.stderr
    unknown_secret = layerswap(env, "keys", "revoke", "lsk_never-issued")
    assert unknown_secret.exit_code == 2 and "lsk_never-issued" not in unknown_secret.output

    after = [line.split() for line in layerswap(env, "keys", "list").stdout.splitlines()[1:]]
    assert all(row[3] != "-" for row in after)  # both show when they were revoked
