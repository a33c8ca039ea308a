"""Delta analysis of experts against their base (DESIGN §3.3, §3.5; paper Fig. 2 and 4).

For every tensor, `W_Δ = W_expert − W_base` is streamed in chunks of whole rows (float32 math,
bounded memory) and reduced to one MAV (mean |W_Δ|) per row. A row is one slice along the last
dimension: a 2-D `[out, in]` weight has `out` rows of `in` elements, a 1-D tensor is one row
(tensors with more dimensions contribute their last-dimension slices, an extension of the
paper's 1-D/2-D definition). Only floating-point tensors are analysed.

Per (transformer layer, parameter kind): `fraction` = share of rows whose MAV exceeds the
threshold, `mean_mav` = mean of the row MAVs. The expert's magnitude m_i = mean of all row MAVs
of all floating tensors, layer and non-layer alike (sums accumulate in float64).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from engine.analysis.result import AnalysisResult, ExpertDelta, SwapSuggestion
from engine.architectures import LayerStack
from engine.errors import IncompatibleCheckpointsError, MergeCanceled, RecipeError
from engine.io.checkpoint import Checkpoint
from engine.io.file_access import FileGuard
from engine.io.safetensors_format import FLOAT_DTYPES, TensorInfo
from engine.kernels.tensor_io import iter_row_chunks, read_elements
from engine.progress import CancelCheck

__all__ = [
    "AnalysisResult",
    "ExpertDelta",
    "SwapSuggestion",
    "analyze",
    "expert_magnitude",
    "param_kind",
    "suggest_swap",
]

AUTO_PERCENTILE = 90.0
THRESHOLD_RULE_AUTO = (
    "auto: 90th percentile (linear interpolation) of the row MAVs of every per-layer tensor "
    "of every expert"
)
THRESHOLD_RULE_EXPLICIT = "explicit: given by the caller"
MAX_LISTED = 20
DEFAULT_CHUNK_ELEMENTS = 4_000_000

# The tensor name's last two components -> kind. Biases get kinds of their own (`q_bias`...):
# a bias is a single row on a different scale from its weight matrix's rows.
KNOWN_KINDS: dict[str, str] = {
    "q_proj.weight": "q", "k_proj.weight": "k", "v_proj.weight": "v", "o_proj.weight": "o",
    "gate_proj.weight": "gate", "up_proj.weight": "up", "down_proj.weight": "down",
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_attention_norm",
    "pre_feedforward_layernorm.weight": "pre_feedforward_norm",
    "post_feedforward_layernorm.weight": "post_feedforward_norm",
    "q_proj.bias": "q_bias", "k_proj.bias": "k_bias", "v_proj.bias": "v_bias",
    "o_proj.bias": "o_bias",
}  # fmt: skip
_KIND_ORDER = {kind: i for i, kind in enumerate(KNOWN_KINDS.values())}
_FLOAT_DTYPES = FLOAT_DTYPES | {"F8_E4M3", "F8_E5M2"}  # analysed, though never averaged


def param_kind(tensor_name: str) -> str:
    """`model.layers.3.self_attn.q_proj.weight` -> `q`; unknown kinds keep their last two parts."""
    last_two = ".".join(tensor_name.split(".")[-2:])
    return KNOWN_KINDS.get(last_two, last_two)


@dataclass
class _DeltaStats:
    """Row MAVs of one expert: kept per (layer, kind); summed (float64) over every tensor."""

    rows: dict[tuple[int, str], list[torch.Tensor]] = field(default_factory=dict)
    total: float = 0.0
    count: int = 0

    def add(self, key: tuple[int, str] | None, mavs: torch.Tensor) -> None:
        self.total += float(mavs.double().sum())
        self.count += mavs.numel()
        if key is not None:
            self.rows.setdefault(key, []).append(mavs)

    @property
    def magnitude(self) -> float:
        return self.total / self.count if self.count else 0.0


def _analysable(info: TensorInfo) -> bool:
    return info.dtype in _FLOAT_DTYPES and len(info.shape) >= 1 and info.numel > 0


def _row_mavs(
    base: Checkpoint, experts: Sequence[Checkpoint], name: str, chunk_elements: int
) -> list[torch.Tensor]:
    """Row MAVs (float32) of one tensor for each expert; the base chunk is read once."""
    info = base.tensors[name]
    row = info.shape[-1]
    parts: list[list[torch.Tensor]] = [[] for _ in experts]
    for start, count in iter_row_chunks(info, chunk_elements):
        base_chunk = read_elements(base, info, start, count).to(torch.float32)
        for part, expert in zip(parts, experts, strict=True):
            delta = read_elements(expert, expert.tensors[name], start, count).to(torch.float32)
            delta = torch.sub(delta, base_chunk).abs_()
            part.append(delta.view(-1, row).mean(dim=1))
    return [torch.cat(part) for part in parts]


def _scan(
    base: Checkpoint,
    experts: Sequence[Checkpoint],
    chunk_elements: int,
    should_cancel: CancelCheck | None = None,
    stack: LayerStack | None = None,
) -> list[_DeltaStats]:
    """One streaming pass over every analysable tensor, all experts together; per-layer
    statistics for the tensors of `stack` (none without one: a magnitude needs no layers)."""
    stats = [_DeltaStats() for _ in experts]
    for name in sorted(base.tensors):
        if should_cancel is not None and should_cancel():
            raise MergeCanceled("canceled while planning (magnitude weights); nothing written")
        info = base.tensors[name]
        if not _analysable(info) or not all(_analysable(e.tensors[name]) for e in experts):
            continue
        layer = stack.layer_of(name) if stack else None
        key = None if layer is None else (layer, param_kind(name))
        for stat, mavs in zip(stats, _row_mavs(base, experts, name, chunk_elements), strict=True):
            stat.add(key, mavs)
    return stats


def check_same_tensors(base: Checkpoint, experts: Sequence[tuple[str, Checkpoint]]) -> None:
    """Every expert must hold exactly the base's tensor names, with the same shapes."""
    problems: list[str] = []
    for label, expert in experts:
        for name in sorted(base.tensors.keys() - expert.tensors.keys()):
            problems.append(f"{name}: in base, missing from {label}")
        for name in sorted(expert.tensors.keys() - base.tensors.keys()):
            problems.append(f"{name}: in {label}, missing from base")
        for name in sorted(base.tensors.keys() & expert.tensors.keys()):
            a, b = base.tensors[name].shape, expert.tensors[name].shape
            if a != b:
                problems.append(f"{name}: shape {list(a)} in base, {list(b)} in {label}")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise IncompatibleCheckpointsError(
            f"experts do not match the base: {problems[0]}{more}",
            details={"mismatches": problems[:MAX_LISTED], "count": len(problems)},
        )


