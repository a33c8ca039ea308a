"""One job and its output artifact in one SELECT, read through the driver itself; and the
detached ORM objects built from such a row.

A row is the driver's own values by position (JSON as its text; on SQLite, datetimes as text and
booleans as integers too). It compares whole as cheaply as it reads, and equal rows make equal
views: that is how an answer made from an earlier row is known to still be the job's
(service/api/answers.py). SQLAlchemy's conversions are made only when the objects are built
(`job_of`), which also keeps the objects and the row one read. The statements are built and
compiled by SQLAlchemy once, and run on a pooled connection's own cursor: for a keyed read its
execution and result rows cost more than the read (SQLite, in-process, 2 cores: 140-220 µs of
CPU for a GET's row through SQLAlchemy Core, 20-35 µs through the sqlite3 module). On
PostgreSQL the JSON columns are read as text (decoded only for a view), and a page of 50
merges whose answers are kept fell from ~7 ms of CPU to ~2 ms.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from psycopg.types.string import TextLoader
from pydantic_core import from_json
from sqlalchemy import (
    JSON,
    Dialect,
    Integer,
    Select,
    String,
    any_,
    bindparam,
    select,
    tuple_,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import attributes
from sqlalchemy.orm.instrumentation import manager_of_class
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler

from core.db.models import Artifact, Job, LineageEdge
from core.db.session import Database

_JOB = Job.__table__
_ARTIFACT = Artifact.__table__
_SELECT = select(_JOB, *(c.label("artifact_" + c.name) for c in _ARTIFACT.c)).select_from(
    _JOB.outerjoin(_ARTIFACT, _JOB.c.output_artifact_id == _ARTIFACT.c.id)
)
ONE = _SELECT.where(_JOB.c.id == bindparam("job_id"))
# PostgreSQL: one statement for any number of ids (an IN list would be a new one per length)
MANY = _SELECT.where(_JOB.c.id == any_(bindparam("job_ids", type_=postgresql.ARRAY(String))))

# A row's values by position: the columns of _SELECT, in order (`artifact_<name>` for the
# artifact's).
_AT = {column.name: at for at, column in enumerate(_SELECT.selected_columns)}
ID, TENANT, KIND, CREATED_AT = _AT["id"], _AT["tenant_id"], _AT["kind"], _AT["created_at"]
_JOB_FIELDS = [(a.key, _AT[a.columns[0].name]) for a in Job.__mapper__.column_attrs]
_ARTIFACT_FIELDS = [
    (a.key, _AT["artifact_" + a.columns[0].name]) for a in Artifact.__mapper__.column_attrs
]
_ARTIFACT_ID = _AT["artifact_id"]
Processors = tuple[Callable[[Any], Any] | None, ...]
_Model = TypeVar("_Model", Job, Artifact)


@functools.cache
def page_select(*, status: bool, artifact: bool, after: bool) -> Select[*tuple[Any, ...]]:
    """A page of a list: the jobs of :tenant of :kind with their output artifacts, newest first
    (created_at, then id), :limit of them; with `status` only those of :status, with `artifact`
    only those with a lineage edge :direction to :artifact_id, with `after` only those after
    (:created_at, :last_id) in that order. Built once per shape, so compiled once."""
    query = _SELECT.where(_JOB.c.tenant_id == bindparam("tenant"), _JOB.c.kind == bindparam("kind"))
    if status:
        query = query.where(_JOB.c.status == bindparam("status"))
    if artifact:
        edges = LineageEdge.__table__.c
        query = query.where(
            _JOB.c.id.in_(
                select(edges.job_id).where(
                    edges.direction == bindparam("direction"),
                    edges.artifact_id == bindparam("artifact_id"),
                )
            )
        )
    if after:
        created_at = bindparam("created_at", type_=_JOB.c.created_at.type)
        query = query.where(
            tuple_(_JOB.c.created_at, _JOB.c.id) < tuple_(created_at, bindparam("last_id"))
        )
    ordered = query.order_by(_JOB.c.created_at.desc(), _JOB.c.id.desc())
    return ordered.limit(bindparam("limit", type_=Integer))


def fetch(
    db: Database, query: Select[*tuple[Any, ...]], params: dict[str, Any]
) -> list[Sequence[Any]]:
    """The rows of `query` (ONE, MANY or a page_select) with `params`, as the driver hands
    them back, on a connection of the Database's pool (Database.driver_cursor); blocking."""
    sql, values = driver_statement(query, db.engine.dialect, params)
    with db.driver_cursor() as cursor:
        if not db.is_sqlite:
            for json_type in ("json", "jsonb"):  # this cursor's only: text, decoded in job_of
                cursor.adapters.register_loader(json_type, TextLoader)
        cursor.execute(sql, values)
        rows: list[Sequence[Any]] = cursor.fetchall()
        return rows


