"""A mergekit 0.1.5 config as read (engine/mergekit/config.py reads it): the models it merges,
its base, its slices, and the places each parameter may be set, most specific first."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.translation.settings import Condition, Convert, Place, chain


@dataclass(frozen=True)
class Input:
    """One model a config merges, as written at `field`."""

    field: str  # models.1 or slices.0.sources.1
    source: str  # a Layerswap source: a local path, or hf://org/name[@revision]
    parameters: dict[str, Any]


@dataclass(frozen=True)
class Slice:
    field: str  # slices.2
    inputs: list[Input]
    ranges: tuple[tuple[int, int], ...]  # each input's layer_range, as long as the others
    parameters: dict[str, Any]
    base: Input | None  # the slice's own base_model

    @property
    def layer_range(self) -> tuple[int, int]:
        return self.ranges[0]


@dataclass
class MergekitConfig:
    method: str
    inputs: list[Input]  # models, or the (first) slice's sources; [] for a passthrough's
    slices: list[Slice] | None  # as written, when the config has `slices`
    base: Input | None  # base_model; its parameters are those it is listed with, if it is
    shared: list[Place] = field(default_factory=list)  # parameter blocks, most specific first
    warnings: list[str] = field(default_factory=list)
    sliced: bool = False  # the recipe takes the slices (the same inputs in each)
    base_field: str = "base_model"  # where the base was named

    def shared_chain(self, name: str, convert: Convert, default: Any = None) -> list[Condition]:
        """A parameter that takes one value for all the models (its per-model ones ignored)."""
        return chain(self._places(name, None), convert, default)

    def model_chain(
        self, model: Input, name: str, convert: Convert, default: Any = None
    ) -> list[Condition]:
        """A parameter set per model: the model's own, then its slice's, then the config's."""
        return chain(self._places(name, model), convert, default)

    def _places(self, name: str, model: Input | None) -> list[Place]:
        own = [] if model is None else [(f"{model.field}.parameters", model.parameters)]
        return [Place(f"{where}.{name}", block[name]) for where, block in own + self.shared_blocks
                if name in block]  # fmt: skip

    @property
    def shared_blocks(self) -> list[tuple[str, dict[str, Any]]]:
        return [(p.field, p.raw) for p in self.shared]

    def is_base(self, model: Input) -> bool:
        return self.base is not None and model.source == self.base.source