def expert_magnitude(
    base: Checkpoint,
    expert: Checkpoint,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    should_cancel: CancelCheck | None = None,
) -> float:
    """m_i of DESIGN §3.3: the mean row MAV of `expert − base` over all floating tensors.

    0.0 when the expert equals the base. Streams in row chunks of at most `chunk_elements`.
    """
    check_same_tensors(base, [("expert", expert)])
    return _scan(base, [expert], chunk_elements, should_cancel)[0].magnitude


def _auto_threshold(stats: Sequence[_DeltaStats]) -> float:
    mavs = [t for s in stats for parts in s.rows.values() for t in parts]
    if not mavs:
        return 0.0
    values = torch.cat(mavs).numpy().astype(np.float64)
    return float(np.percentile(values, AUTO_PERCENTILE))


def _matrices(
    stats: _DeltaStats, layers: int, kinds: Sequence[str], threshold: float
) -> tuple[list[list[float | None]], list[list[float | None]]]:
    """(fraction above threshold, mean MAV) per layer and kind; None where a kind is absent."""
    fraction: list[list[float | None]] = [[None] * len(kinds) for _ in range(layers)]
    mean_mav: list[list[float | None]] = [[None] * len(kinds) for _ in range(layers)]
    for (layer, kind), parts in stats.rows.items():
        mavs = torch.cat(parts)
        if mavs.numel() == 0:
            continue
        column = kinds.index(kind)
        fraction[layer][column] = int((mavs > threshold).sum()) / mavs.numel()
        mean_mav[layer][column] = float(mavs.double().sum()) / mavs.numel()
    return fraction, mean_mav


def _kinds(stats: Sequence[_DeltaStats]) -> list[str]:
    found = {kind for s in stats for _, kind in s.rows}
    return sorted(found, key=lambda k: (_KIND_ORDER.get(k, len(_KIND_ORDER)), k))


def _check_arguments(
    experts: Sequence[tuple[str, Path]], threshold: float | None, chunk_elements: int
) -> None:
    if not experts:
        raise RecipeError.for_field("experts", "at least one expert is required")
    labels = [label for label, _ in experts]
    if len(set(labels)) != len(labels) or not all(labels):
        raise RecipeError.for_field("experts", f"labels must be unique and non-empty: {labels}")
    if threshold is not None and (not math.isfinite(threshold) or threshold < 0):
        raise RecipeError.for_field("threshold", f"must be a finite number >= 0 (got {threshold})")
    if chunk_elements < 1:
        raise RecipeError.for_field("chunk_elements", "must be positive")


