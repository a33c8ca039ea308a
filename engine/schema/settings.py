"""Per-tensor parameter values as mergekit writes them: a scalar, a gradient across the layers
(`[0, 0.5, 1]`), or a list of `{filter, value}` conditions matched against the tensor name.

Resolved exactly as mergekit 0.1.5 does (so that equal recipes give equal bytes): a layer's
position is i / (L - 1), i its index in its slice of L layers (a whole model is one slice;
non-layer tensors sit at 0), a gradient interpolates linearly between
its neighbouring anchors in float64, and the first condition whose filter is a substring of the
tensor name (or is absent or `*`) wins. A switch (a boolean parameter) is written the same
ways; a list of booleans picks, rather than interpolates, anchor int(i / (L - 1) · (n − 1)).
Torch-free: recipes are validated by the API process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

Gradient = Annotated[list[float], Field(min_length=1, max_length=256)]


class Condition(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    filter: str | None = Field(
        None, max_length=200, description="applies to tensors whose name contains this"
    )
    value: float | Gradient


Setting = float | Gradient | Annotated[list[Condition], Field(min_length=1, max_length=32)]


class SwitchCondition(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    filter: str | None = Field(
        None, max_length=200, description="applies to tensors whose name contains this"
    )
    value: bool | Annotated[list[bool], Field(min_length=1, max_length=256)]


Switch = (
    bool
    | Annotated[list[bool], Field(min_length=1, max_length=256)]
    | Annotated[list[SwitchCondition], Field(min_length=1, max_length=32)]
)


@dataclass(frozen=True)
class Depth:
    """The output's layers as the slices that stack them: a gradient spreads over each slice
    anew, as mergekit spreads it."""

    slices: tuple[int, ...]  # each slice's layer count, in order


def position(layer: int | None, depth: int | Depth) -> float:
    """Where a tensor sits in its slice of the stack, 0..1, as mergekit places it (`depth`:
    the layer count of a stack that is one slice)."""
    if layer is None:
        return 0.0
    *earlier, count = depth.slices if isinstance(depth, Depth) else (depth,)
    for first in earlier:
        if layer < first:
            count = first
            break
        layer -= first
    return layer / (count - 1) if count > 1 else 1.0


def interpolate(anchors: list[float], at: float) -> float:
    scaled = at * (len(anchors) - 1)
    low = int(scaled)
    high = min(len(anchors) - 1, low + 1)
    fraction = scaled - low
    return (1 - fraction) * anchors[low] + fraction * anchors[high]


def resolve(setting: Setting, *, name: str, at: float) -> float | None:
    """The value for tensor `name` at stack position `at`; None when no condition matches."""
    if isinstance(setting, float | int):
        return float(setting)
    if all(isinstance(v, float | int) for v in setting):
        return interpolate([float(v) for v in setting], at)  # type: ignore[arg-type]
    for condition in setting:
        assert isinstance(condition, Condition)
        if condition.filter in (None, "*") or (name and condition.filter in name):
            return resolve(condition.value, name=name, at=at)
    return None


def resolve_switch(setting: Switch, *, name: str, at: float) -> bool | None:
    """A switch's value for tensor `name` at stack position `at`; None when no condition
    matches. A list of booleans is a gradient whose anchors are picked, as mergekit does."""
    if isinstance(setting, bool):
        return setting
    if all(isinstance(v, bool) for v in setting):
        return bool(setting[int(at * (len(setting) - 1))])
    for condition in setting:
        assert isinstance(condition, SwitchCondition)
        if condition.filter in (None, "*") or (name and condition.filter in name):
            return resolve_switch(condition.value, name=name, at=at)
    return None
