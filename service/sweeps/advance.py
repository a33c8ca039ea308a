"""Moving sweeps along, from the reconciler loop of every API process (each step is idempotent
or compare-and-set, so any number may run it):

- a canceling sweep cancels its queued and running jobs, and ends canceled once none runs;
- `keep: none` removes a merged model once its evaluation has ended;
- an optuna search asks for more configurations while its budget of trials lasts, telling the
  sampler every finished configuration's mean score over pairs (the study is rebuilt from the
  database each time: nothing lives only in memory);
- once every job has ended: `keep: best` removes all merged models but the best configuration's,
  and the sweep ends succeeded (failed when no configuration got a score).
"""

from __future__ import annotations

import logging
from contextlib import suppress
from typing import Any

from sqlalchemy import select, update

from core import jobs
from core.db.models import Job, Sweep, utcnow
from core.db.session import Database
from core.errors import Conflict, NotFound, ServiceError
from core.evaluations import scores_of_job
from core.jobs import Executor
from core.lineage import delete_artifact
from core.settings import Settings
from core.webhooks.outbox import sweep_ended
from engine.methods.layer_swap import LayerSwapParams
from service.sweeps.create import (
    CANCELED,
    CANCELING,
    FAILED,
    RUNNING,
    SUCCEEDED,
    add_final_merges,
    add_trial_jobs,
    trial_of,
)
from service.sweeps.expand import label, space, trials
from service.sweeps.leaderboard import children, leaderboard, objective_score
from service.sweeps.spec import SweepCreate

log = logging.getLogger("layerswap.sweeps")


def advance_all(db: Database, settings: Settings, executor: Executor) -> list[str]:
    """Advance every unfinished sweep; returns the ids that ended this round."""
    with db.session() as session:
        ids = list(session.scalars(select(Sweep.id).where(Sweep.status.in_((RUNNING, CANCELING)))))
    ended = []
    for sweep_id in ids:
        try:
            if advance(db, settings, executor, sweep_id):
                ended.append(sweep_id)
        except ServiceError as e:
            log.warning("sweep %s: %s", sweep_id, e.message)
    return ended


def advance(db: Database, settings: Settings, executor: Executor, sweep_id: str) -> bool:
    """One step of the sweep (see the module's docstring); True if it ended now."""
    with db.session() as session:
        sweep = session.get(Sweep, sweep_id)
        assert sweep is not None
        session.expunge(sweep)
    spec = SweepCreate.model_validate(sweep.request)
    found = children(db, sweep_id)
    if sweep.status == CANCELING:
        return _wind_down(db, sweep, found)
    if spec.keep == "none":
        _remove_evaluated(db, settings, sweep, found, keep=set())
    if spec.search.strategy == "optuna" and _ask_more(db, settings, executor, sweep, spec, found):
        return False
    if any(job.status not in jobs.TERMINAL for job in found):
        return False
    board = leaderboard(db, settings, sweep)
    if not board["rows"]:
        return _finish(
            db, sweep, FAILED, {"error": "no configuration was scored", **_counts(found)}
        )
    best = board["rows"][0]
    if _final_merges(db, settings, executor, sweep, spec, found, best["config"]):
        return False  # the best configuration is being written or published
    if spec.keep == "best":
        _remove_evaluated(db, settings, sweep, found, keep={best["config"]})
    return _finish_scored(db, sweep, found, best)


def _wind_down(db: Database, sweep: Sweep, found: list[Job]) -> bool:
    """A canceling sweep: its queued and running jobs asked to cancel; ends it canceled once
    none runs (True then)."""
    for job in found:
        if job.status in (jobs.QUEUED, jobs.RUNNING):
            with suppress(Conflict):  # it ended meanwhile
                jobs.request_cancel(db, tenant=sweep.tenant_id, job_id=job.id)
    if all(job.status in jobs.TERMINAL for job in children(db, sweep.id)):
        return _finish(db, sweep, CANCELED, {"canceled": True})
    return False


def _finish_scored(db: Database, sweep: Sweep, found: list[Job], best: dict[str, Any]) -> bool:
    """End a sweep whose jobs have all ended, `best` its leaderboard's first row: succeeded,
    or failed where a final merge of the best configuration did not succeed."""
    summary = {"best": {"config": best["config"], "mean": best["mean"]}, **_counts(found)}
    final = [j for j in found if trial_of(j).get("kept")]
    if final:
        summary["written"] = [_written(j) for j in final]
    failed = [j for j in final if j.status != jobs.SUCCEEDED]
    if failed:
        code = (failed[0].error or {}).get("code", failed[0].status)
        summary["error"] = (
            f"{len(failed)} of the best configuration's final merges did not succeed "
            f"(merge job {failed[0].id}: {code})"
        )
        return _finish(db, sweep, FAILED, summary)
    return _finish(db, sweep, SUCCEEDED, summary)


