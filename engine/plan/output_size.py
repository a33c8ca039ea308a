"""How many times the size of its inputs a merge's output may be.

Most merges write one model's worth from several (a soup, a layer swap: less than their inputs
together). An output grows past its inputs only through passthrough's slices (a layer listed
twice is written twice), tokenizer_source's union (embedding rows for every token of every
input) and output.dtype (bfloat16 to float32 doubles every byte). Bounding the output by its
inputs keeps what a few KB of recipe can make the service write proportional to the checkpoints
the caller already has; the plan knows every output tensor's shape and dtype before a byte is
written, so the bound is checked from headers alone.
"""

from __future__ import annotations

from engine.errors import OutputTooLarge
from engine.plan.model import Plan


def input_bytes(plan: Plan) -> int:
    """Tensor bytes of the plan's distinct input checkpoints (one named twice counts once)."""
    sizes: dict[str, int] = {}
    for ref, checkpoint in zip(plan.inputs, plan.checkpoints, strict=True):
        if ref.path not in sizes:
            sizes[ref.path] = sum(info.nbytes for info in checkpoint.tensors.values())
    return sum(sizes.values())


def check_output_ratio(plan: Plan, max_ratio: float) -> None:
    """OutputTooLarge, naming the recipe field that makes the output big and the figures, when
    the output's tensor bytes are more than `max_ratio` times its inputs'."""
    output, inputs = plan.total_bytes, input_bytes(plan)
    if output <= max_ratio * inputs:
        return
    field = growth_field(plan)
    ratio = output / max(inputs, 1)
    raise OutputTooLarge(
        f"{field}: the output would take {output} bytes, {ratio:.2f}× the {inputs} bytes of its "
        f"distinct inputs; at most {max_ratio:g}× is allowed (LAYERSWAP_MAX_OUTPUT_RATIO)",
        details={
            "field": field,
            "output_bytes": output,
            "input_bytes": inputs,
            "ratio": round(ratio, 3),
            "max_ratio": max_ratio,
        },
    )


def growth_field(plan: Plan) -> str:
    """The recipe field that makes the output larger than one input."""
    if plan.method == "passthrough":
        return "params.slices"
    if plan.vocabulary is not None:
        return "tokenizer_source"
    return "output.dtype"
