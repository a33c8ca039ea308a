"""/v1/merges: submit, read, list, cancel, events (JSON or Server-Sent Events)."""

from __future__ import annotations

import functools
import inspect
import re
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Header, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from core import jobs
from core.db.models import Artifact, Job
from core.errors import InvalidRequest, RequestTooLarge, ServiceError
from core.evaluations import check_spec, comparison
from core.hub.credentials import token_for
from core.hub.errors import HubError
from core.hub.pin import PinnedRepo, pin
from core.hub.refs import (
    HubRef,
    is_hub_source,
    parse_hub_source,
    replace_sources,
    source_parts,
)
from core.integrations.mlflow_registry import check_destination
from core.lineage import get_artifact
from core.sources import resolve_source
from engine.errors import EngineError, RecipeError
from engine.mergekit import MergekitOrigin, translate
from engine.recipe import HUB_REPO_PATTERN, Recipe, named_sources, parse_recipe, recipe_to_dict
from engine.schema.user_yaml import check_data, load_yaml
from service.api import polling
from service.api.deps import Context, ContextDep, TenantDep, current_tenant
from service.api.events import add_events_route
from service.api.lean import lean_route
from service.api.polling import CONDITIONAL, WaitQuery
from service.exposure import exposure_for
from service.preflight import check_headers
from service.schemas import (
    JobPage,
    JobRead,
    JobView,
    MergekitMerge,
    MergeRequest,
    job_read,
    merge_request,
    published_view,
    view_json,
)
from service.webhooks.endpoints import check_webhook_url

router = APIRouter(prefix="/v1/merges", tags=["merges"])


def read_job(context: Context, job: Job) -> JobView:
    output = None
    if job.output_artifact_id:
        artifact = loaded_output(job) or get_artifact(
            context.db, tenant=job.tenant_id, artifact_id=job.output_artifact_id
        )
        output = {
            "artifact_id": artifact.id,
            "name": job.output_name,
            "location": artifact.location,
            "files": [{"name": n, "sha256": s} for n, s in sorted(artifact.files.items())],
            "published": published_view(artifact.published),
        }
    view = job_read(job, output)
    evaluation_id = (job.result or {}).get("evaluation_job_id")
    if evaluation_id:
        evaluation = jobs.get(context.db, tenant=job.tenant_id, job_id=evaluation_id)
        view["result"] = {
            **(job.result or {}),
            "evaluation": {
                "job_id": evaluation.id,
                "status": evaluation.status,
                "comparison": comparison(context.db, context.settings, job)
                if evaluation.status == jobs.SUCCEEDED
                else [],
            },
        }
    return exposure_for(context.settings).job(view)


def loaded_output(job: Job) -> Artifact | None:
    """The output artifact when it was read with the job (jobs.OUTPUT), else None. A loaded
    relationship's value is in the instance's dict (reading it through `inspect(job).attrs`
    built the state of every attribute first: a tenth of the time of a list page)."""
    loaded = job.__dict__.get("output_artifact")
    return loaded if isinstance(loaded, Artifact) else None


def check_sources(
    recipe: Recipe, context: Context, tenant: str
) -> tuple[list[dict[str, str]], dict[str, Path]]:
    """Local sources must lie under an allowed root; Hub sources are pinned to the commit their
    revision points at now (the job will read only that commit). Returns the pins, and the
    local sources as resolved."""
    credentials = context.settings.hub_credentials
    if recipe.output.hub is not None:  # unknown names fail now
        token_for(recipe.output.hub.credential, tenant=tenant, credentials=credentials,
                  field="output.hub.credential")  # fmt: skip
    pins: dict[str, PinnedRepo] = {}
    sources = []
    local: dict[str, Path] = {}
    parts = [(n.field, part) for n in named_sources(recipe) for part in source_parts(n.source)]
    for field, source in parts:  # a model+adapter source: the model and the adapter
        if not is_hub_source(source):
            local[source] = resolve_source(source, context.settings, tenant, field=field)
            continue
        try:
            ref = parse_hub_source(source)
        except ValueError as e:
            raise InvalidRequest(f"{field}: {e}", details={"field": field}) from None
        if source not in pins:
            try:
                pins[source] = pin(
                    ref, token_for(recipe.credential, tenant=tenant, credentials=credentials)
                )
            except HubError as e:
                e.details.setdefault(
                    "field", "credential" if e.code == "unknown_credential" else field
                )
                raise
        pinned = pins[source]
        sources.append({"field": field, "source": source, "repo": pinned.repo,
                        "revision": pinned.revision, "sha": pinned.sha})  # fmt: skip
    return sources, local


