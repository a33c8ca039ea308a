"""The recipe: what a user asks for. One Pydantic schema for the CLI (YAML) and the API (JSON),
the union of every method's own recipe (engine/methods/, listed in engine.methods.METHODS),
made from the methods registered when a recipe is first parsed after one is added.

Only shape and local consistency are checked here; facts that need the checkpoints (layer
counts, tensor names) are checked when the plan is made, still before any output exists.
This module must stay importable without torch: the API process validates recipes too.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Annotated, Any, Union

from pydantic import Field, TypeAdapter, ValidationError

from engine.errors import RecipeError
from engine.methods import METHODS
from engine.schema.parts import (
    HUB_REPO_PATTERN,
    Credential,
    HubDestination,
    MlflowDestination,
    NamedSource,
    OutputOptions,
    RecipeBase,
    Source,
    parse_size,
)

__all__ = [
    "HUB_REPO_PATTERN",
    "Credential",
    "HubDestination",
    "MlflowDestination",
    "NamedSource",
    "OutputOptions",
    "Recipe",
    "Source",
    "named_sources",
    "parse_recipe",
    "parse_size",
    "recipe_error_from",
    "recipe_schema",
    "recipe_to_dict",
    "slice_recipes",
]

# Any method's recipe; parse_recipe gives the method's own class (SoupRecipe, ...).
Recipe = RecipeBase


def recipe_schema() -> Any:
    """The recipe's type: the union of the registered methods' recipes, told apart by
    `method`."""
    return _union(tuple(m.recipe for m in METHODS.values()))


@cache
def _union(members: tuple[type[RecipeBase], ...]) -> Any:
    return Annotated[Union[members], Field(discriminator="method")]  # noqa: UP007


@cache
def _adapter(schema: Any) -> TypeAdapter[RecipeBase]:
    return TypeAdapter(schema)


def parse_recipe(data: Any) -> Recipe:
    """Validate a recipe mapping; raise RecipeError naming the first offending field."""
    if not isinstance(data, dict):
        raise RecipeError.for_field("recipe", "must be a mapping")
    if data.get("method") not in METHODS:
        raise RecipeError.for_field(
            "method", f"must be one of {', '.join(METHODS)} (got {data.get('method')!r})"
        )
    try:
        recipe = _adapter(recipe_schema()).validate_python(data)
    except ValidationError as e:
        raise _recipe_error(e) from None
    slice_recipes(recipe)  # each slice's own params are checked as the recipe's are
    return recipe


def slice_recipes(recipe: Recipe) -> list[Recipe]:
    """Where a slice sets its own params or merges only some of the models: per slice, the
    recipe it merges its layers by (the recipe with the slice's models, in the order it lists
    them, or the recipe's where its first model is the base, and its params); [] where every
    slice merges as the recipe. Raises RecipeError
    naming the slice's field (`slices.1.params.t`)."""
    slices = getattr(recipe, "slices", None) or []
    everyone = getattr(recipe, "models", [])
    own = [[s.model for s in piece.sources if s.model != recipe.base] for piece in slices]
    pairs = list(zip(slices, own, strict=True))
    if all(piece.params is None and set(models) == set(everyone) for piece, models in pairs):
        return []
    data = recipe_to_dict(recipe)
    del data["slices"]
    found = []
    if METHODS[recipe.method].first_model_is_base:  # the recipe's first model is t = 0 (slerp)
        pairs = [(piece, sorted(models, key=everyone.index)) for piece, models in pairs]
    for s, (piece, models) in enumerate(pairs):
        if piece.params is None and set(models) == set(everyone):  # merged as the recipe
            found.append(recipe)
            continue
        params = data.get("params", {}) if piece.params is None else piece.params
        try:
            found.append(type(recipe).model_validate({**data, "models": models, "params": params}))
        except ValidationError as e:
            error = recipe_error_from(e.errors(), skip=0)
            where = str(error.details["field"])
            raise RecipeError.for_field(
                f"slices.{s}.{where}", error.message.removeprefix(f"{where}: ")
            ) from None
    return found


def _recipe_error(error: ValidationError) -> RecipeError:
    return recipe_error_from(error.errors(), skip=1)  # loc[0] is the method tag


def recipe_error_from(errors: list[Any], *, skip: int) -> RecipeError:
    """One RecipeError from Pydantic errors, naming the most useful field first."""
    problems = []
    for item in errors:
        loc = [str(part) for part in item["loc"][skip:] if not _is_union_tag(part)]
        message = str(item["msg"]).removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field"
        problems.append({"field": ".".join(loc) or "recipe", "message": message})
    # A value that fits no member of a union fails each member; a literal's complaint
    # ("should be 'uniform'") or a scalar's ("should be a valid number") is the least helpful
    # when the value was a mapping or list (a gradient too long: "at most 256 items").
    unhelpful = {i for i, item in enumerate(errors) if _unhelpful(item)}
    first = min(range(len(problems)), key=lambda i: (i in unhelpful and len(problems) > 1, i))
    where = _mentioned_field(problems[first]["message"]) or problems[first]["field"]
    return RecipeError(
        f"{where}: {problems[first]['message']}", details={"field": where, "problems": problems}
    )


def _unhelpful(item: Any) -> bool:
    given = item.get("input")
    if item["type"] == "literal_error":
        return not isinstance(given, str)
    return item["type"] in SCALAR_TYPES and isinstance(given, list | dict)


SCALAR_TYPES = frozenset({"float_type", "int_type", "bool_type", "string_type"})


def _is_union_tag(part: str | int) -> bool:
    """Pydantic names union members in error locations (`literal['a']`, `RoleWeights`)."""
    return isinstance(part, str) and (
        any(c in part for c in "[(-")
        or part[:1].isupper()
        or part in {"int", "str", "float", "bool"}
    )


def _mentioned_field(message: str) -> str | None:
    """Model-level checks name their field in the message ('base is required ...')."""
    match = re.match(
        r"^(base|params\.[\w.]*\w|slices\.[\w.]*\w|models(?:\.\d+)?|experts\.\w+|tokenizer_source)\b",
        message,
    )
    return match.group(1) if match else None


def named_sources(recipe: Recipe) -> list[NamedSource]:
    return recipe.sources()


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    data = recipe.model_dump(mode="json", by_alias=True)
    # written as before these were fields: digests kept
    for key in ("slices", "tokens", "pad_to_multiple_of"):
        if data.get(key, "") is None:
            del data[key]
    for piece in data.get("slices") or []:
        if piece.get("params", "") is None:
            del piece["params"]
    return data
