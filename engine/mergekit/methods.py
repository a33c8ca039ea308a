"""One translator per mergekit method: a read config in, a Layerswap recipe's method, models,
base and params out. A method Layerswap gains is one more function and one more row of METHODS.

Each translator honours mergekit 0.1.5's parameters and defaults for its method (registry.py,
generalized_task_arithmetic.py, ...) and refuses, by the mergekit field, what the Layerswap
method cannot do; what mergekit itself ignores is ignored with a warning.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.errors import RecipeError
from engine.mergekit.config import Input, MergekitConfig
from engine.mergekit.settings import Place, as_setting, chain, constant, flag, number

Translator = Callable[[MergekitConfig], dict[str, Any]]


@dataclass(frozen=True)
class Method:
    translate: Translator
    shared: frozenset[str]  # mergekit's parameters taking one value for all the models
    per_model: frozenset[str] = frozenset()  # those set per model (or for all, globally)
    base_takes_per_model: bool = True  # False: the base's per-model values are ignored


def _models_with_base(config: MergekitConfig) -> list[Input]:
    """The inputs mergekit merges: with `models`, a base_model not among them joins them
    last (mergekit's normalize_config); a slice's sources are taken as written."""
    inputs = list(config.inputs)
    base = config.base
    if base is not None and config.slices is None and not any(config.is_base(m) for m in inputs):
        inputs.append(base)
    return inputs


def _require_base(config: MergekitConfig) -> Input:
    if config.base is None:
        raise RecipeError.for_field("base_model", f"required by mergekit's {config.method}")
    if config.slices is not None and not any(config.is_base(m) for m in config.inputs):
        raise RecipeError.for_field(
            config.base.field, f"{config.base.source} is not one of the slice's sources"
        )
    return config.base


def _weight(config: MergekitConfig, model: Input, method: str) -> float:
    return float(constant(
        config.model_chain(model, "weight", number),
        f"Layerswap's {method} takes one weight per model",
        missing=f"{model.field}.parameters.weight",
    ))  # fmt: skip


def _shared(config: MergekitConfig, name: str, convert: Any, default: Any, method: str) -> Any:
    return constant(
        config.shared_chain(name, convert, default),
        f"Layerswap's {method} takes one {name}",
        missing=f"parameters.{name}",
    )


def linear(config: MergekitConfig) -> dict[str, Any]:
    models = _models_with_base(config)
    if len(models) < 2:
        raise RecipeError.for_field("models", "Layerswap's linear takes at least two models")
    weights = []
    for model in models:
        found = config.model_chain(model, "weight", number)
        if not found:
            raise RecipeError.for_field(f"{model.field}.parameters.weight", "required")
        weights.append(as_setting(found))
    normalize = _shared(config, "normalize", flag, True, "linear")
    return {"method": "linear", "models": [m.source for m in models],
            "params": {"weights": weights, "normalize": normalize}}  # fmt: skip


def slerp(config: MergekitConfig) -> dict[str, Any]:
    base = _require_base(config)
    others = [m for m in _models_with_base(config) if not config.is_base(m)]
    if len(others) != 1:
        raise RecipeError.for_field(
            "models",
            f"mergekit's slerp takes the base and one other model (got {len(others)} others)",
        )
    t = config.shared_chain("t", number)
    if not t:
        raise RecipeError.for_field("parameters.t", "required by mergekit's slerp")
    return {"method": "slerp", "models": [base.source, others[0].source],
            "params": {"t": as_setting(t)}}  # fmt: skip


def _task_vectors(config: MergekitConfig) -> tuple[Input, list[Input]]:
    base = _require_base(config)
    models = [m for m in config.inputs if not config.is_base(m)]
    if not models:
        raise RecipeError.for_field("models", "no model besides the base")
    return base, models


def task_arithmetic(config: MergekitConfig) -> dict[str, Any]:
    base, models = _task_vectors(config)
    weights = [_weight(config, m, "task_arithmetic") for m in models]
    method = "task_arithmetic"
    params = {"weights": weights, "lambda": float(_shared(config, "lambda", number, 1.0, method)),
              "normalize": _shared(config, "normalize", flag, False, method)}  # fmt: skip
    for name in ("density", "rescale"):
        for where in _set_anywhere(config, name):
            config.warnings.append(
                f"{where}: mergekit's task_arithmetic does not sparsify, so ignores it; ignored"
            )
    return {"method": "task_arithmetic", "base": base.source, "models": [m.source for m in models],
            "params": params}  # fmt: skip


def ties(config: MergekitConfig) -> dict[str, Any]:
    base, models = _task_vectors(config)
    weights = [_weight(config, m, "ties") for m in models]
    for model, weight in zip(models, weights, strict=True):
        if weight <= 0:
            raise RecipeError.for_field(
                f"{model.field}.parameters.weight",
                f"{weight}: Layerswap's ties takes positive weights",
            )
    density = _density(config, models)
    if _shared(config, "rescale", flag, False, "ties"):
        raise RecipeError.for_field("parameters.rescale", "Layerswap's ties does not rescale")
    if density < 1:
        config.warnings.append(
            f"density {density}: Layerswap's ties keeps the ⌈density·n⌉ largest entries of each "
            "delta, mergekit ⌊density·n⌋ (at least 1): one entry more where density·n is fractional"
        )
    params = {"weights": weights, "density": density,
              "lambda": float(_shared(config, "lambda", number, 1.0, "ties")),
              "normalize": _shared(config, "normalize", flag, True, "ties")}  # fmt: skip
    return {"method": "ties", "base": base.source, "models": [m.source for m in models],
            "params": params}  # fmt: skip


def _density(config: MergekitConfig, models: list[Input]) -> float:
    found: list[tuple[str, float]] = []
    for model in models:
        value = float(constant(
            config.model_chain(model, "density", number, 1.0),
            "Layerswap's ties takes one density",
            missing=f"{model.field}.parameters.density",
        ))  # fmt: skip
        where = f"{model.field}.parameters.density"
        if value <= 0:
            raise RecipeError.for_field(where, f"{value}: must be above 0")
        found.append((where, min(value, 1.0)))  # mergekit keeps every entry from 1 up
        if found[-1][1] != found[0][1]:
            raise RecipeError.for_field(
                where, "per-model densities differ; Layerswap's ties takes one density"
            )
    return found[0][1]


# mergekit's sparsifying methods (registry.py): their defaults for normalize and rescale, the
# amount each takes per model beside weight and density (with its default), whether its
# drops are random.
_SPARSIFYING: dict[str, tuple[bool, bool, dict[str, float], bool]] = {
    "dare_ties": (False, True, {}, True),
    "dare_linear": (False, True, {}, True),
    "breadcrumbs": (False, False, {"gamma": 0.01}, False),
    "breadcrumbs_ties": (False, False, {"gamma": 0.01}, False),
    "della": (True, True, {"epsilon": 0.15}, True),
    "della_linear": (False, True, {"epsilon": 0.15}, True),
}


def _fraction(value: Any, field: str) -> float:
    """A density as mergekit reads it: 1 and above keep every entry; none at or below 0."""
    found = number(value, field)
    if found <= 0:
        raise RecipeError.for_field(field, f"{found}: must be above 0")
    return min(found, 1.0)


def _sparsifying(method: str) -> Translator:
    """dare_*, breadcrumbs*, della*: weights and amounts per model (gradients and filters as
    written), the switches shared; mergekit's defaults written out (its density is 1.0)."""
    normalize, rescale, amounts, random = _SPARSIFYING[method]

    def translate(config: MergekitConfig) -> dict[str, Any]:
        base, models = _task_vectors(config)
        params: dict[str, Any] = {"weights": []}
        for model in models:
            found = config.model_chain(model, "weight", number)
            if not found:
                raise RecipeError.for_field(f"{model.field}.parameters.weight", "required")
            params["weights"].append(as_setting(found))
        for name, default in {"density": 1.0, **amounts}.items():
            convert = _fraction if name == "density" else number
            params[name] = [as_setting(config.model_chain(m, name, convert, default))
                            for m in models]  # fmt: skip
        params["lambda"] = as_setting(config.shared_chain("lambda", number, 1.0))
        params["normalize"] = _shared(config, "normalize", flag, normalize, method)
        params["rescale"] = _shared(config, "rescale", flag, rescale, method)
        if random:
            config.warnings.append(
                f"{method}'s drops are random: mergekit draws them from torch's generator, "
                "Layerswap from the recipe's seed (0), the same each time; the two agree in "
                "distribution, not entry by entry"
            )
        return {"method": method, "base": base.source, "models": [m.source for m in models],
                "params": params}  # fmt: skip

    return translate


def passthrough(config: MergekitConfig) -> dict[str, Any]:
    if config.slices is None:
        raise RecipeError.for_field("models", "Layerswap's passthrough takes slices, not models")
    if config.base is not None:
        config.warnings.append("base_model: passthrough merges no base; ignored")
    slices = []
    for piece in config.slices:
        if len(piece.inputs) != 1:
            raise RecipeError.for_field(
                f"{piece.field}.sources", "mergekit's passthrough takes one source per slice"
            )
        (source,) = piece.inputs
        places = [
            (f"{source.field}.parameters", source.parameters),
            (f"{piece.field}.parameters", piece.parameters),
            *config.shared_blocks,
        ]
        scale = chain([Place(f"{w}.scale", b["scale"]) for w, b in places if "scale" in b], number)
        if scale and constant(scale, "Layerswap's passthrough copies layers", missing="") != 1.0:
            raise RecipeError.for_field(scale[0].field, "Layerswap's passthrough does not scale")
        slices.append(
            {"sources": [{"model": source.source, "layer_range": list(piece.layer_range)}]}
        )
    models = list(dict.fromkeys(s["sources"][0]["model"] for s in slices))
    return {"method": "passthrough", "models": models, "params": {"slices": slices}}


def nuslerp(config: MergekitConfig) -> dict[str, Any]:
    """Two models besides an optional base (then of their task vectors); `weight` per model,
    as written; the switches shared, with mergekit's defaults."""
    models = [m for m in config.inputs if not config.is_base(m)]
    if len(models) != 2:
        raise RecipeError.for_field(
            "models", f"mergekit's nuslerp takes two models besides the base (got {len(models)})"
        )
    weights = []
    for model in models:
        found = config.model_chain(model, "weight", number)
        if not found:
            raise RecipeError.for_field(f"{model.field}.parameters.weight", "required")
        weights.append(as_setting(found))
    params = {"weights": weights} | {
        name: as_setting(config.shared_chain(name, flag, default))
        for name, default in (("nuslerp_flatten", True), ("nuslerp_row_wise", False))
    }
    translated = {"method": "nuslerp", "models": [m.source for m in models], "params": params}
    if config.base is not None:  # a slice's sources must hold it, as mergekit checks
        translated["base"] = _require_base(config).source
    return translated


def model_stock(config: MergekitConfig) -> dict[str, Any]:
    base, models = _task_vectors(config)
    if len(models) < 2:
        raise RecipeError.for_field(
            "models", "mergekit's model_stock takes at least two models besides the base"
        )
    filter_wise = as_setting(config.shared_chain("filter_wise", flag, False))
    return {"method": "model_stock", "base": base.source, "models": [m.source for m in models],
            "params": {"filter_wise": filter_wise}}  # fmt: skip


def _set_anywhere(config: MergekitConfig, name: str) -> list[str]:
    blocks = [(f"{m.field}.parameters", m.parameters) for m in config.inputs]
    return [f"{where}.{name}" for where, block in blocks + config.shared_blocks if name in block]


# mergekit's generalized task arithmetic: shared and per-model (non-base) parameters
_TASK_VECTORS = frozenset({"int8_mask", "normalize", "rescale", "lambda"})
_WEIGHT_DENSITY = frozenset({"weight", "density"})
METHODS: dict[str, Method] = {
    "linear": Method(linear, frozenset({"normalize"}), frozenset({"weight"})),
    "slerp": Method(slerp, frozenset({"t"})),
    "nuslerp": Method(
        nuslerp, frozenset({"nuslerp_flatten", "nuslerp_row_wise"}), frozenset({"weight"}), False
    ),
    "model_stock": Method(model_stock, frozenset({"filter_wise"})),
    "passthrough": Method(passthrough, frozenset(), frozenset({"scale"})),
    "task_arithmetic": Method(task_arithmetic, _TASK_VECTORS, _WEIGHT_DENSITY, False),
    "ties": Method(ties, _TASK_VECTORS, _WEIGHT_DENSITY, False),
    **{
        name: Method(_sparsifying(name), _TASK_VECTORS, _WEIGHT_DENSITY | set(amounts), False)
        for name, (_, _, amounts, _) in _SPARSIFYING.items()
    },
}  # fmt: skip
# mergekit 0.1.5's other methods (merge_methods/registry.py), refused by name until Layerswap
# has them.
NOT_YET = ("multislerp", "nearswap", "ram", "ramplus_tl", "sce", "arcee_fusion", "karcher")
