"""Webhook signing secrets at rest: encrypted (the rows, read with raw SQL, hold no secret), with
a key made in the data directory (0600) or keys from LAYERSWAP_WEBHOOK_SECRET_KEYS, newest
first; plaintext secrets of an older release are encrypted at start-up and keep signing; a
rotated endpoint secret signs beside the new one for the overlap, then no more; a key rotation
still decrypts old rows; keys that cannot decrypt the stored secrets stop `layerswap serve` at
start-up with a message saying what to set. Receivers verify with the standardwebhooks
library; SQLite and PostgreSQL."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cryptography.fernet import Fernet
from sqlalchemy import create_engine, text
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from core.db.migrate import upgrade
from core.settings import Settings
from tests.distributed.conftest import free_port
from tests.service.conftest import Service, running_service
from tests.webhooks.conftest import FAST, announce
from tests.webhooks.receiver import Received, Receiver, wait_for


def row(url: str, sql: str, **params: Any) -> Any:
    """One value, read with raw SQL (not through the models)."""
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return connection.execute(text(sql), params).scalar_one()
    finally:
        engine.dispose()


def stored_secret(service: Service, endpoint_id: str, column: str = "secret") -> str:
    sql = f"SELECT {column} FROM webhook_endpoints WHERE id = :id"
    return str(row(service.settings.database, sql, id=endpoint_id))


def verifies(secret: str, received: Received) -> bool:
    try:
        Webhook(secret).verify(received.body, received.headers)
    except WebhookVerificationError:
        return False
    return True


def next_event(service: Service, receiver: Receiver) -> Received:
    """Announce an event; the request the receiver gets for it."""
    job_id = announce(service.db, "default")
    (found,) = receiver.wait_for(
        lambda: [r for r in receiver.received if job_id in r.body.decode()], "the event"
    )
    return found


def test_secrets_are_encrypted_at_rest_with_a_key_made_in_the_data_dir(
    tmp_path: Path, database_url: str, examples: Path, receiver: Receiver
) -> None:
    with running_service(tmp_path, database_url, examples, **FAST) as service:
        key_file = service.settings.data_dir / "webhook-secrets.key"
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        key = Fernet(key_file.read_bytes().strip())
        created = service.client.post("/v1/webhooks", json={"url": receiver.url}).json()
        one_off = service.client.get("/v1/webhooks/secret").json()["secret"]

        stored = stored_secret(service, created["id"])
        assert created["secret"] not in stored and "whsec_" not in stored
        assert key.decrypt(stored.encode()).decode() == created["secret"]
        tenants = row(service.settings.database, "SELECT webhook_secret FROM tenants")
        assert one_off not in tenants and key.decrypt(tenants.encode()).decode() == one_off

        received = next_event(service, receiver)
        assert verifies(created["secret"], received)


def test_a_rotated_secret_signs_beside_the_new_one_for_the_overlap(
    tmp_path: Path, database_url: str, examples: Path, receiver: Receiver
) -> None:
    with running_service(tmp_path, database_url, examples, **FAST) as service:
        assert service.settings.webhook_secret_overlap_s == 24 * 3600  # the default
        created = service.client.post("/v1/webhooks", json={"url": receiver.url}).json()
        old = created["secret"]
        rotate = f"/v1/webhooks/{created['id']}/rotate-secret"
        rotated = service.client.post(rotate).json()
        new = rotated["secret"]
        assert new != old and rotated["previous_secret_expires_at"] is not None
        assert "whsec_" not in stored_secret(service, created["id"], "previous_secret")

        during = next_event(service, receiver)
        assert len(during.headers["webhook-signature"].split(" ")) == 2
        assert verifies(old, during) and verifies(new, during)

        # Rotated again with a short overlap: the secret before signs until it ends...
        newest = service.client.post(rotate, json={"overlap_s": 2}).json()["secret"]
        shown = f"/v1/webhooks/{created['id']}"
        assert service.client.get(shown).json()["previous_secret_expires_at"] is not None
        again = next_event(service, receiver)
        assert verifies(newest, again) and verifies(new, again) and not verifies(old, again)

        # ...and not after.
        wait_for(
            lambda: service.client.get(shown).json()["previous_secret_expires_at"] is None,
            "the overlap to end",
        )
        after = next_event(service, receiver)
        assert after.headers["webhook-signature"].count("v1,") == 1
        assert verifies(newest, after) and not verifies(new, after)


def test_a_key_rotation_still_decrypts_old_rows(
    tmp_path: Path, database_url: str, examples: Path, receiver: Receiver
) -> None:
    first, second = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    with running_service(
        tmp_path, database_url, examples, webhook_secret_keys=[first], **FAST
    ) as service:
        created = service.client.post("/v1/webhooks", json={"url": receiver.url}).json()
        assert Fernet(first).decrypt(stored_secret(service, created["id"]).encode())
    assert not (tmp_path / "data" / "webhook-secrets.key").exists()  # the setting's keys only

    rotated = {"webhook_secret_keys": [second, first], **FAST}
    with running_service(tmp_path, database_url, examples, **rotated) as service:
        assert verifies(created["secret"], next_event(service, receiver))
        # Re-encrypted under the newest key at start-up: the old key can then be retired.
        stored = stored_secret(service, created["id"]).encode()
        assert Fernet(second).decrypt(stored).decode() == created["secret"]

    retired = {"webhook_secret_keys": [second], **FAST}
    with running_service(tmp_path, database_url, examples, **retired) as service:
        assert verifies(created["secret"], next_event(service, receiver))


def test_plaintext_secrets_of_an_older_release_are_encrypted_and_keep_signing(
    tmp_path: Path, database_url: str, examples: Path, receiver: Receiver
) -> None:
    plain, one_off = "whsec_" + "A" * 43 + "=", "whsec_" + "B" * 43 + "="
    upgrade(database_url, "0007")
    engine = create_engine(database_url)
    with engine.begin() as connection:
        connection.execute(
            text("INSERT INTO tenants (id, created_at, webhook_secret) VALUES ('default', :t, :s)"),
            {"t": "2026-11-01 12:00:00", "s": one_off},
        )
        connection.execute(
            text(
                "INSERT INTO webhook_endpoints (id, tenant_id, url, events, description, secret, "
                "created_at) VALUES ('e1', 'default', :url, :events, '', :secret, :t)"
            ),
            {"url": receiver.url, "events": '["merge.succeeded"]', "secret": plain,
             "t": "2026-11-01 12:00:00"},
        )  # fmt: skip
    engine.dispose()

    with running_service(tmp_path, database_url, examples, **FAST) as service:
        stored = stored_secret(service, "e1")
        assert stored != plain and "whsec_" not in stored
        tenants = row(service.settings.database, "SELECT webhook_secret FROM tenants")
        assert "whsec_" not in tenants
        assert service.client.get("/v1/webhooks/secret").json()["secret"] == one_off
        assert verifies(plain, next_event(service, receiver))  # the receiver changes nothing


def test_the_keys_setting_takes_a_json_list_or_commas(monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    for value in (f'["{first}", "{second}"]', f"{first}, {second}", f"{first},{second}"):
        monkeypatch.setenv("LAYERSWAP_WEBHOOK_SECRET_KEYS", value)
        keys = Settings().webhook_secret_keys
        assert [k.get_secret_value() for k in keys] == [first, second]
        assert first not in repr(Settings())  # never shown


def serve_until_exit(tmp_path: Path, url: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`layerswap serve` on this data dir and database, expected to refuse to start."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSWAP_")}
    environment.update(
        LAYERSWAP_DATA_DIR=str(tmp_path / "data"), LAYERSWAP_DATABASE_URL=url,
        LAYERSWAP_PORT=str(free_port()), **env,
    )  # fmt: skip
    layerswap = Path(sys.executable).parent / "layerswap"
    return subprocess.run(
        [str(layerswap), "serve"], env=environment, capture_output=True, text=True, timeout=120
    )


def test_keys_that_cannot_decrypt_the_stored_secrets_stop_the_start(
    tmp_path: Path, database_url: str, examples: Path
) -> None:
    key = Fernet.generate_key().decode()
    with running_service(
        tmp_path, database_url, examples, webhook_secret_keys=[key], **FAST
    ) as service:
        response = service.client.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/h"})
        assert response.status_code == 201

    wrong = serve_until_exit(
        tmp_path, database_url, LAYERSWAP_WEBHOOK_SECRET_KEYS=Fernet.generate_key().decode()
    )
    assert wrong.returncode != 0
    assert (
        "1 stored webhook signing secret(s) cannot be decrypted with the keys from "
        "LAYERSWAP_WEBHOOK_SECRET_KEYS" in wrong.stderr + wrong.stdout
    )

    missing = serve_until_exit(tmp_path, database_url)  # a new key file: not the one used
    assert missing.returncode != 0
    output = missing.stderr + missing.stdout
    assert "cannot be decrypted with the keys from the key file" in output
    assert "set LAYERSWAP_WEBHOOK_SECRET_KEYS" in output
    for refused in (wrong, missing):  # one line, before the API starts
        assert refused.returncode == 2 and "Traceback" not in refused.stderr
        assert refused.stderr.startswith("layerswap: error [invalid_settings]: ")

    malformed = serve_until_exit(tmp_path, database_url, LAYERSWAP_WEBHOOK_SECRET_KEYS="nope")
    assert malformed.returncode != 0
    assert "key 1 is not a Fernet key" in malformed.stderr + malformed.stdout

    with running_service(
        tmp_path, database_url, examples, webhook_secret_keys=[key], **FAST
    ) as service:  # the right key starts
        assert [e["id"] for e in service.client.get("/v1/webhooks").json()["items"]] == [
            response.json()["id"]
        ]
