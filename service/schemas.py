"""HTTP request/response models. The merge request body IS the engine's recipe schema."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from functools import cache
from typing import TYPE_CHECKING, Annotated, Any, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag
from pydantic_core import to_json

from core.db.models import Job, as_utc
from core.evaluation.spec import EvaluationSpec
from core.kinds import kind_of
from engine.methods import METHODS
from engine.schema.parts import Arithmetic, Credential, OutputOptions, RecipeBase

UtcTime = Annotated[datetime, AfterValidator(as_utc)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Evaluated(BaseModel):
    evaluation: EvaluationSpec | None = Field(
        None, description="evaluate the merged model with lm-eval once the merge succeeds"
    )
    webhook: str | None = Field(
        None,
        max_length=2000,
        description="a one-off http(s) URL told when this merge ends (and when its output is "
        "published), signed with the tenant's secret (GET /v1/webhooks/secret)",
    )


@cache
def _merge_request(recipe: type[RecipeBase]) -> type[RecipeBase]:
    """A method's recipe schema with the request-only fields (SoupRecipe -> SoupMerge)."""
    name = recipe.__name__.removesuffix("Recipe") + "Merge"
    return type(name, (recipe, _Evaluated), {"__module__": __name__, "__doc__": recipe.__doc__})


MAX_MERGEKIT_YAML = 256 * 1024  # characters: configs on model cards are a few hundred


class MergekitMerge(_Evaluated):
    """A mergekit 0.1.5 config, translated into a Layerswap recipe at submit; the job runs and
    shows that recipe, and keeps the config for lineage (docs: mergekit recipes)."""

    model_config = ConfigDict(extra="forbid")
    mergekit: dict[str, Any] | Annotated[str, Field(max_length=MAX_MERGEKIT_YAML)] = Field(
        description="the config: a mapping (merge_method, models or slices, base_model, "
        "parameters, dtype, out_dtype, tokenizer_source, name), or its YAML text"
    )
    output: OutputOptions = Field(
        OutputOptions(),
        description="Layerswap's output options the config has no word for (hub, mlflow, "
        "shard_size); the dtype comes from the config's out_dtype or dtype, the name from its "
        "name or here",
    )
    credential: Credential = None  # for hf:// sources
    arithmetic: Arithmetic | None = Field(
        None,
        description="the dtype to compute in instead of mergekit's (the config's dtype, or the "
        "checkpoints' own): float32 computes a bf16 or fp16 config more precisely than "
        "mergekit, and not to its bytes",
    )


def _merge_kind(body: Any) -> str | None:
    """The request's member of MergeRequest: a mergekit config, or the recipe's method."""
    if isinstance(body, dict):
        found = "mergekit" if "mergekit" in body else body.get("method")
        return found if isinstance(found, str) else None
    return "mergekit" if isinstance(body, MergekitMerge) else getattr(body, "method", None)


# A merge request: the recipe schema of `layerswap merge`, or a mergekit config; plus an
# optional evaluation and webhook. POST /v1/merges takes merge_request(), made with the app.
if TYPE_CHECKING:

    class RecipeRequest(RecipeBase, _Evaluated): ...

    MergeRequest = RecipeRequest | MergekitMerge
else:
    MergeRequest = Any


def merge_request() -> Any:
    """MergeRequest's type for the methods registered now: each one's recipe schema, tagged by
    its name, or a mergekit config."""
    return _merge_request_union(tuple((m.name, m.recipe) for m in METHODS.values()))


@cache
def _merge_request_union(methods: tuple[tuple[str, type[RecipeBase]], ...]) -> Any:
    tagged = tuple(Annotated[_merge_request(recipe), Tag(name)] for name, recipe in methods)
    return Annotated[
        Union[(*tagged, Annotated[MergekitMerge, Tag("mergekit")])],
        Discriminator(_merge_kind),
    ]


class ErrorBody(BaseModel):
    code: str
    message: str
    details: dict[str, Any] = {}


class ProgressRead(BaseModel):
    unit: str = Field(
        "bytes", description="what done/total count: bytes, or requests (evaluations)"
    )
    done: int
    total: int
    bytes_done: int
    bytes_total: int
    tensors_done: int
    tensors_total: int
    fraction: float
    eta_s: float | None


class FileRead(BaseModel):
    name: str
    sha256: str


class PublishedRead(BaseModel):
    repo: str
    branch: str
    commit: str
    url: str


class OutputRead(BaseModel):
    artifact_id: str
    name: str
    location: str
    files: list[FileRead]
    published: list[PublishedRead] = Field(default_factory=list, description="Hub commits")


class HubSourceRead(BaseModel):
    field: str
    source: str = Field(description="as submitted")
    repo: str
    revision: str
    sha: str = Field(description="the commit the job reads, fixed at submit time")


class JobRead(BaseModel):
    id: str
    kind: str
    status: str
    stage: str | None
    attempts: int
    progress: ProgressRead
    created_at: UtcTime
    started_at: UtcTime | None
    finished_at: UtcTime | None
    error: ErrorBody | None
    request: dict[str, Any]
    plan: list[dict[str, Any]] | None = Field(None, description="per-layer provenance")
    plan_digest: str | None
    output: OutputRead | None = None
    result: dict[str, Any] | None = None
    sources: list[HubSourceRead] = Field(default_factory=list, description="pinned Hub sources")


