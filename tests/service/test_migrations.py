"""Migrations with data in place: rows written at 0001 survive 0002 to 0006, step by step,
and read correctly through the models at head, on real SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from alembic.script import ScriptDirectory
from click.testing import CliRunner
from sqlalchemy import MetaData, create_engine, inspect

from core.db.migrate import SchemaChange, alembic_config, current_revision, upgrade
from core.db.models import ApiKey, Artifact, Job, JobEvent, LineageEdge, Tenant, as_utc
from core.db.session import Database
from core.lineage import artifact_dict, graph
from core.quota import usage
from layerswap.cli import cli
from service.schemas import JobRead, job_read

WHEN = datetime(2026, 11, 1, 12, 30, 15, 123456, tzinfo=UTC)
REQUEST = {
    "method": "layer_swap",
    "experts": {"task": ["math"], "language": ["swh"]},
    "params": {"bottom": 1, "top": 1, "non_layer": "average"},
    "output": {"name": "gen1", "dtype": "source", "shard_size": "5GB"},
}
FILES = {"model.safetensors": "a" * 64, "config.json": "b" * 64}

ROWS: dict[str, list[dict[str, Any]]] = {
    "tenants": [{"id": "team-a", "created_at": WHEN}],
    "api_keys": [
        {"id": "k1", "tenant_id": "team-a", "key_hash": "c" * 64, "created_at": WHEN,
         "revoked_at": None},
    ],
    "artifacts": [
        {"id": "in1", "tenant_id": "team-a", "kind": "checkpoint", "location": "/ck/math",
         "content_digest": "d" * 64, "files": FILES, "architecture": "llama", "num_layers": 6,
         "created_at": WHEN},
        {"id": "out1", "tenant_id": "team-a", "kind": "checkpoint",
         "location": "/data/artifacts/team-a/gen1", "content_digest": "e" * 64, "files": FILES,
         "architecture": "llama", "num_layers": 6, "created_at": WHEN},
    ],
    "jobs": [
        {"id": "j1", "tenant_id": "team-a", "kind": "merge", "status": "succeeded",
         "stage": None, "request": REQUEST, "request_hash": "f" * 64, "idempotency_key": "k-1",
         "output_name": "gen1", "plan_digest": "9" * 64,
         "plan_summary": [{"layer": 0, "from": "language"}], "bytes_done": 1 << 33,
         "bytes_total": 1 << 33, "tensors_done": 57, "tensors_total": 57, "attempts": 2,
         "max_attempts": 3, "cancel_requested": False, "error": None,
         "result": {"warnings": [], "seconds": 1.5}, "output_artifact_id": "out1",
         "created_at": WHEN, "started_at": WHEN, "finished_at": WHEN, "heartbeat_at": WHEN},
    ],
    "job_events": [
        {"job_id": "j1", "type": "queued", "data": {}, "created_at": WHEN},
        {"job_id": "j1", "type": "succeeded", "data": {"artifact_id": "out1"}, "created_at": WHEN},
    ],
    "lineage_edges": [
        {"job_id": "j1", "artifact_id": "in1", "direction": "input", "role": "task",
         "label": "task[0]", "weight": 0.5},
        {"job_id": "j1", "artifact_id": "out1", "direction": "output", "role": "output",
         "label": "output", "weight": None},
    ],
}  # fmt: skip


def write_at_0001(url: str) -> None:
    """Insert through the schema as 0001 made it (reflected), not through today's models."""
    engine = create_engine(url)
    try:
        tables = MetaData()
        tables.reflect(engine)
        with engine.begin() as connection:
            for name, rows in ROWS.items():
                connection.execute(tables.tables[name].insert(), rows)
    finally:
        engine.dispose()


