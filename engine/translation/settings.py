"""mergekit's parameter settings, resolved as mergekit 0.1.5 resolves them, as Layerswap settings.

mergekit looks a parameter up from the most specific place to the least: the model's own
`parameters`, then its slice's, then the config's. At each place the value is a number, a
gradient (a list of numbers) or `{filter, value}` conditions; a place whose conditions match
none of a tensor's name defers to the next place, and the parameter's default comes last.
Layerswap's settings (engine/schema/settings.py) are one list of conditions, the first match
winning, so the places are chained into one list in that order, and the result means the same
per tensor. Numbers are read as mergekit reads them (pydantic: "1e-3" is 0.001, true is 1.0).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from engine.errors import RecipeError, quoted

_NUMBER: TypeAdapter[float] = TypeAdapter(float)
_FLAG: TypeAdapter[bool] = TypeAdapter(bool)
SCALARS = (bool, int, float, str)


@dataclass(frozen=True)
class Place:
    """One place a parameter may be set: `field` names it in the mergekit config."""

    field: str
    raw: Any


@dataclass(frozen=True)
class Condition:
    field: str  # where it was written
    filter: str | None
    value: Any  # a scalar or a gradient, converted

    @property
    def matches_all(self) -> bool:
        return self.filter in (None, "*")


def number(value: Any, field: str) -> float:
    try:
        found = _NUMBER.validate_python(value)
    except ValidationError:
        raise RecipeError.for_field(field, f"not a number: {quoted(value)}") from None
    if not math.isfinite(found):
        raise RecipeError.for_field(field, f"must be finite (got {quoted(value)})")
    return found


def flag(value: Any, field: str) -> bool:
    try:
        return _FLAG.validate_python(value)
    except ValidationError:
        raise RecipeError.for_field(field, f"not true or false: {quoted(value)}") from None


Convert = Callable[[Any, str], Any]


def _conditions(place: Place, convert: Convert) -> list[Condition]:
    """One place's setting as conditions; none for an empty list (mergekit: no value here)."""
    raw, field = place.raw, place.field
    if isinstance(raw, dict):
        raw = [raw]  # a single {filter, value}
    if isinstance(raw, SCALARS):
        return [Condition(field, None, convert(raw, field))]
    if not isinstance(raw, list):
        raise RecipeError.for_field(
            field, f"must be a number, a list or conditions ({quoted(raw)})"
        )
    if all(isinstance(item, SCALARS) for item in raw):
        gradient = [convert(item, f"{field}.{i}") for i, item in enumerate(raw)]
        return [Condition(field, None, gradient)] if gradient else []
    return [_condition(item, f"{field}.{i}", convert) for i, item in enumerate(raw)]


def _condition(item: Any, field: str, convert: Convert) -> Condition:
    if not isinstance(item, dict):
        raise RecipeError.for_field(field, "a list mixes conditions and values")
    if unknown := set(item) - {"filter", "value"}:
        raise RecipeError.for_field(f"{field}.{sorted(unknown)[0]}", "unknown field")
    if "value" not in item:
        raise RecipeError.for_field(f"{field}.value", "required")
    where = f"{field}.value"
    value = item["value"]
    if isinstance(value, list) and all(isinstance(v, SCALARS) for v in value) and value:
        converted: Any = [convert(v, f"{where}.{i}") for i, v in enumerate(value)]
    elif isinstance(value, SCALARS):
        converted = convert(value, where)
    else:
        raise RecipeError.for_field(where, "must be a number or a list of numbers")
    found = item.get("filter")
    if found is not None and not isinstance(found, str):
        raise RecipeError.for_field(f"{field}.filter", "must be text (part of a tensor name)")
    return Condition(field, found, converted)


def chain(places: list[Place], convert: Convert, default: Any = None) -> list[Condition]:
    """The places' conditions in precedence order, up to the first that matches every tensor
    (nothing after it is ever asked); the default, if any, closes a chain that may miss."""
    found: list[Condition] = []
    for place in places:
        for condition in _conditions(place, convert):
            found.append(condition)
            if condition.matches_all:
                return found
    if default is not None:
        found.append(Condition("default", None, default))
    return found


def as_setting(conditions: list[Condition]) -> Any:
    """Layerswap's setting (engine.schema.settings.Setting) for a chain: a number, a gradient, or
    `{filter, value}` conditions."""
    if conditions and conditions[0].matches_all:
        return conditions[0].value
    return [
        {"value": c.value} if c.matches_all else {"filter": c.filter, "value": c.value}
        for c in conditions
    ]


def constant(conditions: list[Condition], problem: str, *, missing: str) -> Any:
    """The one value a chain takes for every tensor of every layer, or RecipeError naming the
    place that makes it vary (`problem` says why one value is needed); `missing` names the
    field to set when the chain gives no value at all."""
    if not conditions:
        raise RecipeError.for_field(missing, f"required; {problem}")
    values: set[Any] = set()
    for c in conditions:
        values.update(c.value if isinstance(c.value, list) else [c.value])
        if len(values) > 1:  # named where it was written (the default was not)
            where = c.field if c.field != "default" else conditions[0].field
            raise RecipeError.for_field(where, f"varies by layer or tensor; {problem}")
    if not conditions[-1].matches_all:
        raise RecipeError.for_field(
            conditions[-1].field, "no value for the tensors its filters do not match"
        )
    return values.pop()