# The README's first request: a layer swap of the example checkpoints (`layerswap examples`).
EXAMPLE_REQUEST = {
    "method": "layer_swap",
    "experts": {"task": ["examples/math"], "language": ["examples/swh"]},
    "params": {"bottom": 1, "top": 1},
}
# The same checkpoints merged by a mergekit config (docs: mergekit recipes).
EXAMPLE_MERGEKIT = {
    "mergekit": {
        "merge_method": "slerp",
        "base_model": "examples/math",
        "models": [{"model": "examples/math"}, {"model": "examples/swh"}],
        "parameters": {"t": [0, 0.5, 1]},
    }
}


def submit_router() -> APIRouter:
    """POST /v1/merges, its body the recipe schemas of the methods registered when the app is
    made (service/schemas.py's merge_request)."""
    body: Any = Annotated[
        merge_request(),
        Body(
            openapi_examples={
                "layer_swap": {"summary": "layer swap", "value": EXAMPLE_REQUEST},
                "mergekit": {"summary": "a mergekit config", "value": EXAMPLE_MERGEKIT},
            }
        ),
    ]
    signature = inspect.signature(submit_merge, eval_str=True)
    parameters = [p.replace(annotation=body) if p.name == "body" else p
                  for p in signature.parameters.values()]  # fmt: skip

    @functools.wraps(submit_merge)
    async def submit(*args: Any, **kwargs: Any) -> Response:
        return await submit_merge(*args, **kwargs)

    # FastAPI reads each parameter's type from the signature: the body's is the one made here.
    submit.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    made = APIRouter(prefix="/v1/merges", tags=["merges"])
    made.add_api_route("", submit, methods=["POST"], status_code=202, response_model=JobRead)
    return made


async def submit_merge(
    body: MergeRequest,
    context: ContextDep,
    tenant: TenantDep,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=200)] = None,
) -> Response:
    """Queue a merge. The body is the recipe schema of `layerswap merge`, or `{"mergekit":
    config}` with a mergekit 0.1.5 config (a mapping or YAML text: translated into a recipe,
    its errors naming the config's field as `mergekit.<field>`); plus an optional `evaluation`
    run on the merged model once it exists."""
    # One hop to a thread for all the blocking work, the answer's JSON included: as a sync
    # route FastAPI made a second hop to validate and serialise the returned model again.
    job_id, body_json = await run_in_threadpool(_submit_merge, body, context, tenant,
                                                idempotency_key)  # fmt: skip
    return Response(
        body_json,
        status_code=202,
        media_type="application/json",
        headers={"Location": f"/v1/merges/{job_id}"},
    )


