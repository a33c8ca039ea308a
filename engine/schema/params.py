"""What GET /v1/methods and the documentation say of each of a method's params, derived from
its Pydantic model: the type, default, bounds and description, whether it may vary by layer or
tensor (a setting or a switch, settings.py) and whether it is given per model.

The type alone cannot say two things, so two markers (Annotated metadata, which Pydantic leaves
alone) say them where the type is written: ONE_PER_MODEL on a list of one value per model, and a
Range on a value whose numbers a check of the params bounds (a setting's every number; a plain
number is bounded by Pydantic's own `Field(gt=...)`, read here too).
"""

from __future__ import annotations

import json
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from engine.schema.settings import Setting, Switch


@dataclass(frozen=True)
class OnePerModel:
    """A list of one value per model, in the recipe's order."""


ONE_PER_MODEL = OnePerModel()


@dataclass(frozen=True)
class Range:
    """The numbers a value may take: low..high, each end open or closed, or unbounded."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self) -> str:
        """(0, 1], [0, 0.5), ≥ 0, < 1."""
        low, high = _number(self.low), _number(self.high)
        if self.high is None:
            return f"{'>' if self.low_open else '≥'} {low}"
        if self.low is None:
            return f"{'<' if self.high_open else '≤'} {high}"
        return f"{'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"


def _number(value: float | None) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Param:
    """One param of a method, as a recipe writes it."""

    name: str  # as written in a recipe (`lambda`, not the attribute `lambda_`)
    type: str  # short: number, integer, boolean, setting, switch, "uniform" | list[setting]
    default: Any  # as JSON; meaningless when required
    required: bool
    bounds: Range | None
    varies_by_layer: bool  # a setting or switch: a gradient over the layers, or by tensor name
    per_model: bool  # a list of one value per model
    description: str


def describe(params: type[BaseModel]) -> tuple[Param, ...]:
    """Every param of a method's params model, in declaration order."""
    schema = params.model_json_schema(by_alias=True)["properties"]
    found = []
    for attribute, field in params.model_fields.items():
        name = field.alias or attribute
        found.append(
            Param(
                name=name,
                type=type_name(field.annotation),
                default=schema[name].get("default"),
                required=field.is_required(),
                bounds=bounds(field),
                varies_by_layer=_mentions(field.annotation, lambda t: t in (Setting, Switch)),
                per_model=_mentions(field.annotation, _is_one_per_model),
                description=field.description or "",
            )
        )
    return tuple(found)


def bounds(field: FieldInfo) -> Range | None:
    """A field's Range, or the one its Pydantic bounds (gt, ge, lt, le) make."""
    limits: dict[str, Any] = {}
    for item in field.metadata:
        if isinstance(item, Range):
            return item
        for attribute, end, is_open in (("gt", "low", True), ("ge", "low", False),
                                        ("lt", "high", True), ("le", "high", False)):  # fmt: skip
            value = getattr(item, attribute, None)
            if value is not None:
                limits[end], limits[f"{end}_open"] = value, is_open
    return Range(**limits) if limits else None


def type_name(annotation: Any) -> str:
    """A short name of a param's type: setting and switch for settings.py's, {a, b} for a
    mapping of fields a and b."""
    if annotation == Setting:
        return "setting"
    if annotation == Switch:
        return "switch"
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return type_name(args[0])
    if origin in (Union, types.UnionType):
        return " | ".join(dict.fromkeys(type_name(a) for a in args))
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin is list:
        return f"list[{type_name(args[0])}]"
    if origin is tuple:
        return "[" + ", ".join(type_name(a) for a in args) + "]"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        fields = annotation.model_fields.items()
        return "{" + ", ".join(f.alias or name for name, f in fields) + "}"
    names = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _mentions(annotation: Any, test: Callable[[Any], bool]) -> bool:
    """Whether `test` holds for the annotation or any type it is made of."""
    if test(annotation):
        return True
    if get_origin(annotation) is Annotated:  # its metadata are no types
        return _mentions(get_args(annotation)[0], test)
    return any(_mentions(arg, test) for arg in get_args(annotation))


def _is_one_per_model(annotation: Any) -> bool:
    return get_origin(annotation) is Annotated and ONE_PER_MODEL in get_args(annotation)[1:]
