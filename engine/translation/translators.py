"""What a Layerswap method declares of its mergekit counterpart (a `Translation`), and the
pieces its translator is made of.

A translation names the mergekit methods the Layerswap method answers to, lists mergekit
0.1.5's parameters for them (merge_methods/registry.py, generalized_task_arithmetic.py, ...)
with mergekit's defaults, each shared by all the models or set per model, and the translator: a
read config in, the recipe's models, base and params out. Where a parameter maps onto one of
the recipe's params (`into`), `read_parameters` reads it generically (a setting where it may
vary by layer or tensor, else the one value it must take); `translate_task_vectors` is the
whole translator of a method over a base and task vectors. A translator refuses, by the
mergekit field, what the Layerswap method cannot do; what mergekit itself ignores is ignored
with a warning (engine/mergekit/ says so of parameters the method does not take).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from engine.errors import RecipeError
from engine.translation.config import Input, MergekitConfig
from engine.translation.settings import Convert, as_setting, constant, number


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Final[Any] = _Required()  # a Parameter's default where mergekit requires it


@dataclass(frozen=True)
class Parameter:
    """One of mergekit's parameters of a method, with mergekit's default (None: unset, it
    does nothing; REQUIRED: a config must set it)."""

    name: str  # mergekit's
    default: Any = REQUIRED
    per_model: bool = False  # set per model; else one value for all the models
    convert: Convert = number
    into: str | None = None  # the recipe param read_parameters writes; None: read otherwise
    varies: bool = True  # may vary by layer or tensor (a setting); False: one value or refused

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


Translator = Callable[[MergekitConfig, "Translation"], dict[str, Any]]


@dataclass(frozen=True)
class Translation:
    """A Layerswap method's mergekit counterpart (above)."""

    names: tuple[str, ...]  # the mergekit methods it answers to (`merge_method`)
    translate: Translator  # (config, this) -> the recipe's models, base and params
    parameters: tuple[Parameter, ...] = ()
    base_takes_per_model: bool = True  # False: the base's per-model values are ignored
    # The dtype mergekit writes the method's tensors in where the config names no out_dtype
    # (None: the config's `dtype`), when its arithmetic widens every result (arcee_fusion's
    # float32 mask); a `dtype: float64` keeps float64.
    writes: str | None = None

    @property
    def shared(self) -> frozenset[str]:
        return frozenset(p.name for p in self.parameters if not p.per_model)

    @property
    def per_model(self) -> frozenset[str]:
        return frozenset(p.name for p in self.parameters if p.per_model)

    def parameter(self, name: str) -> Parameter:
        return next(p for p in self.parameters if p.name == name)


def read_parameter(
    config: MergekitConfig, translation: Translation, name: str, models: Sequence[Input] = ()
) -> Any:
    """A declared parameter's value for the recipe: per model, a list over `models`."""
    p = translation.parameter(name)
    default = None if p.required else p.default
    if p.per_model:
        return [_read_model(config, p, model, default) for model in models]
    if not p.varies:
        return shared_constant(config, name, p.convert, default)
    found = config.shared_chain(name, p.convert, default)
    if not found:
        raise RecipeError.for_field(f"parameters.{name}", f"required by mergekit's {config.method}")
    return as_setting(found)


def _read_model(config: MergekitConfig, p: Parameter, model: Input, default: Any) -> Any:
    if not p.varies:
        return constant(
            config.model_chain(model, p.name, p.convert, default),
            f"Layerswap's {config.method} takes one {p.name} per model",
            missing=f"{model.field}.parameters.{p.name}",
        )
    found = config.model_chain(model, p.name, p.convert, default)
    if not found:
        raise RecipeError.for_field(f"{model.field}.parameters.{p.name}", "required")
    return as_setting(found)


def read_parameters(
    config: MergekitConfig, translation: Translation, models: Sequence[Input]
) -> dict[str, Any]:
    """The recipe's params from every declared parameter with an `into`, in their order."""
    return {
        p.into: read_parameter(config, translation, p.name, models)
        for p in translation.parameters
        if p.into is not None
    }


def shared_constant(config: MergekitConfig, name: str, convert: Convert, default: Any) -> Any:
    """A shared parameter's one value, refused where it varies by layer or tensor."""
    return constant(
        config.shared_chain(name, convert, default),
        f"Layerswap's {config.method} takes one {name}",
        missing=f"parameters.{name}",
    )


def models_with_base(config: MergekitConfig) -> list[Input]:
    """The inputs mergekit merges: with `models`, a base_model not among them joins them
    last (mergekit's normalize_config); a slice's sources are taken as written."""
    inputs = list(config.inputs)
    base = config.base
    if base is not None and config.slices is None and not any(config.is_base(m) for m in inputs):
        inputs.append(base)
    return inputs


def require_base(config: MergekitConfig) -> Input:
    if config.base is None:
        raise RecipeError.for_field("base_model", f"required by mergekit's {config.method}")
    if config.slices is not None and not any(config.is_base(m) for m in config.inputs):
        raise RecipeError.for_field(
            config.base.field, f"{config.base.source} is not one of the slice's sources"
        )
    return config.base


def task_vectors(config: MergekitConfig) -> tuple[Input, list[Input]]:
    """The base and the models besides it, whose differences from it are merged."""
    base = require_base(config)
    models = [m for m in config.inputs if not config.is_base(m)]
    if not models:
        raise RecipeError.for_field("models", "no model besides the base")
    return base, models


def translate_task_vectors(config: MergekitConfig, translation: Translation) -> dict[str, Any]:
    """A method over a base and the task vectors of the other models, its params each a
    declared parameter."""
    base, models = task_vectors(config)
    return {"base": base.source, "models": [m.source for m in models],
            "params": read_parameters(config, translation, models)}  # fmt: skip


def fraction(value: Any, field: str) -> float:
    """A density as mergekit reads it: 1 and above keep every entry; none at or below 0."""
    found = number(value, field)
    if found <= 0:
        raise RecipeError.for_field(field, f"{found}: must be above 0")
    return min(found, 1.0)


def set_anywhere(config: MergekitConfig, name: str) -> list[str]:
    """Every field of the config that sets parameter `name`."""
    blocks = [(f"{m.field}.parameters", m.parameters) for m in config.inputs]
    return [f"{where}.{name}" for where, block in blocks + config.shared_blocks if name in block]
