"""Creating a sweep: every check a worker would make, made first and cheapest first (sources,
depth, what the sweep expands to against its bounds, tasks, recipes), then the sweep and its
first jobs in one transaction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import hf_hub_download
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core import jobs
from core.db.models import Job, Sweep
from core.db.session import Database
from core.errors import IdempotencyConflict, InvalidRequest
from core.evaluations import check_spec, evaluation_request
from core.hub.credentials import token_for
from core.hub.errors import HubError, hub_errors
from core.hub.pin import pin
from core.hub.refs import is_hub_source, parse_hub_source
from core.kinds import MERGE_EXTRAS
from core.settings import Settings
from core.sources import resolve_source
from core.stored_requests import check_stored_size
from engine.architectures import configured_layer_count
from engine.errors import CheckpointError, EngineError
from engine.io.checkpoint import read_json
from engine.recipe import parse_recipe
from service.preflight import check_headers
from service.sweeps.expand import (
    SweepError,
    Trial,
    check_space,
    combinations,
    initial_configurations,
    planned_jobs,
    space_size,
    trials,
)
from service.sweeps.spec import SweepCreate

RUNNING, CANCELING = "running", "canceling"
SUCCEEDED, FAILED, CANCELED = "succeeded", "failed", "canceled"
TERMINAL = (SUCCEEDED, FAILED, CANCELED)


@dataclass(frozen=True)
class Created:
    sweep: Sweep
    created: bool
    job_ids: list[tuple[str, str]]  # (id, kind) to dispatch


def create_sweep(
    db: Database, settings: Settings, tenant: str, spec: SweepCreate, idempotency_key: str | None
) -> Created:
    digest = jobs.request_digest({"kind": "sweep", **spec.model_dump(mode="json")})
    if idempotency_key:
        with db.session() as session:
            if (found := _by_key(session, tenant, idempotency_key, digest)) is not None:
                return Created(found, False, [])
    _check_publish_credential(spec, settings, tenant)
    spec, pins = _pinned(spec, settings, tenant)
    layers = _num_layers(spec, settings, tenant, pins)
    first = _first_trials(spec, layers)  # a grid past its bounds is refused here, counted
    check_spec(spec.evaluation, settings)
    _check_recipes(first, spec, settings, tenant)
    sweep = Sweep(
        id=jobs.new_id(),
        tenant_id=tenant,
        status=RUNNING,
        request=spec.model_dump(mode="json"),
        request_hash=digest,
        idempotency_key=idempotency_key,
        num_layers=layers,
    )
    check_stored_size(sweep.request, settings)
    return _insert(db, settings, sweep, spec, first)


def _check_publish_credential(spec: SweepCreate, settings: Settings, tenant: str) -> None:
    """UnknownCredential, before anything is made, unless the tenant has the credential
    `publish_best` names."""
    if spec.publish_best is not None:
        credentials = settings.hub_credentials
        token_for(spec.publish_best.credential, tenant=tenant, credentials=credentials,
                  field="publish_best.credential")  # fmt: skip


def _insert(
    db: Database, settings: Settings, sweep: Sweep, spec: SweepCreate, first: list[Trial]
) -> Created:
    """The sweep and its first jobs, in one transaction; or the sweep that a concurrent
    request with the same Idempotency-Key committed first."""
    tenant, key, digest = sweep.tenant_id, sweep.idempotency_key, sweep.request_hash
    jobs.ensure_tenant(db, tenant)
    try:
        with db.session() as session:
            session.add(sweep)
            session.flush()
            made = add_trial_jobs(session, settings, sweep, spec, first)
            session.expunge(sweep)
    except IntegrityError:
        with db.session() as session:  # the same key, committed first by a concurrent request
            found = _by_key(session, tenant, key, digest) if key else None
        if found is None:
            raise
        return Created(found, False, [])
    return Created(sweep, True, made)


def _first_trials(spec: SweepCreate, layers: int) -> list[Trial]:
    """The trials created at once, built only once the configurations they come from and the
    jobs the whole sweep takes are counted within bounds (a grid may list millions)."""
    try:
        check_space(spec, layers)
        planned = planned_jobs(spec, layers)
        if planned > spec.budget:
            raise _over_budget(spec, layers, planned)
        return trials(spec, initial_configurations(spec, layers))
    except SweepError as e:
        raise InvalidRequest(str(e), details={"field": e.field}) from None


def _over_budget(spec: SweepCreate, layers: int, planned: int) -> InvalidRequest:
    details: dict[str, Any] = {"field": "budget", "jobs": planned, "budget": spec.budget}
    message = (
        f"budget: the sweep expands to {planned} jobs (merges and evaluations), more than its "
        f"budget of {spec.budget}"
    )
    if spec.grid is not None:
        details.update(
            combinations=combinations(spec.grid), configurations=space_size(spec, layers)
        )
        pairs = len(spec.expert_pairs())
        message += (
            f" ({details['configurations']} of the grid's {details['combinations']} "
            f"combinations fit the model's {layers} layers; {pairs} expert "
            f"pair{'s' if pairs != 1 else ''})"
        )
    return InvalidRequest(message, details=details)


def add_trial_jobs(
    session: Session, settings: Settings, sweep: Sweep, spec: SweepCreate, found: list[Trial]
) -> list[tuple[str, str]]:
    """A queued merge (with the evaluation block) per merge trial, a queued evaluation per
    expert; each names its sweep and trial. Returns (id, kind) to dispatch after commit."""
    made = []
    for trial in found:
        meta: dict[str, Any] = {"id": sweep.id, "config": trial.config, "pair": trial.pair}
        if trial.params is not None:
            meta["params"] = trial.params
        if trial.recipe is not None and trial.in_memory:
            target: dict[str, Any] = {"layer_swap": trial.recipe}
        elif trial.recipe is not None:
            request = {**trial.recipe, "evaluation": spec.evaluation.model_dump(), "sweep": meta}
            made.append(_add(session, settings, sweep, "merge", request))
            continue
        else:
            assert trial.source is not None
            target = {"source": trial.source}
            if is_hub_source(trial.source) and spec.credential is not None:
                target["credential"] = spec.credential
        request = {**evaluation_request(target, spec.evaluation), "sweep": meta}
        made.append(_add(session, settings, sweep, "evaluation", request))
    return made


def _add(
    session: Session, settings: Settings, sweep: Sweep, kind: str, request: dict[str, Any]
) -> tuple[str, str]:
    name = f"sweep-{sweep.id[:8]}-{jobs.new_id()[:8]}" if kind == "merge" else None
    job = jobs.add_queued(
        session, settings, tenant=sweep.tenant_id, kind=kind, request=request,
        output_name=name, sweep_id=sweep.id, sweep=sweep.id,
    )  # fmt: skip
    return job.id, kind


def add_final_merges(
    session: Session, settings: Settings, sweep: Sweep, spec: SweepCreate, best: list[Job]
) -> list[str]:
    """Ordinary merges (no evaluation: it is known) of the best configuration: written where it
    was evaluated in memory, and published where `publish_best` asks (a configuration written
    before is reused, not merged again). Their trial says `kept`."""
    made = []
    pairs = spec.expert_pairs()
    for job in best:
        trial = trial_of(job)
        if job.kind == "evaluation":
            recipe = dict(job.request["target"]["layer_swap"])
        else:
            recipe = {k: v for k, v in job.request.items() if k not in MERGE_EXTRAS}
        trial["kept"] = True
        if spec.publish_best is not None:
            hub = spec.publish_best.model_dump(mode="json")
            hub["repo"] = trial["published_to"] = spec.publish_repo(pairs[int(trial["pair"])])
            recipe["output"] = {**(recipe.get("output") or {}), "hub": hub}
        made.append(_add(session, settings, sweep, "merge", {**recipe, "sweep": trial})[0])
    return made


def _by_key(session: Session, tenant: str, key: str, digest: str) -> Sweep | None:
    found = session.scalars(
        select(Sweep).where(Sweep.tenant_id == tenant, Sweep.idempotency_key == key)
    ).first()
    if found is not None and found.request_hash != digest:
        raise IdempotencyConflict(
            "Idempotency-Key was already used with a different request body",
            details={"sweep_id": found.id},
        )
    if found is not None:
        session.expunge(found)
    return found


def _pinned(
    spec: SweepCreate, settings: Settings, tenant: str
) -> tuple[SweepCreate, dict[str, Any]]:
    """Local sources checked against the allowed roots; Hub sources pinned to the commit their
    revision points at now (each once), and the spec rewritten with the pins, so every job of
    the sweep reads the same commits. Returns the spec and pinned source -> PinnedRepo."""
    pins = _pins(spec, settings, tenant)
    if not pins:
        return spec, {}
    return _with_pins(spec, pins), {str(p.source): p for p in pins.values()}


def _named_sources(spec: SweepCreate) -> list[tuple[str, str]]:
    """(field, source) of every expert and the base."""
    named = [(f"task_experts.{i}", s) for i, s in enumerate(spec.task_experts)]
    named += [(f"language_experts.{i}", s) for i, s in enumerate(spec.language_experts)]
    if spec.base is not None:
        named.append(("base", spec.base))
    return named


def _pins(spec: SweepCreate, settings: Settings, tenant: str) -> dict[str, Any]:
    """Hub source as written -> PinnedRepo, each pinned once; local sources checked only."""
    pins: dict[str, Any] = {}
    for field, source in _named_sources(spec):
        if not is_hub_source(source):
            resolve_source(source, settings, tenant, field=field)
            continue
        if source in pins:
            continue
        try:
            ref = parse_hub_source(source)
        except ValueError as e:
            raise InvalidRequest(f"{field}: {e}", details={"field": field}) from None
        token = token_for(spec.credential, tenant=tenant, credentials=settings.hub_credentials)
        try:
            pins[source] = pin(ref, token)
        except HubError as e:
            e.details.setdefault("field", field)
            raise
    return pins


def _with_pins(spec: SweepCreate, pins: dict[str, Any]) -> SweepCreate:
    """The spec with each pinned source replaced by its pinned form."""

    def pinned(source: str) -> str:
        return str(pins[source].source) if source in pins else source

    body = spec.model_dump(mode="json")
    body["task_experts"] = [pinned(s) for s in spec.task_experts]
    body["language_experts"] = [pinned(s) for s in spec.language_experts]
    if spec.base is not None:
        body["base"] = pinned(spec.base)
    if spec.pairs is not None:
        body["pairs"] = [{"task": pinned(p.task), "language": pinned(p.language)}
                         for p in spec.pairs]  # fmt: skip
    return SweepCreate.model_validate(body)


def _num_layers(spec: SweepCreate, settings: Settings, tenant: str, pins: dict[str, Any]) -> int:
    """The depth presets are scaled to: the first task expert's language-model layer count
    (the recipes' checks make sure every expert of a pair agrees)."""
    first = spec.task_experts[0]
    if first in pins:
        config_file = _hub_config(pins[first], spec, settings, tenant)
    else:
        path = resolve_source(first, settings, tenant, field="task_experts.0")
        config_file = Path(path) / "config.json"
    try:  # bounded: size, nesting (a Hub repository's config.json is anyone's)
        config = read_json(config_file)
        layers = configured_layer_count(config) if isinstance(config, dict) else None
    except CheckpointError:
        layers = None
    if layers is None:
        raise InvalidRequest(
            "task_experts.0: no layer count in its config.json",
            details={"field": "task_experts.0"},
        )
    return layers


def _hub_config(pinned: Any, spec: SweepCreate, settings: Settings, tenant: str) -> Path:
    """config.json of a pinned Hub model, through the Hub cache the workers use."""
    token = token_for(spec.credential, tenant=tenant, credentials=settings.hub_credentials)
    with hub_errors(f"{pinned.source}/config.json"):
        path = hf_hub_download(
            pinned.repo, "config.json", revision=pinned.sha,
            cache_dir=settings.cache_dir / "hub" / "files", token=token or False,
        )  # fmt: skip
    return Path(str(path))


def _check_recipes(found: list[Trial], spec: SweepCreate, settings: Settings, tenant: str) -> None:
    """Each distinct (method, pair) merged once on headers: mismatched architectures, missing
    bases and bad baseline parameters are 422s now, naming where they came from."""
    seen: set[tuple[str, int | None]] = set()
    for trial in found:
        if trial.recipe is None:
            continue
        method = trial.recipe["method"]
        if (method, trial.pair) in seen and method == "layer_swap":
            continue
        seen.add((method, trial.pair))
        field = "baselines" if method != "layer_swap" else f"pairs.{trial.pair}"
        try:
            check_headers(parse_recipe(trial.recipe), settings, tenant)
        except EngineError as e:  # bad parameters, architectures that differ, ...
            e.details.update(field=field, config=trial.config)
            e.message = f"{field} ({trial.config}): {e.message}"
            raise


def trial_of(job: Job) -> dict[str, Any]:
    return dict(job.request.get("sweep") or {})