def test_rows_written_at_0001_read_correctly_at_head(database_url: str) -> None:
    upgrade(database_url, "0001")
    assert current_revision(database_url) == "0001"
    write_at_0001(database_url)
    upgrade(database_url, "0002")
    assert current_revision(database_url) == "0002"
    upgrade(database_url, "0003")
    assert current_revision(database_url) == "0003"
    upgrade(database_url, "0004")
    assert current_revision(database_url) == "0004"
    upgrade(database_url, "0005")
    assert current_revision(database_url) == "0005"
    upgrade(database_url, "0006")
    assert current_revision(database_url) == "0006"
    engine = create_engine(database_url)
    assert {c["name"] for c in inspect(engine).get_columns("artifacts")} >= {
        "published", "size_bytes", "deleted_at"
    }  # fmt: skip
    assert {"evaluation_scores", "sweeps", "webhook_endpoints", "webhook_events",
            "webhook_deliveries"} <= set(inspect(engine).get_table_names())  # fmt: skip
    engine.dispose()

    db = Database(database_url)
    try:
        with db.session() as session:
            tenant = session.get(Tenant, "team-a")
            assert tenant is not None and as_utc(tenant.created_at) == WHEN
            assert tenant.webhook_secret is None  # added by 0006, made on first use
            key = session.get(ApiKey, "k1")
            assert key is not None and key.key_hash == "c" * 64 and key.revoked_at is None
            job = session.get(Job, "j1")
            assert job is not None
            for column, value in ROWS["jobs"][0].items():
                got = getattr(job, column)
                assert (as_utc(got) if isinstance(got, datetime) else got) == value, column
            assert job.sources is None  # added by 0002
            assert job.sweep_id is None  # added by 0005
            events = session.query(JobEvent).order_by(JobEvent.id).all()
            assert [(e.type, e.data) for e in events] == [
                ("queued", {}),
                ("succeeded", {"artifact_id": "out1"}),
            ]
            output = session.get(Artifact, "out1")
            assert output is not None and output.files == FILES
            assert (output.published, output.size_bytes, output.deleted_at) == (None, None, None)
            edges = session.query(LineageEdge).order_by(LineageEdge.id).all()
            assert [(e.artifact_id, e.role, e.weight) for e in edges] == [
                ("in1", "task", 0.5),
                ("out1", "output", None),
            ]
            assert usage(session, "team-a") == 0  # sizes unknown before 0003 count nothing

        read = JobRead.model_validate(job_read(job))
        assert (read.status, read.attempts, read.request) == ("succeeded", 2, REQUEST)
        assert read.progress.bytes_done == 1 << 33 and read.progress.fraction == 1.0
        assert read.sources == []
        ancestors = graph(db, tenant="team-a", artifact_id="out1", direction="ancestors")
        assert {a["id"] for a in ancestors["artifacts"]} == {"in1", "out1"}
        assert ancestors["jobs"][0]["inputs"][0]["weight"] == 0.5
        shown = artifact_dict(output)
        assert shown["created_at"] == WHEN.isoformat()
        assert (shown["size_bytes"], shown["deleted_at"], shown["published"]) == (None, None, [])
    finally:
        db.dispose()


def test_db_upgrade_says_what_it_did(database_url: str, tmp_path: Path) -> None:
    """On an empty database it migrates from nothing to the newest revision and says so; run
    again, it says the schema is up to date; from an older revision, it names both."""
    head = ScriptDirectory.from_config(alembic_config(database_url)).get_current_head()
    env = {"LAYERSWAP_DATABASE_URL": database_url, "LAYERSWAP_DATA_DIR": str(tmp_path / "data")}
    runner = CliRunner()

    first = runner.invoke(cli, ["db", "upgrade"], env=env)
    assert first.exit_code == 0, first.output
    assert first.output.strip() == f"database schema migrated from <none> to {head}"
    assert current_revision(database_url) == head

    again = runner.invoke(cli, ["db", "upgrade"], env=env)
    assert again.exit_code == 0, again.output
    assert again.output.strip() == f"database schema is up to date (revision {head})"


def test_upgrade_from_an_older_revision_reports_both(database_url: str) -> None:
    assert upgrade(database_url, "0006") == SchemaChange(None, "0006")
    change = upgrade(database_url)
    assert change.before == "0006" and change.after == current_revision(database_url) != "0006"
    assert change.describe() == f"database schema migrated from 0006 to {change.after}"
