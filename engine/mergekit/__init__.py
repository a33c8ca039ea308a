"""mergekit 0.1.5 configs (`merge_method`, `models` or `slices`, ...) as Layerswap recipes.

`translate` reads a config as mergekit would (its parameters' precedence, filters, gradients
and defaults), picks the method that answers to its `merge_method` (each method module declares
its mergekit translation: engine/translation/translators.py) and writes the Layerswap recipe
that computes the same merge, refusing by its mergekit field (`models.1.parameters.density`)
whatever Layerswap cannot honour. What travels beside the recipe (the config, warnings, checks
that need the checkpoints) is a MergekitOrigin. Torch-free, like engine.recipe: the API
translates at submit.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.errors import RecipeError
from engine.mergekit.chat_templates import check as check_chat_template
from engine.mergekit.config import (
    TOP_LEVEL,
    IsLocal,
    declared_dtype,
    dtype_name,
    model_source,
    read,
    recipe_slices,
    slice_views,
    whole_models,
)
from engine.mergekit.fields import mergekit_field
from engine.mergekit.origin import MergekitOrigin
from engine.mergekit.tokenizer import tokenizer_source
from engine.methods import Method, mergekit_methods
from engine.recipe import Recipe, parse_recipe
from engine.translation.config import Input, MergekitConfig
from engine.translation.translators import Translation

__all__ = ["MergekitOrigin", "Translated", "is_mergekit_config", "translate"]


@dataclass(frozen=True)
class Translated:
    recipe: Recipe
    origin: MergekitOrigin


def is_mergekit_config(data: Any) -> bool:
    """A mergekit config names its `merge_method`; a Layerswap recipe its `method`."""
    return isinstance(data, dict) and "merge_method" in data


def translate(
    data: Any,
    *,
    is_local: IsLocal,
    output: dict[str, Any] | None = None,
    credential: str | None = None,
    arithmetic: str | None = None,
) -> Translated:
    """The Layerswap recipe for a mergekit config. `is_local` tells a local directory from a
    Hub repository (mergekit: a path that exists is local); `output` and `credential` are
    Layerswap's options the config has no word for (publishing, shard size, a Hub credential);
    `arithmetic` replaces mergekit's (the config's `dtype`) with the dtype asked for.
    Raises RecipeError naming the mergekit field, or `output.*` / `credential`."""
    config = read(data, is_local)
    method = _method(config.method)
    translation = method.mergekit
    assert translation is not None  # _method found it by its mergekit name
    restacked = method.layer_stack == "restacked"  # it reads the config's slices itself
    views: list[MergekitConfig] = []
    if config.slices is not None and not restacked:
        views = slice_views(whole_models(config))
    _check_parameter_names(config, translation, every_slice=restacked or config.sliced)
    owns = [translation.translate(view, translation) for view in views]  # each slice's
    recipe = {"method": method.name, **_whole(config, translation, bool(views))}
    if config.sliced:
        recipe["slices"] = _sliced(recipe, config, owns)
    recipe["output"] = _output(data, dict(output or {}), translation.writes)
    recipe["arithmetic"] = _arithmetic(data, config, arithmetic)
    if credential is not None:
        recipe["credential"] = credential
    check_chat_template(data.get("chat_template"))
    tokenizer = tokenizer_source(data, config, recipe, is_local)
    fields = _source_fields(config, recipe, restacked=restacked)
    if tokenizer is not None:
        fields["tokenizer_source"] = tokenizer
    parsed = _parse(recipe, lambda where: mergekit_field(where, config, translation, fields))
    origin = MergekitOrigin(
        _recorded(data),
        tuple(dict.fromkeys(config.warnings)),  # each slice's reading may repeat one
        fields,
        # mergekit's donor of config.json and the tokenizer: the config's own base_model
        model_source(data["base_model"], "base_model", is_local)
        if data.get("base_model")
        else None,
    )
    return Translated(parsed, origin)


def _whole(config: MergekitConfig, translation: Translation, by_slice: bool) -> dict[str, Any]:
    """The recipe's models, base and params: over every model the slices merge, where they
    merge them each their own way (by_slice; each slice's own reading translated already)."""
    try:
        return translation.translate(config, translation)
    except RecipeError as e:
        if not by_slice or len(config.inputs) == len((config.slices or [])[0].inputs):
            raise
        raise RecipeError.for_field(
            "slices",
            f"merge {len(config.inputs)} models in all, which Layerswap's recipe for "
            f"{config.method} takes together and cannot: {e.message}",
        ) from None


def _sliced(
    recipe: dict[str, Any], config: MergekitConfig, owns: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The recipe's slices; each whose models or parameters give other params than the
    recipe's has its own (owns: each slice's own translation, where they differ)."""
    slices = recipe_slices(config)
    for piece, own in zip(slices, owns, strict=False):
        if own["params"] != recipe["params"] or own["models"] != recipe["models"]:
            piece["params"] = own["params"]
    return slices


def _recorded(data: dict[str, Any]) -> dict[str, Any]:
    """The config as lineage keeps it: JSON (YAML has dates), less the top-level keys mergekit
    ignores (the warnings name each), which need not be stored."""
    known = {key: value for key, value in data.items() if key in TOP_LEVEL}
    return dict(json.loads(json.dumps(known, default=str)))


def _method(name: str) -> Method:
    translated = mergekit_methods()
    if name in translated:
        return translated[name]
    known = ", ".join(sorted(translated))
    raise RecipeError.for_field(
        "merge_method", f"{name!r} is not a mergekit 0.1.5 method ({known})"
    )


def _check_parameter_names(
    config: MergekitConfig, translation: Translation, *, every_slice: bool
) -> None:
    """mergekit ignores a parameter its method does not take: so does Layerswap, saying so."""
    ours = translation.shared | translation.per_model
    blocks: list[tuple[Input | None, str, dict[str, Any]]] = [
        (m, f"{m.field}.parameters", m.parameters) for m in config.inputs
    ]
    blocks += [(None, where, block) for where, block in config.shared_blocks]
    if every_slice:  # its slices' parameters are read slice by slice
        for piece in config.slices or []:
            blocks += [(m, f"{m.field}.parameters", m.parameters) for m in piece.inputs]
            blocks.append((None, f"{piece.field}.parameters", piece.parameters))
    for model, where, block in blocks:
        for name in block:
            problem = _ignored(config, translation, model, name, ours)
            if problem:
                config.warnings.append(f"{where}.{name}: {problem}; ignored, as mergekit does")


def _ignored(
    config: MergekitConfig,
    translation: Translation,
    model: Input | None,
    name: str,
    ours: frozenset[str],
) -> str | None:
    if name == "int8_mask" and name in ours:
        return "it changes only how mergekit stores its sign mask"
    if name not in ours:
        return f"not a parameter of mergekit's {config.method}"
    if model is not None and name not in translation.per_model:
        return f"{config.method} takes one {name} for all the models, not one per model"
    if model is not None and config.is_base(model) and not translation.base_takes_per_model:
        return f"{config.method} takes no {name} for its base"
    return None


def _arithmetic(data: dict[str, Any], config: MergekitConfig, asked: str | None) -> str:
    """mergekit's: its `dtype`, or without one the checkpoints' own; one asked for instead is
    said in a warning."""
    dtype = dtype_name(data["dtype"], "dtype") if data.get("dtype") is not None else None
    mergekit = dtype or "source"
    if asked is not None and asked != mergekit:
        theirs = dtype or "the checkpoints' own dtype"
        config.warnings.append(
            f"arithmetic {asked}: mergekit computes in {theirs}; the output is computed in "
            f"{asked} as asked, so it is not mergekit's bit for bit"
        )
        return asked
    return mergekit


def _output(data: dict[str, Any], out: dict[str, Any], writes: str | None) -> dict[str, Any]:
    if "dtype" in out:
        raise RecipeError.for_field(
            "output.dtype", "set by the mergekit config's out_dtype (or dtype), not here"
        )
    dtype = dtype_name(data["dtype"], "dtype") if data.get("dtype") is not None else None
    # mergekit writes in dtype unless out_dtype, or where the method widens its results
    # (float64 stays float64)
    widened = writes if data.get("out_dtype") is None and dtype != "float64" else None
    out["dtype"] = widened or declared_dtype(data)
    if data.get("name") is not None:
        if "name" in out:
            raise RecipeError.for_field("output.name", "the mergekit config's name names it")
        out["name"] = data["name"]
    return out


def _model_field(model: Input) -> str:
    return model.field if model.field.endswith("base_model") else f"{model.field}.model"


def _source_fields(
    config: MergekitConfig, recipe: dict[str, Any], *, restacked: bool
) -> dict[str, str]:
    """Each source field of the recipe (models.0, base) -> the mergekit field naming it first."""
    written: dict[str, str] = {}
    inputs = [m for piece in config.slices or [] for m in piece.inputs] + config.inputs
    for model in inputs + ([config.base] if config.base else []):
        written.setdefault(model.source, _model_field(model))
    fields = {f"models.{i}": written[s] for i, s in enumerate(recipe["models"])}
    if recipe.get("base") is not None:
        fields["base"] = config.base_field
    if restacked:  # the recipe's params.slices are the config's slices
        fields["params.slices"] = "slices"
    if config.sliced:  # the recipe's slices are the config's, their sources as written
        fields["slices"] = (config.slices or [])[0].field.rsplit(".", 1)[0]
        for piece in config.slices or []:
            own = piece.field.rsplit(".", 1)[-1]
            fields |= {f"slices.{own}.sources.{i}.layer_range": f"{m.field}.layer_range"
                       for i, m in enumerate(piece.inputs)}  # fmt: skip
            if "params" in recipe["slices"][int(own)]:
                fields[f"slices.{own}.params"] = f"{piece.field}.parameters"
    return fields


def _parse(recipe: dict[str, Any], field_of: Callable[[str], str | None]) -> Recipe:
    """parse_recipe, its errors named by the mergekit field (`field_of` the recipe's) where
    there is one (a check the translators missed names the recipe's field, saying so)."""
    try:
        return parse_recipe(recipe)
    except RecipeError as e:
        where = str(e.details.get("field", "recipe"))
        problem = e.message.removeprefix(f"{where}: ")
        if (theirs := field_of(where)) is not None:
            raise RecipeError.for_field(theirs, problem) from None
        if where == "output.name" and "name" in recipe["output"]:
            raise RecipeError.for_field("name", problem) from None
        if where.startswith("output.") or where == "credential":
            raise
        raise RecipeError.for_field(
            "merge_method", f"the translated recipe's {where}: {problem}"
        ) from None