def _submit_merge(
    body: MergeRequest, context: Context, tenant: str, idempotency_key: str | None
) -> tuple[str, bytes]:
    """Check, record and dispatch a submitted merge: (its job id, the answer's JSON)."""
    recipe, mergekit = _recipe_of(body, context, tenant)
    if body.evaluation is not None:
        check_spec(body.evaluation, context.settings)
    if body.webhook is not None:
        check_webhook_url(body.webhook, context.settings, field="webhook")
    if recipe.output.mlflow is not None:
        check_destination(context.settings, tenant, recipe.output.mlflow)  # another's: 403
    try:
        sources, local = check_sources(recipe, context, tenant)
        planned = check_headers(recipe, context.settings, tenant, resolved=local, mergekit=mergekit)
    except (EngineError, ServiceError) as e:
        raise (mergekit.renamed(e, prefix=MERGEKIT) if mergekit else e) from None
    request = recipe_to_dict(recipe)
    if mergekit is not None:  # for the worker (its checks, warnings) and lineage
        request["mergekit"] = mergekit.record()
    if body.evaluation is not None:
        request["evaluation"] = body.evaluation.model_dump()
    if body.webhook is not None:
        request["webhook"] = body.webhook
    new = jobs.NewJob(
        tenant,
        "merge",
        replace_sources(request, {s["source"]: str(HubRef(s["repo"], s["sha"])) for s in sources}),
        recipe.output.name,
        idempotency_key,
        asked=request,
        sources=sources or None,
        planned_bytes=planned or 0,
    )
    try:
        job, created = jobs.submit(context.db, context.settings, new)
    except RequestTooLarge as e:
        raise (_too_large_config(e) if mergekit else e) from None
    if created:
        context.executor.dispatch(job.id, job.kind)
    return job.id, view_json(read_job(context, job))


def _too_large_config(error: RequestTooLarge) -> RequestTooLarge:
    """A translated request holds the config's recipe and record: too large, it names the
    config, unless its largest part is the body's own (evaluation, webhook)."""
    where = str(error.details.get("field"))
    if where in ("evaluation", "webhook"):
        return error
    message = "mergekit" + error.message.removeprefix(where)
    return RequestTooLarge(message, details={**error.details, "field": "mergekit"})


MERGEKIT = "mergekit."  # a mergekit config's fields, in the request body


def _recipe_of(
    body: MergeRequest, context: Context, tenant: str
) -> tuple[Recipe, MergekitOrigin | None]:
    """The recipe a request asks for: as written, or translated from its mergekit config."""
    if not isinstance(body, MergekitMerge):
        exclude = {"evaluation", "webhook"}
        return parse_recipe(body.model_dump(mode="json", by_alias=True, exclude=exclude)), None
    config = _mergekit_config(body.mergekit)

    def is_local(ref: str) -> bool:
        """As mergekit tells: a directory (here: under the source roots) is local; so is what
        cannot be a Hub repository (check_sources then says why it is refused)."""
        if not re.match(HUB_REPO_PATTERN, ref):
            return True
        try:  # a directory with a link it may not follow is local all the same (refused later)
            resolve_source(ref, context.settings, tenant, check_links=False)
        except ServiceError:
            return False
        return True

    try:
        translated = translate(
            config,
            is_local=is_local,
            output=body.output.model_dump(mode="json", exclude_unset=True),
            credential=body.credential,
            arithmetic=body.arithmetic,
        )
    except RecipeError as e:
        raise _in_body(e) from None
    return translated.recipe, translated.origin


def _mergekit_config(config: dict[str, object] | str) -> object:
    """The config as values, within the bounds of YAML a user gives (engine/schema/user_yaml.py):
    its text read by the bounded loader, a mapping held to the same rule."""
    try:
        if isinstance(config, dict):
            check_data(config, "mergekit")
            return config
        return load_yaml(config, "mergekit")
    except RecipeError as e:
        raise InvalidRequest(e.message, details=e.details) from None


def _in_body(error: RecipeError) -> RecipeError:
    """A translation error naming the body's field: the config's under `mergekit.`."""
    where = str(error.details.get("field", "config"))
    if where.startswith("output.") or where == "credential":
        return error
    field = "mergekit" if where == "config" else MERGEKIT + where
    return RecipeError.for_field(field, error.message.removeprefix(f"{where}: "))


PAGE_LIMIT = 200  # most merges on a page


