"""Cross-input checks: every input must be the same architecture with the same tensors."""

from __future__ import annotations

from collections.abc import Sequence

from engine.errors import IncompatibleCheckpointsError, quoted
from engine.io.checkpoint import Checkpoint
from engine.plan.model import InputRef

MAX_LISTED = 50
_CONFIG_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")


def check_compatible(
    refs: Sequence[InputRef],
    checkpoints: Sequence[Checkpoint],
    aligned: frozenset[str] = frozenset(),
) -> None:
    """Raise IncompatibleCheckpointsError listing every mismatch by config key or tensor name.
    The tensors in `aligned` (embeddings and heads, when vocabularies are aligned) may differ
    in their first dimension, their token rows, and then vocab_size may differ too."""
    first, ref0 = checkpoints[0], refs[0]
    problems: list[str] = []
    keys = [k for k in _CONFIG_KEYS if not (aligned and k == "vocab_size")]
    for ref, ckpt in zip(refs[1:], checkpoints[1:], strict=True):
        for key in keys:
            a, b = first.text_config.get(key), ckpt.text_config.get(key)
            if a != b:
                problems.append(f"config {key}: {ref0.label}={quoted(a)}, {ref.label}={quoted(b)}")
        for name in sorted(first.tensors.keys() - ckpt.tensors.keys()):
            problems.append(f"{name}: in {ref0.label}, missing from {ref.label}")
        for name in sorted(ckpt.tensors.keys() - first.tensors.keys()):
            problems.append(f"{name}: in {ref.label}, missing from {ref0.label}")
        for name in sorted(first.tensors.keys() & ckpt.tensors.keys()):
            a_info, b_info = first.tensors[name], ckpt.tensors[name]
            compared = 1 if name in aligned else 0
            if a_info.shape[compared:] != b_info.shape[compared:]:
                problems.append(
                    f"{name}: shape {list(a_info.shape)} in {ref0.label}, "
                    f"{list(b_info.shape)} in {ref.label}"
                )
            elif a_info.dtype != b_info.dtype:
                problems.append(
                    f"{name}: dtype {a_info.dtype} in {ref0.label}, {b_info.dtype} in {ref.label}"
                )
    if problems:
        shown = "; ".join(problems[:3])
        if len(problems) > 3:
            shown += f"; … ({len(problems)} in all)"
        if any(p.startswith("config vocab_size") for p in problems):
            shown += (
                "; to merge different vocabularies, set tokenizer_source (base, union or an input)"
            )
        raise IncompatibleCheckpointsError(
            f"inputs do not match: {shown}",
            details={"mismatches": problems[:MAX_LISTED], "count": len(problems)},
        )
