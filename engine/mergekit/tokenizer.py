"""mergekit's `tokenizer_source` (or `tokenizer: {source}`) as the recipe's `tokenizer_source`;
the block's `tokens` and `pad_to_multiple_of` as the recipe's (token_rows.py).

mergekit 0.1.5 builds the output's vocabulary on the config's `base_model` (without one, on
whichever model its set of models yields first) and fills a token a model lacks from the base
of the slice it merges. Layerswap's engine (engine/vocabulary/alignment.py) takes one base for
both: the recipe's base, slerp's first model, else the first model. The translation makes that base
mergekit's, or refuses naming the field; what only differs in a corner is said in a warning.
"""

from __future__ import annotations

from typing import Any

from engine.errors import RecipeError
from engine.mergekit.config import IsLocal, mapping, model_source
from engine.mergekit.token_rows import translate_tokens
from engine.methods import METHODS as ENGINE_METHODS
from engine.schema.parts import TOKENIZER_BASE, TOKENIZER_MODEL_PREFIX, TOKENIZER_UNION
from engine.translation.config import MergekitConfig

# Where the engine's vocabulary rules stop being mergekit's: tokens the copied model lacks.
PASSTHROUGH_ROWS = (
    "{where}: for a token the model a tensor is copied from lacks, mergekit's passthrough "
    "writes a zero row; Layerswap writes the row another input has (or their mean)"
)
# mergekit adds the tokens to the base's own tokenizer, then finds the base's new ids past its rows.
BASE_TOKENS = (
    "tokenizer.tokens with source base: mergekit 0.1.5 fails (a KeyError) on a token absent from "
    "the base's tokenizer; Layerswap adds it, as with union"
)


def tokenizer_source(
    data: dict[str, Any], config: MergekitConfig, recipe: dict[str, Any], is_local: IsLocal
) -> str | None:
    """Set the recipe's tokenizer_source (and the base its rules need) from the config;
    return the mergekit field it was written at (None: the config sets none)."""
    where, wanted = _setting(data)
    if where is None:
        return None
    base = config.base
    if recipe["method"] == "linear" and base is not None and base.source in recipe["models"]:
        recipe["base"] = base.source  # mergekit merges it as a model and fills rows from it
    if wanted in (TOKENIZER_BASE, TOKENIZER_UNION):
        _agree_on_the_base(where, wanted, data, config, recipe, is_local)
        recipe["tokenizer_source"] = wanted
    else:
        if isinstance(wanted, str):  # Layerswap's own form, as the recipe's
            wanted = wanted.removeprefix(TOKENIZER_MODEL_PREFIX)
        source = model_source(wanted, where, is_local)
        if source not in _inputs(recipe):
            raise RecipeError.for_field(where, f"{source} is not one of the merged models")
        recipe["tokenizer_source"] = TOKENIZER_MODEL_PREFIX + source
    if isinstance(data.get("tokenizer"), dict):
        recipe.update(translate_tokens(data["tokenizer"], _inputs(recipe), is_local))
        if wanted == TOKENIZER_BASE and recipe.get("tokens"):
            config.warnings.append(BASE_TOKENS)
    if recipe["method"] == "passthrough":
        config.warnings.append(PASSTHROUGH_ROWS.format(where=where))
    return where


def _setting(data: dict[str, Any]) -> tuple[str | None, Any]:
    named = data.get("tokenizer_source")
    if data.get("tokenizer") is None:
        return ("tokenizer_source", named) if named is not None else (None, None)
    if named is not None:
        raise RecipeError.for_field("tokenizer", "give tokenizer_source or tokenizer, not both")
    block = mapping(data["tokenizer"], "tokenizer")
    if unknown := set(block) - {"source", "tokens", "pad_to_multiple_of"}:
        raise RecipeError.for_field(f"tokenizer.{sorted(unknown)[0]}", "unknown field")
    return "tokenizer.source", block.get("source", TOKENIZER_UNION)  # mergekit's default


def _agree_on_the_base(
    where: str,
    wanted: str,
    data: dict[str, Any],
    config: MergekitConfig,
    recipe: dict[str, Any],
    is_local: IsLocal,
) -> None:
    """Make the base the engine builds `base` or `union` on mergekit's, or refuse."""
    method = recipe["method"]
    inputs = _inputs(recipe)
    if data.get("base_model") is None:
        if len(set(inputs)) > 1:
            config.warnings.append(
                f"{where} {wanted} without base_model: mergekit builds the vocabulary on the "
                "model its set of models yields first (Python's set order, which may change "
                f"from run to run); Layerswap on {_engine_base(recipe)}"
            )
        return
    top = model_source(data["base_model"], "base_model", is_local)
    if top not in inputs:
        raise RecipeError.for_field(
            where,
            f"{wanted!r} builds the vocabulary on base_model {top}, which Layerswap's {method} "
            "does not read here; name one of the merged models instead",
        )
    if config.base is not None and config.base.source != top:
        raise RecipeError.for_field(
            where,
            f"{wanted!r}: mergekit builds the vocabulary on base_model {top} and fills missing "
            f"rows from {config.base_field} {config.base.source}; Layerswap takes one base for "
            "both",
        )
    if method == "passthrough":  # no base: the engine starts from the first model
        recipe["models"] = [top, *(m for m in recipe["models"] if m != top)]
    if (ours := _engine_base(recipe)) != top:
        raise RecipeError.for_field(
            where, f"{wanted!r}: Layerswap's {method} builds the vocabulary on {ours}, "
            f"mergekit on base_model {top}"
        )  # fmt: skip


def _inputs(recipe: dict[str, Any]) -> list[str]:
    base = [recipe["base"]] if recipe.get("base") is not None else []
    return [*recipe["models"], *base]


def _engine_base(recipe: dict[str, Any]) -> str:
    """The source engine/vocabulary/alignment.py builds `base` and `union` on."""
    if ENGINE_METHODS[recipe["method"]].first_model_is_base or recipe.get("base") is None:
        return str(recipe["models"][0])
    return str(recipe["base"])