def driver_statement(
    query: ClauseElement, dialect: Dialect, params: dict[str, Any]
) -> tuple[str, Any]:
    """`query`'s SQL for `dialect`'s driver, and `params` as that driver takes them (SQLite:
    positional, datetimes as text; PostgreSQL: by name)."""
    compiled, converters = _compile_once(query, dialect)
    values = dict(compiled.construct_params(params) or {})
    for name, convert in converters.items():
        values[name] = convert(values[name])
    if compiled.positiontup is None:
        return compiled.string, values
    return compiled.string, [values[name] for name in compiled.positiontup]


@functools.cache
def _compile_once(query: ClauseElement, dialect: Dialect) -> tuple[SQLCompiler, dict[str, Any]]:
    """`query` compiled for `dialect`, and how SQLAlchemy converts the parameters that need it
    (SQLite: datetimes to text), by name."""
    compiled = query.compile(dialect=dialect)
    assert isinstance(compiled, SQLCompiler)
    converters: dict[str, Any] = {}
    for bind, name in compiled.bind_names.items():
        convert = bind.type.dialect_impl(dialect).bind_processor(dialect)
        if convert is not None:
            converters[name] = convert
    return compiled, converters


def driver_select(dialect: Dialect) -> str:
    """ONE's SQL for `dialect`'s driver, with one positional parameter (SQLite: the job id)."""
    return ONE.compile(dialect=dialect).string


@functools.cache
def driver_processors(dialect: Dialect) -> Processors:
    """What SQLAlchemy would make of each column of a row read by `fetch` or `driver_select`:
    on SQLite its own conversions (JSON text, datetimes as text, booleans as integers); on
    PostgreSQL the JSON, read as text; None where the value stands as it is. JSON is decoded
    by pydantic's parser, which makes the same values as the json module in less than half
    its time (a list page decodes ~350 documents)."""
    if dialect.name == "sqlite":
        return tuple(
            from_json
            if isinstance(column.type, JSON)
            else column.type.dialect_impl(dialect).result_processor(dialect, None)
            for column in _SELECT.selected_columns
        )
    return tuple(
        from_json if isinstance(column.type, JSON) else None for column in _SELECT.selected_columns
    )


def driver_value(dialect: Dialect, row: Sequence[Any], at: int) -> Any:
    """One value of a driver's row as SQLAlchemy would hand it back."""
    process = driver_processors(dialect)[at]
    return row[at] if process is None or row[at] is None else process(row[at])


def processed(values: Sequence[Any], processors: Processors) -> list[Any]:
    """A driver's row as SQLAlchemy would hand it back."""
    converted = list(values)
    for at, process in _active(processors):
        value = converted[at]
        if value is not None:
            converted[at] = process(value)
    return converted


@functools.cache
def _active(processors: Processors) -> tuple[tuple[int, Callable[[Any], Any]], ...]:
    """The processors that convert something, with their columns' positions."""
    return tuple((at, process) for at, process in enumerate(processors) if process is not None)


def job_of(row: Sequence[Any]) -> Job:
    """A detached Job as Session.get(Job, id, options=[jobs.OUTPUT]) would load it, from a
    row as SQLAlchemy hands it back (`processed`): its output artifact is loaded with it
    (merges.loaded_output finds it)."""
    job = _loaded(Job, {key: row[at] for key, at in _JOB_FIELDS})
    artifact = None
    if row[_ARTIFACT_ID] is not None:
        artifact = _loaded(Artifact, {key: row[at] for key, at in _ARTIFACT_FIELDS})
    attributes.set_committed_value(job, "output_artifact", artifact)
    return job


def _loaded(model: type[_Model], values: dict[str, Any]) -> _Model:
    """An instance of `model` holding `values` as loaded ones, made as the ORM makes what it
    loads (its state's dict filled directly): the constructor's attribute events cost twice
    as much as the rest of making a view's Job (112 µs of 158 per row, SQLite, in-process)."""
    instance: _Model = manager_of_class(model).new_instance()
    instance.__dict__.update(values)
    return instance