def _written(job: Job) -> dict[str, Any]:
    trial = trial_of(job)
    entry = {
        "pair": trial["pair"],
        "merge_job_id": job.id,
        "status": job.status,
        "artifact_id": job.output_artifact_id,
    }
    if "published_to" in trial:
        entry["published_to"] = trial["published_to"]
        entry["published"] = (job.result or {}).get("published")
    return entry


def _final_merges(
    db: Database,
    settings: Settings,
    executor: Executor,
    sweep: Sweep,
    spec: SweepCreate,
    found: list[Job],
    best: str,
) -> bool:
    """Queue, once, the merges that end the sweep: the best configuration written for each pair
    where it was evaluated in memory (keep: best), and published where `publish_best` asks. The
    sweep row is locked so two reconcilers cannot both queue them. True if queued now."""
    if spec.publish_best is None and spec.keep != "best":
        return False
    if any(trial_of(j).get("kept") for j in found):
        return False
    chosen = _final_trials(spec, found, best)
    if not chosen:
        return False
    return _queue_final_merges(db, settings, executor, sweep, spec, chosen)


def _final_trials(spec: SweepCreate, found: list[Job], best: str) -> list[Job]:
    """The jobs of the best configuration that a final merge repeats, one per pair: evaluated
    in memory (for keep: best), or a written merge that was scored (for publish_best)."""

    def wanted(job: Job) -> bool:
        trial = trial_of(job)
        if trial.get("config") != best or trial.get("pair") is None:
            return False
        if job.kind == "evaluation" and "layer_swap" in job.request["target"]:
            return job.status == jobs.SUCCEEDED  # evaluated in memory: written now
        return spec.publish_best is not None and job.kind == "merge"

    chosen = [j for j in found if wanted(j)]
    if spec.publish_best is not None:  # a written merge whose evaluation failed: not scored
        scored = {
            trial_of(j)["pair"] for j in found
            if j.kind == "evaluation" and j.status == jobs.SUCCEEDED
            and trial_of(j).get("config") == best
        }  # fmt: skip
        chosen = [j for j in chosen if trial_of(j)["pair"] in scored]
    return chosen


def _queue_final_merges(
    db: Database,
    settings: Settings,
    executor: Executor,
    sweep: Sweep,
    spec: SweepCreate,
    chosen: list[Job],
) -> bool:
    """The final merges of `chosen`, added and dispatched unless another reconciler did first
    (the sweep row is locked meanwhile); True if added now."""
    with db.session() as session:
        row = session.get(Sweep, sweep.id, with_for_update=True)
        if row is None or row.status != RUNNING:
            return False
        merges = session.scalars(select(Job).where(Job.sweep_id == sweep.id, Job.kind == "merge"))
        if any(trial_of(j).get("kept") for j in merges):
            return False  # another reconciler queued them first
        made = add_final_merges(session, settings, row, spec, chosen)
    for job_id in made:
        executor.dispatch(job_id, "merge")
    return True


def _counts(found: list[Job]) -> dict[str, Any]:
    counts: dict[str, dict[str, int]] = {}
    for job in found:
        by_status = counts.setdefault(job.kind, {})
        by_status[job.status] = by_status.get(job.status, 0) + 1
    return {"jobs": counts}


def _finish(db: Database, sweep: Sweep, status: str, result: dict[str, Any]) -> bool:
    with db.session() as session:
        moved: Any = session.execute(
            update(Sweep)
            .where(Sweep.id == sweep.id, Sweep.status == sweep.status)
            .values(status=status, result=result, finished_at=utcnow())
        )
        ended = int(moved.rowcount) == 1
        if ended:
            sweep_ended(session, sweep.tenant_id, sweep.id, status)
    if ended:
        log.info("sweep %s %s", sweep.id, status)
    return ended


def _remove_evaluated(
    db: Database, settings: Settings, sweep: Sweep, found: list[Job], *, keep: set[str]
) -> None:
    """Delete the outputs of merges whose evaluation has ended, except configurations kept.
    The artifacts stay in lineage (deleted_at set), their scores with them."""
    ended = {
        job.request.get("merge_job_id")
        for job in found
        if job.kind == "evaluation" and job.status in jobs.TERMINAL
    }
    for job in found:
        if job.kind != "merge" or job.status != jobs.SUCCEEDED or job.output_artifact_id is None:
            continue
        if job.id not in ended or job.request["sweep"]["config"] in keep:
            continue
        if (job.result or {}).get("reused_from"):
            continue  # another job's output, reused: not this sweep's to remove
        with suppress(Conflict):  # read by a running job: next round
            delete_artifact(
                db, settings, tenant=sweep.tenant_id, artifact_id=job.output_artifact_id
            )


