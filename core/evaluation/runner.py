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
from typing import Any

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
    from lm_eval import evaluator

    from core.evaluation.stepped_lm import SteppedLM, Stop  # imports lm_eval, like the line above

    started = time.monotonic()
    deadline = started + timeout_s if timeout_s else None
    model = SteppedLM(
        _prebuilt(prebuilt, spec, device)
        if prebuilt is not None
        else _backend(model_dir, spec, device),
        chunk=4 * spec.batch_size,
        on_progress=on_progress,
        should_cancel=should_cancel,
        deadline=deadline,
    )
    manager = task_manager(spec.tasks, tasks_dir, data_dir)
    if cache_prefix is not None:
        cache_prefix.parent.mkdir(parents=True, exist_ok=True)
    try:
        results = evaluator.simple_evaluate(
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
        if stop.reason == "canceled":
            raise MergeCanceled("evaluation canceled") from None
        raise EvaluationTimeout(
            f"the evaluation ran past its time limit ({timeout_s:.0f} s, LAYERSWAP_EVAL_TIMEOUT_S)",
            details={"timeout_s": timeout_s},
        ) from None
    except (MergeCanceled, EvaluationTimeout):
        raise
    except Exception as e:  # lm-eval's own errors: a task's data, a model it cannot run
        log.warning("evaluation failed: %s: %s", type(e).__name__, e)
        raise EvaluationFailed(f"lm-eval failed: {type(e).__name__}: {e}") from None
    assert results is not None  # rank 0 always gets results
    return Outcome(
        scores=scores_of(results),
        samples=sample_records(results),
        lm_eval_version=lm_eval_version(),
        seconds=time.monotonic() - started,
        requests_run=dict(model.ran),
    )


DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _prebuilt(assembled: Any, spec: EvaluationSpec, device: str) -> Any:
    """lm-eval's HF model around a model built in memory; the same dtype and device as
    `HFLM(pretrained=<its directory>)` would load it with."""
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
        from lm_eval.models.vllm_causallms import VLLM

        return VLLM(pretrained=str(model_dir), dtype=spec.dtype, seed=spec.seed)
    from lm_eval.models.huggingface import HFLM

    try:
        return HFLM(
            pretrained=str(model_dir),
            batch_size=spec.batch_size,
            dtype=spec.dtype,
            device=device,
        )
    except Exception as e:
        raise EvaluationFailed(
            f"{model_dir}: cannot be loaded as a model ({type(e).__name__}: {e})"
        ) from None
