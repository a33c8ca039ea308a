"""Schema management: Alembic migrations are the only way the schema is created.

The migrations ship inside this package (core/db/migrations, package data), so an installed
wheel finds them as well as a checkout does."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


@dataclass(frozen=True)
class SchemaChange:
    """The schema revision before and after an upgrade (None: no schema yet)."""

    before: str | None
    after: str | None

    def describe(self) -> str:
        if self.before == self.after:
            return f"database schema is up to date (revision {self.after})"
        return f"database schema migrated from {self.before or '<none>'} to {self.after}"


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def current_revision(url: str) -> str | None:
    """The revision the database is at; None for a database without our schema."""
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()


def upgrade(url: str, revision: str = "head") -> SchemaChange:
    before = current_revision(url)
    command.upgrade(alembic_config(url), revision)
    return SchemaChange(before, current_revision(url))