def _ask_more(
    db: Database,
    settings: Settings,
    executor: Executor,
    sweep: Sweep,
    spec: SweepCreate,
    found: list[Job],
) -> bool:
    """Ask for configurations while fewer than `parallel` are in flight and trials remain;
    True while the search is not over."""
    assert spec.search.trials is not None
    candidates = space(spec, sweep.num_layers)
    budget = min(spec.search.trials, len(candidates))
    asked: dict[str, dict[str, Any]] = {}
    for job in found:
        trial = job.request.get("sweep") or {}
        if trial.get("params") is not None:
            asked[trial["config"]] = trial["params"]
    in_flight = {
        (job.request.get("sweep") or {}).get("config")
        for job in found
        if job.status not in jobs.TERMINAL
    }
    room = min(spec.search.parallel - len(in_flight & set(asked)), budget - len(asked))
    if room <= 0:
        return len(asked) < budget or bool(in_flight)
    values = _finished_values(db, spec, found, asked, in_flight)
    new = suggest(spec, candidates, asked, values, room)
    if not new:
        return bool(in_flight)
    with db.session() as session:
        row = session.get(Sweep, sweep.id)
        if row is None or row.status != RUNNING:
            return False
        made = add_trial_jobs(session, settings, row, spec, trials(spec, new, baselines=False))
    for job_id, kind in made:
        executor.dispatch(job_id, kind)
    return True


def _finished_values(
    db: Database,
    spec: SweepCreate,
    found: list[Job],
    asked: dict[str, dict[str, Any]],
    in_flight: set[Any],
) -> dict[str, float | None]:
    """Mean objective over pairs of each configuration whose jobs have all ended (None: no
    pair was scored, a failed trial)."""
    values: dict[str, list[float]] = {config: [] for config in asked if config not in in_flight}
    for job in found:
        config = (job.request.get("sweep") or {}).get("config")
        if job.kind != "evaluation" or config not in values or job.status != jobs.SUCCEEDED:
            continue
        score = objective_score(scores_of_job(db, job), spec)
        if score is not None:
            values[config].append(float(score["value"]))
    return {c: (sum(v) / len(v) if v else None) for c, v in values.items()}


def suggest(
    spec: SweepCreate,
    candidates: list[LayerSwapParams],
    asked: dict[str, dict[str, Any]],
    values: dict[str, float | None],
    count: int,
) -> list[LayerSwapParams]:
    """`count` untried configurations from Optuna's TPE sampler, told every finished one
    (seeded by the sweep and by how many were told, so the same state asks the same)."""
    # optuna: heavy, and only the sweeps that search with it load it
    from optuna.distributions import BaseDistribution, CategoricalDistribution

    by_label = {label(p): p for p in candidates}
    distribution: dict[str, BaseDistribution] = {"config": CategoricalDistribution(list(by_label))}
    told = {config: value for config, value in values.items() if config in by_label}
    study = _told_study(distribution, told, seed=spec.search.seed + len(values))
    untried = [c for c in by_label if c not in asked]
    return [by_label[c] for c in _ask(study, distribution, asked, untried, count)]


def _told_study(distribution: dict[str, Any], told: dict[str, float | None], *, seed: int) -> Any:
    """A TPE study told each configuration's mean score (a failed trial where it has none)."""
    # optuna: heavy; loaded only when a sweep asks for configurations
    import optuna
    from optuna.trial import TrialState, create_trial

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=2)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    for config, value in told.items():
        state = TrialState.COMPLETE if value is not None else TrialState.FAIL
        study.add_trial(
            create_trial(
                params={"config": config},
                distributions=distribution,
                value=value,
                state=state,
            )
        )
    return study


def _ask(
    study: Any,
    distribution: dict[str, Any],
    asked: dict[str, dict[str, Any]],
    untried: list[str],
    count: int,
) -> list[str]:
    """Up to `count` of `untried` as the study suggests them (one it repeats is told failed
    and asked again); filled up in order when it keeps repeating itself."""
    # optuna: heavy; loaded only when a sweep asks for configurations
    from optuna.trial import TrialState

    chosen: list[str] = []
    for _ in range(20 * count):
        if len(chosen) == count or len(chosen) == len(untried):
            break
        trial = study.ask(distribution)
        config = str(trial.params["config"])
        if config in asked or config in chosen:
            study.tell(trial, state=TrialState.FAIL)  # already tried: ask again
            continue
        chosen.append(config)
        study.tell(trial, state=TrialState.PRUNED)  # its value comes from the jobs, later
    for config in untried:  # the sampler kept repeating itself: fill up in order
        if len(chosen) < count and config not in chosen:
            chosen.append(config)
    return chosen


def cancel_sweep(db: Database, *, tenant: str, sweep_id: str) -> Sweep:
    """RUNNING -> CANCELING (compare-and-set); the advancer cancels the jobs."""
    with db.session() as session:
        session.execute(
            update(Sweep)
            .where(Sweep.id == sweep_id, Sweep.tenant_id == tenant, Sweep.status == RUNNING)
            .values(status=CANCELING)
        )
        sweep = session.get(Sweep, sweep_id, populate_existing=True)
        if sweep is None or sweep.tenant_id != tenant:
            raise NotFound(f"no such sweep: {sweep_id}")
        if sweep.status in (SUCCEEDED, FAILED, CANCELED):
            raise Conflict(
                f"sweep {sweep_id} already {sweep.status}", details={"status": sweep.status}
            )
        session.expunge(sweep)
    return sweep