async def list_merges(
    context: ContextDep,
    tenant: TenantDep,
    status: Annotated[Literal[jobs.STATUSES] | None, Query()] = None,  # type: ignore[valid-type]
    input_artifact: str | None = None,
    output_artifact: str | None = None,
    cursor: str | None = None,
    limit: Annotated[int, Query(ge=1, le=PAGE_LIMIT)] = 50,
) -> Response:
    """Newest first; filter by status or by an input or output artifact; cursor pagination."""
    if input_artifact and output_artifact:
        raise InvalidRequest(
            "give input_artifact or output_artifact, not both",
            details={"field": "output_artifact"},
        )
    artifact = (
        ("input", input_artifact)
        if input_artifact
        else ("output", output_artifact)
        if output_artifact
        else None
    )
    page = jobs.page_query(tenant=tenant, kind="merge", status=status, artifact=artifact,
                           cursor=cursor, limit=limit)  # fmt: skip
    rows = [] if page is None else await context.rows.page(*page)
    rows, next_cursor = jobs.page_of(context.db.engine.dialect, rows, limit)
    # Each merge as GET /v1/merges/{id} answers it: a page of unchanged merges is one query
    items = await polling.answers_for(
        context, rows, partial(read_job, context), shows_only_its_rows
    )
    return Response(polling.page_body(items, next_cursor), media_type="application/json")


async def _list_merges_plainly(request: Request) -> Response | None:
    """list_merges of a request asking for at most `limit` (as FastAPI would read it back:
    digits, 1..PAGE_LIMIT) and `cursor`, each once; None for any other (service/api/lean.py).
    What a client walking the pages asks."""
    query = request.query_params
    if not set(query) <= {"limit", "cursor"} or len(query.multi_items()) != len(query):
        return None
    limit = query.get("limit", "50")
    if not (limit.isascii() and limit.isdigit() and limit == str(int(limit))):
        return None
    if not 1 <= int(limit) <= PAGE_LIMIT:
        return None
    context: Context = request.app.state.context
    tenant = await current_tenant(context, request.headers.get("authorization"))
    return await list_merges(context, tenant, cursor=query.get("cursor"), limit=int(limit))


router.add_api_route(
    "",
    list_merges,
    methods=["GET"],
    response_model=JobPage,
    route_class_override=lean_route(_list_merges_plainly),
)


async def get_merge(
    job_id: str, request: Request, context: ContextDep, tenant: TenantDep, wait: WaitQuery = None
) -> Response:
    """The merge. `ETag` / `If-None-Match` (304); long polling with `?wait=N` or
    `Prefer: wait=N` (answers once the merge differs from your ETag, or ends, or N s pass)."""
    return await polling.read_job(
        request,
        context,
        tenant=tenant,
        job_id=job_id,
        kind="merge",
        view=partial(read_job, context),
        wait=wait,
        reusable=shows_only_its_rows,
    )


async def _get_merge_plainly(request: Request) -> Response | None:
    """get_merge of a request without a query string (no `wait` to validate), its dependencies
    resolved as FastAPI would resolve them; None for any other (service/api/lean.py)."""
    if request.scope["query_string"]:
        return None
    context: Context = request.app.state.context
    tenant = await current_tenant(context, request.headers.get("authorization"))
    return await get_merge(request.path_params["job_id"], request, context, tenant)


router.add_api_route(
    "/{job_id}",
    get_merge,
    methods=["GET"],
    response_model=JobRead,
    responses=CONDITIONAL,
    route_class_override=lean_route(_get_merge_plainly),
)


def shows_only_its_rows(job: Job) -> bool:
    """read_job shows the job and its output artifact, and, once one is asked for, its
    evaluation and the scores of its inputs (other rows, which may change meanwhile)."""
    return not (job.result or {}).get("evaluation_job_id")


@router.post("/{job_id}/cancel", status_code=202, response_model=JobRead)
def cancel_merge(job_id: str, context: ContextDep, tenant: TenantDep) -> JobView:
    """Cooperative: a running merge stops between tensors and leaves no output. Once accepted
    (202, `canceled` or `canceling`) the merge ends `canceled`, with no output, artifact,
    lineage, Hub commit or MLflow version. Too late, 409 `conflict`: the merge has ended, or is
    past its point of no return (stage `committing` or `registering`) and will finish."""
    jobs.get(context.db, tenant=tenant, job_id=job_id, kind="merge")
    return read_job(context, jobs.request_cancel(context.db, tenant=tenant, job_id=job_id))


add_events_route(router, kind="merge")
