"""`layerswap keys` (API keys) and `layerswap db` (the schema)."""

from __future__ import annotations

import click

from core.db.migrate import upgrade
from core.db.session import Database
from core.errors import ServiceError
from layerswap.cli.common import fail, load_settings
from service.auth import create_key, list_keys, revoke_key


@click.group()
def keys() -> None:
    """API keys."""


@keys.command("create")
@click.option("--tenant", required=True, help="The tenant the key acts for.")
def keys_create(tenant: str) -> None:
    """Create an API key and print it (only this once; only its hash is stored)."""
    settings = load_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database)
    try:
        click.echo(create_key(Database(settings.database), tenant))
    except ServiceError as e:
        fail(e.code, e.message, 2)


@keys.command("list")
@click.option("--tenant", help="Only this tenant's keys.")
def keys_list(tenant: str | None) -> None:
    """List keys: id, tenant, created, revoked (never the secret)."""
    found = list_keys(_key_database(), tenant=tenant)
    click.echo(f"{'ID':<32}  {'TENANT':<20}  {'CREATED':<25}  REVOKED")
    for key in found:
        revoked = key.revoked_at.isoformat(timespec="seconds") if key.revoked_at else "-"
        created = key.created_at.isoformat(timespec="seconds")
        click.echo(f"{key.id:<32}  {key.tenant:<20}  {created:<25}  {revoked}")


@keys.command("revoke")
@click.argument("key_id")
def keys_revoke(key_id: str) -> None:
    """Revoke a key by its id (from `keys list`) or by the key itself; every API process
    refuses it within a second (each remembers a key it looked up for at most that long)."""
    try:
        key, revoked_now = revoke_key(_key_database(), key_id)
    except ServiceError as e:
        fail(e.code, e.message, 2)
    assert key.revoked_at is not None
    when = key.revoked_at.isoformat(timespec="seconds")
    state = "revoked" if revoked_now else "was already revoked"
    click.echo(f"key {key.id} of tenant {key.tenant} {state} ({when})")


def _key_database() -> Database:
    settings = load_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database)
    return Database(settings.database)


@click.group()
def db() -> None:
    """Database schema."""


@db.command("upgrade")
def db_upgrade() -> None:
    """Apply Alembic migrations up to the newest."""
    settings = load_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    click.echo(upgrade(settings.database).describe())
