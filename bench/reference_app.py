"""The reference for the API's cost per poll: a minimal FastAPI app that answers
`GET /v1/merges/{id}` as plainly as FastAPI allows, on the same store as `layerswap serve`.

One plain route (a path parameter, nothing injected), one raw SQL read of the job's row and its
output artifact's by id and tenant (the stdlib sqlite3 module on the event loop's thread for
SQLite, as the service reads; psycopg's async connections, a few of them, for PostgreSQL), and
the row as a JSON response (`json.dumps`, no model). 404 when there is no such job. No
authentication, ETag, long poll or request checks: what is left is the floor that FastAPI,
uvicorn and the database driver set, which bench/api_cost.py divides the service's throughput by.

Served as `layerswap serve` serves (`uvicorn.run(app, host=..., port=..., log_level="info")`:
one process, uvloop and httptools when installed, access log on):

    .venv/bin/python bench/reference_app.py --database sqlite:////tmp/x/layerswap.db --port 8100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import uvicorn
from fastapi import FastAPI, Response

POSTGRES_CONNECTIONS = 4  # as many as the service's job-reading threads on 2 cores
SELECT = (
    "SELECT jobs.*, artifacts.id AS artifact_id, artifacts.location AS artifact_location, "
    "artifacts.files AS artifact_files, artifacts.published AS artifact_published "
    "FROM jobs LEFT OUTER JOIN artifacts ON jobs.output_artifact_id = artifacts.id "
    "WHERE jobs.id = {job} AND jobs.tenant_id = {tenant}"
)
Reader = Callable[[str], Awaitable[dict[str, Any] | None]]


def _plain(value: object) -> object:
    return value.isoformat() if isinstance(value, datetime) else value


def sqlite_reader(path: str) -> Reader:
    connection = sqlite3.connect(path, check_same_thread=False)
    connection.row_factory = sqlite3.Row
    statement = SELECT.format(job="?", tenant="?")

    async def read(job_id: str) -> dict[str, Any] | None:
        row = connection.execute(statement, (job_id, TENANT)).fetchone()
        return None if row is None else dict(row)

    return read


async def postgres_reader(url: str) -> Reader:
    import psycopg
    from psycopg.rows import dict_row

    idle: asyncio.Queue[psycopg.AsyncConnection[dict[str, Any]]] = asyncio.Queue()
    for _ in range(POSTGRES_CONNECTIONS):
        idle.put_nowait(
            await psycopg.AsyncConnection.connect(url, autocommit=True, row_factory=dict_row)
        )
    statement = SELECT.format(job="%s", tenant="%s")

    async def read(job_id: str) -> dict[str, Any] | None:
        connection = await idle.get()
        try:
            cursor = await connection.execute(statement, (job_id, TENANT))
            return await cursor.fetchone()
        finally:
            idle.put_nowait(connection)

    return read


TENANT = "default"


def make_app(database: str) -> FastAPI:
    readers: list[Reader] = []

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if database.startswith("sqlite"):
            readers.append(sqlite_reader(database.split(":///", 1)[1]))
        else:
            readers.append(await postgres_reader(database.replace("+psycopg", "", 1)))
        yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/v1/merges/{job_id}")
    async def get_merge(job_id: str) -> Response:
        row = await readers[0](job_id)
        if row is None:
            return Response(b'{"error":"not found"}', 404, media_type="application/json")
        body = json.dumps({k: _plain(v) for k, v in row.items()})
        return Response(body, media_type="application/json")

    @app.get("/readyz")
    async def ready() -> dict[str, str]:
        return {"status": "ready"}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--database", required=True, help="the service's SQLAlchemy URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(make_app(args.database), host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
