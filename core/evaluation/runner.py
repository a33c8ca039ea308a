"""One evaluation: a checkpoint directory, an EvaluationSpec, lm-eval's simple_evaluate.

Used by evaluation jobs (worker/evaluation_jobs.py) and `layerswap evaluate`. Progress and
cancellation go through SteppedLM; the request cache (`cache_prefix`) lets a second attempt
pick up the requests the first one finished.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.evaluation.errors import (
    BackendNotOffered,
    EvaluationFailed,
    EvaluationTimeout,
    EvaluationUnavailable,
)
from core.evaluation.results import Score, sample_records, scores_of
from core.evaluation.spec import EvaluationSpec
from core.evaluation.tasks import lm_eval_version, require_lm_eval, task_manager
from engine.errors import MergeCanceled

if TYPE_CHECKING:
    from core.evaluation.stepped_lm import Stop

log = logging.getLogger("layerswap.evaluation")


@dataclass
class Outcome:
    scores: list[Score]
    samples: list[dict[str, Any]]
    lm_eval_version: str
    seconds: float
    requests_run: dict[str, int] = field(default_factory=dict)  # not answered from the cache


def check_backend(backend: str, offered: list[str]) -> None:
    if backend not in offered:
        raise BackendNotOffered(
            f"evaluation.backend: {backend!r} is not offered by this deployment's workers "
            f"(offered: {', '.join(offered)})",
            details={"field": "evaluation.backend"},
        )


def evaluate(
    model_dir: Path | None,
    spec: EvaluationSpec,
    *,
    prebuilt: Any = None,  # an in_memory.Assembled instead of a directory
    tasks_dir: Path | None,
    data_dir: Path,
    cache_prefix: Path | None = None,
    device: str = "cpu",
    on_progress: Callable[[int, int], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
    timeout_s: float | None = None,
) -> Outcome:
    require_lm_eval()
    from core.evaluation.stepped_lm import SteppedLM  # imports lm_eval: the optional extra

    started = time.monotonic()
    model = SteppedLM(
        _prebuilt(prebuilt, spec, device)
        if prebuilt is not None
        else _backend(model_dir, spec, device),
        chunk=4 * spec.batch_size,
        on_progress=on_progress,
        should_cancel=should_cancel,
        deadline=started + timeout_s if timeout_s else None,
    )
    manager = task_manager(spec.tasks, tasks_dir, data_dir)
    if cache_prefix is not None:
        cache_prefix.parent.mkdir(parents=True, exist_ok=True)
    results = _simple_evaluate(model, spec, manager, cache_prefix, timeout_s)
    assert results is not None  # rank 0 always gets results
    return Outcome(
        scores=scores_of(results),
        samples=sample_records(results),
        lm_eval_version=lm_eval_version(),
        seconds=time.monotonic() - started,
        requests_run=dict(model.ran),
    )


def _simple_evaluate(
    model: Any, spec: EvaluationSpec, manager: Any, cache_prefix: Path | None,
    timeout_s: float | None,
) -> Any:  # fmt: skip
    """lm-eval's results for `spec`; a stop (cancel, time limit) and lm-eval's own failures
    raised as our errors."""
    # lm_eval: seconds to import; loaded only when an evaluation runs
    from lm_eval import evaluator

    from core.evaluation.stepped_lm import Stop  # imports lm_eval, like the line above

    try:
        return evaluator.simple_evaluate(
            model=model,
            tasks=list(spec.tasks),
            num_fewshot=spec.num_fewshot,
            limit=spec.limit,
            use_cache=str(cache_prefix) if cache_prefix is not None else None,
            task_manager=manager,
            gen_kwargs={"max_gen_toks": spec.max_gen_toks},
            log_samples=True,
            apply_chat_template=spec.apply_chat_template,
            random_seed=spec.seed,
            numpy_random_seed=spec.seed,
            torch_random_seed=spec.seed,
            fewshot_random_seed=spec.seed,
            bootstrap_iters=1000,
        )
    except Stop as stop:
        raise _stop_error(stop, timeout_s) from None
    except (MergeCanceled, EvaluationTimeout):
        raise
    # The lm-eval boundary: it runs the tasks' own code (ours, a deployment's tasks_dir) and
    # the model's, so no list of what it raises is closed; any of it fails the evaluation.
    except Exception as e:
        log.warning("evaluation failed: %s: %s", type(e).__name__, e)
        raise EvaluationFailed(f"lm-eval failed: {type(e).__name__}: {e}") from None


def _stop_error(stop: Stop, timeout_s: float | None) -> MergeCanceled | EvaluationTimeout:
    """What a SteppedLM stop means: the job was canceled, or the time limit was reached."""
    if stop.reason == "canceled":
        return MergeCanceled("evaluation canceled")
    return EvaluationTimeout(
        f"the evaluation ran past its time limit ({timeout_s:.0f} s, LAYERSWAP_EVAL_TIMEOUT_S)",
        details={"timeout_s": timeout_s},
    )


DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _prebuilt(assembled: Any, spec: EvaluationSpec, device: str) -> Any:
    """lm-eval's HF model around a model built in memory; the same dtype and device as
    `HFLM(pretrained=<its directory>)` would load it with."""
    # torch and lm_eval: seconds to import; loaded only when an evaluation runs
    import torch
    from lm_eval.models.huggingface import HFLM

    if spec.backend != "hf":
        raise EvaluationFailed("a model assembled in memory is evaluated with the hf backend")
    model = assembled.model
    if spec.dtype != "auto":
        model = model.to(getattr(torch, DTYPES[spec.dtype]))
    model = model.to(device)
    return HFLM(pretrained=model, tokenizer=assembled.tokenizer, batch_size=spec.batch_size)


def _backend(model_dir: Path | None, spec: EvaluationSpec, device: str) -> Any:
    assert model_dir is not None
    if spec.backend == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise EvaluationUnavailable("the vllm backend needs vllm installed on this worker")
        # vllm (through lm_eval): optional; only for its backend
        from lm_eval.models.vllm_causallms import VLLM

        return VLLM(pretrained=str(model_dir), dtype=spec.dtype, seed=spec.seed)
    # lm_eval and torch: seconds to import; loaded only when an evaluation runs
    from lm_eval.models.huggingface import HFLM

    try:
        return HFLM(
            pretrained=str(model_dir),
            batch_size=spec.batch_size,
            dtype=spec.dtype,
            device=device,
        )
    # The model-loading boundary: any directory's config picks the model code transformers
    # runs, so what a bad one raises is open-ended; all of it means "not a loadable model".
    except Exception as e:
        raise EvaluationFailed(
            f"{model_dir}: cannot be loaded as a model ({type(e).__name__}: {e})"
        ) from None