class JobPage(BaseModel):
    items: list[JobRead]
    next_cursor: str | None


class JobSummary(BaseModel):
    """A row of GET /v1/jobs: any kind of job, or a sweep."""

    id: str
    kind: str
    status: str
    stage: str | None
    name: str | None
    method: str | None = Field(
        description="a merge's method; an evaluation's first task, an analysis's base model, "
        "a sweep's objective task"
    )
    progress: dict[str, Any]
    error: dict[str, Any] | None
    sweep_id: str | None
    created_at: UtcTime
    started_at: UtcTime | None
    finished_at: UtcTime | None
    duration_s: float | None = Field(description="started to finished; null until it ends")
    url: str = Field(description="its own route")


class JobSummaryPage(BaseModel):
    items: list[JobSummary]
    total: int = Field(description="every job the filters match (not only this page's)")
    next_cursor: str | None = Field(description="pass as `cursor` for the next page")
    prev_cursor: str | None = Field(description="pass as `before` for the page before")


class EventRead(BaseModel):
    id: int
    type: str
    data: dict[str, Any]
    created_at: UtcTime


class ExpertRef(_Strict):
    label: str = Field(min_length=1, max_length=64)
    path: str = Field(min_length=1)


class AnalysisCreate(_Strict):
    base: str = Field(min_length=1)
    experts: list[ExpertRef] = Field(min_length=1, max_length=16)
    task: str | None = None
    language: str | None = None
    threshold: float | None = Field(None, ge=0, allow_inf_nan=False)


def progress_of(job: Mapping[str, Any]) -> dict[str, Any]:
    """A ProgressRead's fields, from a job's columns (`columns_of`)."""
    fraction = job["bytes_done"] / job["bytes_total"] if job["bytes_total"] else 0.0
    if job["status"] == "succeeded":
        fraction = 1.0
    eta = None
    started = as_utc(job["started_at"])
    if started is not None and 0 < fraction < 1 and job["status"] == "running":
        eta = (datetime.now(UTC) - started).total_seconds() * (1 - fraction) / fraction
    unit = kind_of(job["kind"]).progress_unit
    # One pair of columns holds the progress of every kind, in the kind's own unit.
    done, total = job["bytes_done"], job["bytes_total"]
    job_bytes = (done, total) if unit == "bytes" else (0, 0)
    return {
        "unit": unit,
        "done": done,
        "total": total,
        "bytes_done": job_bytes[0],
        "bytes_total": job_bytes[1],
        "tensors_done": job["tensors_done"],
        "tensors_total": job["tensors_total"],
        "fraction": round(fraction, 6),
        "eta_s": eta,
    }


JobView = dict[str, Any]  # JobRead's fields, in its order, as JSON-ready values
_COLUMNS = frozenset(attribute.key for attribute in Job.__mapper__.column_attrs)


def columns_of(job: Job) -> Mapping[str, Any]:
    """The job's column values: its instance's dict when every column is loaded there (a job
    read by core/job_rows.py, or loaded by a session), else each read through the ORM (which
    loads an expired one again). A view reads ~20 columns; the ORM's descriptor on each read
    cost a third of making a merge's view."""
    values = job.__dict__
    if values.keys() >= _COLUMNS:
        return values
    return {key: getattr(job, key) for key in _COLUMNS}


def job_read(job: Job, output: dict[str, Any] | None = None) -> JobView:
    """The job as the API shows it (JobRead's JSON once `view_json` serialises it); `output`:
    an OutputRead's fields. Made as plain values, not models: a list page makes 50 of these,
    and building and dumping the models cost three times as much (tests check the values
    against JobRead)."""
    columns = columns_of(job)
    error = columns["error"]
    return {
        "id": columns["id"],
        "kind": columns["kind"],
        "status": columns["status"],
        "stage": columns["stage"],
        "attempts": columns["attempts"],
        "progress": progress_of(columns),
        "created_at": as_utc(columns["created_at"]),
        "started_at": as_utc(columns["started_at"]),
        "finished_at": as_utc(columns["finished_at"]),
        "error": error_view(error) if error else None,
        "request": columns["request"],
        "plan": columns["plan_summary"],
        "plan_digest": columns["plan_digest"],
        "output": output,
        "result": columns["result"],
        "sources": [
            {key: source[key] for key in _SOURCE_FIELDS} for source in columns["sources"] or []
        ],
    }


def error_view(error: dict[str, Any]) -> dict[str, Any]:
    """A stored error as ErrorBody shows it."""
    return {"code": error["code"], "message": error["message"], "details": error.get("details", {})}


_SOURCE_FIELDS = tuple(HubSourceRead.model_fields)
_PUBLISHED_FIELDS = tuple(PublishedRead.model_fields)


def published_view(published: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """An artifact's Hub commits as PublishedRead shows them."""
    return [{key: commit[key] for key in _PUBLISHED_FIELDS} for commit in published or []]


def view_json(view: JobView) -> bytes:
    """A job view's JSON, as pydantic writes JobRead's."""
    return to_json(view)