def _check_roles(labels: Sequence[str], task: str | None, language: str | None) -> None:
    if (task is None) != (language is None):
        raise RecipeError.for_field("task" if task is None else "language", "give both or neither")
    for role, label in (("task", task), ("language", language)):
        if label is not None and label not in labels:
            raise RecipeError.for_field(role, f"no expert labelled {label!r} (have {labels})")
    if task is not None and task == language:
        raise RecipeError.for_field("language", "must name a different expert from task")


def analyze(
    *,
    base: Path,
    experts: Sequence[tuple[str, Path]],
    threshold: float | None = None,
    task: str | None = None,
    language: str | None = None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    guard: FileGuard | None = None,
) -> AnalysisResult:
    """Analyse each `(label, path)` expert against `base` (see the module docstring); `guard`
    confines the files read (engine/io/file_access.py).

    Threshold: `threshold` if given, else the 90th percentile (linear interpolation) of the row
    MAVs of every per-layer tensor of every expert, pooled. Non-layer tensors (embeddings, final
    norm, lm_head) count towards the magnitude only. With `task` and `language` (expert labels)
    the result carries a heuristic swap suggestion (`suggest_swap`).
    """
    _check_arguments(experts, threshold, chunk_elements)
    _check_roles([label for label, _ in experts], task, language)
    opened: list[Checkpoint] = []
    try:
        base_ckpt = Checkpoint.open(base, guard)
        opened.append(base_ckpt)
        opened.extend(Checkpoint.open(path, guard) for _, path in experts)
        expert_ckpts = opened[1:]
        labelled = [(label, c) for (label, _), c in zip(experts, expert_ckpts, strict=True)]
        check_same_tensors(base_ckpt, labelled)
        stack = base_ckpt.require_layers("delta analysis")  # its matrices are per layer
        stats = _scan(base_ckpt, expert_ckpts, chunk_elements, stack=stack)
        layers = stack.count
    finally:
        for ckpt in opened:
            ckpt.close()
    result = _result(base, experts, stats, layers, threshold)
    if task is not None and language is not None:
        result = replace(result, suggestion=suggest_swap(result, task=task, language=language))
    return result


def _result(
    base: Path,
    experts: Sequence[tuple[str, Path]],
    stats: Sequence[_DeltaStats],
    layers: int,
    threshold: float | None,
) -> AnalysisResult:
    chosen = _auto_threshold(stats) if threshold is None else float(threshold)
    kinds = _kinds(stats)
    deltas = []
    for (label, path), stat in zip(experts, stats, strict=True):
        fraction, mean_mav = _matrices(stat, layers, kinds, chosen)
        deltas.append(ExpertDelta(label, path, fraction, mean_mav, stat.magnitude))
    rule = THRESHOLD_RULE_AUTO if threshold is None else THRESHOLD_RULE_EXPLICIT
    return AnalysisResult(base, chosen, rule, kinds, layers, deltas, None)


def _layer_scores(delta: ExpertDelta) -> list[float]:
    """Per layer: the mean over kinds of the fraction of rows above threshold."""
    scores = []
    for row in delta.fraction:
        present = [v for v in row if v is not None]
        scores.append(sum(present) / len(present) if present else 0.0)
    return scores


def _run_length(task: Sequence[float], language: Sequence[float]) -> int:
    count = 0
    for t, lang in zip(task, language, strict=True):
        if lang <= t:
            break
        count += 1
    return count


def suggest_swap(result: AnalysisResult, *, task: str, language: str) -> SwapSuggestion:
    """A HEURISTIC (bottom, top) for layer swapping from where the language expert dominates.

    Score per layer = mean over kinds of the fraction of rows above threshold. `bottom` = number
    of consecutive layers from layer 0 where the language expert's score exceeds the task
    expert's; `top` = the same from the last layer downwards. If bottom + top > L − 1 (at least
    one task layer must stay), the larger of the two is reduced, one layer at a time.
    """
    _check_roles([e.label for e in result.experts], task, language)
    task_scores = _layer_scores(result.expert(task))
    lang_scores = _layer_scores(result.expert(language))
    bottom = _run_length(task_scores, lang_scores)
    top = _run_length(task_scores[::-1], lang_scores[::-1])
    raw = (bottom, top)
    while bottom + top > result.layers - 1:
        if bottom >= top:
            bottom -= 1
        else:
            top -= 1
    return SwapSuggestion(task, language, bottom, top, raw, task_scores, lang_scores)
