"""The recipe: what a user asks for. One Pydantic schema for the CLI (YAML) and the API (JSON).

Only shape and local consistency are checked here; facts that need the checkpoints (layer
counts, tensor names) are checked when the plan is made, still before any output exists.
This module must stay importable without torch: the API process validates recipes too.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from engine.errors import RecipeError
from engine.gradients import Setting

Source = Annotated[
    str,
    Field(
        min_length=1,
        description="checkpoint: a directory path, or a Hub repository hf://org/name[@revision]",
    ),
]
HUB_REPO_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$"
CREDENTIAL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
Credential = Annotated[
    str | None,
    Field(
        None,
        pattern=CREDENTIAL_PATTERN,
        description="name of a Hub credential configured where the merge runs (never a token)",
    ),
]
# Each source is opened (and, at submit, its headers read): bounded like every other input.
MAX_EXPERTS_PER_ROLE = 32
MAX_MODELS = 64
MAX_SLICES = 256  # each is a run of layers; MAX_LAYERS bounds their total at plan time
Weights = Literal["uniform", "magnitude"] | Annotated[list[float], Field(max_length=MAX_MODELS)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(value: int | str) -> int:
    """'5GB' -> 5_000_000_000 (decimal like Hugging Face), '1GiB' -> 2**30, ints as bytes."""
    if isinstance(value, int):
        return value
    match = _SIZE_RE.match(value)
    if not match:
        raise ValueError(f"not a size: {value!r} (examples: 5GB, 500MB, 1GiB)")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


class HubDestination(_Strict):
    repo: str = Field(pattern=HUB_REPO_PATTERN, description="org/name; created if missing")
    private: bool = True
    branch: str = Field("main", pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,99}$")
    credential: Credential = None


class MlflowDestination(_Strict):
    """Register the output in the deployment's MLflow Model Registry (service only)."""

    registered_model: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9 ._/-]{0,255}$", description="created if missing"
    )
    alias: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_-]{1,255}$",
        description="point this alias at the new version (e.g. champion)",
    )

    @field_validator("alias")
    @classmethod
    def _not_reserved(cls, value: str | None) -> str | None:
        if value is not None and (value == "latest" or re.fullmatch(r"v[0-9]+", value)):
            raise ValueError(f"{value!r} is reserved by MLflow (latest, v<number>)")
        return value


class OutputOptions(_Strict):
    name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$",
        description="service only: the output artifact's name (default: from the job id)",
    )
    dtype: Literal["source", "bfloat16", "float16", "float32"] = "source"
    shard_size: int | str = Field("5GB", description="largest shard, e.g. 5GB, 500MB, 1GiB")
    hub: HubDestination | None = Field(None, description="also publish the output to the Hub")
    mlflow: MlflowDestination | None = Field(
        None, description="service only: register the output as an MLflow model version"
    )

    @field_validator("shard_size")
    @classmethod
    def _size(cls, value: int | str) -> int | str:
        if parse_size(value) < 1024:
            raise ValueError("must be at least 1KB")
        return value

    @property
    def shard_bytes(self) -> int:
        return parse_size(self.shard_size)


class RoleWeights(_Strict):
    task: float = Field(ge=0)
    language: float = Field(ge=0)

    @model_validator(mode="after")
    def _positive(self) -> Self:
        if self.task + self.language <= 0:
            raise ValueError("task and language weights must not both be zero")
        return self


class Experts(_Strict):
    task: list[Source] = Field(min_length=1, max_length=MAX_EXPERTS_PER_ROLE)
    language: list[Source] = Field(min_length=1, max_length=MAX_EXPERTS_PER_ROLE)


class LayerSwapParams(_Strict):
    bottom: int = Field(5, ge=0, description="layers from the language expert at the bottom")
    top: int = Field(2, ge=0, description="layers from the language expert at the top")
    bottom_transition: int = Field(0, ge=0, description="averaged layers above the bottom")
    top_transition: int = Field(0, ge=0, description="averaged layers below the top")
    transition_weights: Literal["uniform", "magnitude"] | RoleWeights = "uniform"
    non_layer: Literal["average", "task", "language"] = "average"
    expert_soup: Literal["uniform", "magnitude"] = "uniform"


class LayerSwapRecipe(_Strict):
    method: Literal["layer_swap"]
    base: Source | None = None
    experts: Experts
    params: LayerSwapParams = LayerSwapParams()
    output: OutputOptions = OutputOptions()
    credential: Credential = None  # for hf:// sources

    @model_validator(mode="after")
    def _needs_base(self) -> Self:
        if self.base is None and self.params.transition_weights == "magnitude":
            raise ValueError("base is required when params.transition_weights is magnitude")
        if self.base is None and self.params.expert_soup == "magnitude":
            raise ValueError("base is required when params.expert_soup is magnitude")
        return self


def _check_weights(weights: Weights, count: int, *, positive: bool = False) -> None:
    if not isinstance(weights, list):
        return
    if len(weights) != count:
        raise ValueError(f"params.weights has {len(weights)} entries for {count} models")
    if positive and any(w <= 0 for w in weights):
        raise ValueError("params.weights must all be positive")
    if math.isclose(sum(weights), 0.0, abs_tol=1e-12):
        raise ValueError("params.weights must not sum to zero")


class SoupParams(_Strict):
    weights: Weights = "uniform"


class SoupRecipe(_Strict):
    method: Literal["soup"]
    base: Source | None = None
    models: list[Source] = Field(min_length=2, max_length=MAX_MODELS)
    params: SoupParams = SoupParams()
    output: OutputOptions = OutputOptions()
    credential: Credential = None  # for hf:// sources

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        _check_weights(self.params.weights, len(self.models))
        if self.base is None and self.params.weights == "magnitude":
            raise ValueError("base is required when params.weights is magnitude")
        return self


class TaskArithmeticParams(_Strict):
    model_config = ConfigDict(populate_by_name=True)
    weights: Literal["uniform"] | Annotated[list[float], Field(max_length=MAX_MODELS)] = Field(
        "uniform", description="uniform = 1.0 each"
    )
    lambda_: float = Field(1.0, alias="lambda", description="scale of the summed task vectors")
    normalize: bool = Field(
        False, description="divide the summed task vectors by Σ w (unless it is about 0)"
    )


class TaskArithmeticRecipe(_Strict):
    method: Literal["task_arithmetic"]
    base: Source
    models: list[Source] = Field(min_length=1, max_length=MAX_MODELS)
    params: TaskArithmeticParams = TaskArithmeticParams()
    output: OutputOptions = OutputOptions()
    credential: Credential = None  # for hf:// sources

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        _check_weights(self.params.weights, len(self.models))
        return self


class TiesParams(_Strict):
    model_config = ConfigDict(populate_by_name=True)
    weights: Literal["uniform"] | Annotated[list[float], Field(max_length=MAX_MODELS)] = Field(
        "uniform", description="uniform = 1.0 each"
    )
    density: float = Field(0.5, gt=0, le=1, description="fraction of each delta kept")
    lambda_: float = Field(1.0, alias="lambda", description="scale of the merged delta")
    normalize: bool = True


class TiesRecipe(_Strict):
    method: Literal["ties"]
    base: Source
    models: list[Source] = Field(min_length=1, max_length=MAX_MODELS)
    params: TiesParams = TiesParams()
    output: OutputOptions = OutputOptions()
    credential: Credential = None  # for hf:// sources

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        _check_weights(self.params.weights, len(self.models), positive=True)
        return self


class LinearParams(_Strict):
    weights: (
        Literal["uniform"] | Annotated[list[Setting], Field(min_length=2, max_length=MAX_MODELS)]
    ) = Field(
        "uniform",
        description="uniform = 1.0 each; or one per model: a number, a gradient across layers, "
        "or {filter, value}s",
    )
    normalize: bool = Field(True, description="divide by the sum of the weights")


class LinearRecipe(_Strict):
    """mergekit's `linear`: Σ w_i·T_i, divided by Σ w_i with `normalize`."""

    method: Literal["linear"]
    base: Source | None = Field(None, description="not used; accepted as by soup")
    models: list[Source] = Field(min_length=2, max_length=MAX_MODELS)
    params: LinearParams = LinearParams()
    output: OutputOptions = OutputOptions()
    credential: Credential = None  # for hf:// sources

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        weights = self.params.weights
        if isinstance(weights, list) and len(weights) != len(self.models):
            raise ValueError(
                f"params.weights has {len(self.params.weights)} entries for "
                f"{len(self.models)} models"
            )
        return self


class SlerpParams(_Strict):
    t: Setting = Field(
        0.5,
        description="0 = models[0], 1 = models[1]: a number, a gradient across layers "
        "([0, 0.5, 1]) or {filter, value}s (filter: self_attn, mlp, ...)",
    )


class SlerpRecipe(_Strict):
    """mergekit's `slerp`, with models[0] as its base_model."""

    method: Literal["slerp"]
    base: Source | None = Field(None, description="not used; accepted as by soup")
    models: list[Source] = Field(min_length=2, max_length=2)
    params: SlerpParams = SlerpParams()
    output: OutputOptions = OutputOptions()
    credential: Credential = None  # for hf:// sources


class LayerSource(_Strict):
    model: Source = Field(description="one of the recipe's models, written as there")
    layer_range: tuple[int, int] = Field(
        description="[start, end): its layers start..end-1, as mergekit's layer_range"
    )

    @field_validator("layer_range")
    @classmethod
    def _ordered(cls, value: tuple[int, int]) -> tuple[int, int]:
        if not 0 <= value[0] < value[1]:
            raise ValueError(f"must be [start, end) with 0 <= start < end (got {list(value)})")
        return value


class PassthroughSlice(_Strict):
    # mergekit's passthrough takes one source per slice; the list keeps its config's shape.
    sources: list[LayerSource] = Field(min_length=1, max_length=1)


class PassthroughParams(_Strict):
    slices: list[PassthroughSlice] = Field(
        min_length=1,
        max_length=MAX_SLICES,
        description="stacked in order: output layer k is the k-th layer the slices list",
    )


class PassthroughRecipe(_Strict):
    """mergekit's `passthrough` over `slices`: layers of the models stacked into a new depth."""

    method: Literal["passthrough"]
    base: None = Field(None, description="not used")
    models: list[Source] = Field(min_length=1, max_length=MAX_MODELS)
    params: PassthroughParams  # no default: which layers to stack is the recipe
    output: OutputOptions = OutputOptions()
    credential: Credential = None  # for hf:// sources

    @model_validator(mode="after")
    def _sources_are_models(self) -> Self:
        used = set()
        for i, piece in enumerate(self.params.slices):
            model = piece.sources[0].model
            if model not in self.models:
                raise ValueError(f"params.slices.{i}.sources.0.model {model!r} is not in models")
            used.add(model)
        for i, model in enumerate(self.models):
            if model not in used:  # opened and checked for nothing
                raise ValueError(f"models.{i} {model!r} is not used by any of params.slices")
        return self


Recipe = Annotated[
    LayerSwapRecipe
    | SoupRecipe
    | TaskArithmeticRecipe
    | TiesRecipe
    | LinearRecipe
    | SlerpRecipe
    | PassthroughRecipe,
    Field(discriminator="method"),
]
_ADAPTER: TypeAdapter[Recipe] = TypeAdapter(Recipe)
METHODS = ("layer_swap", "soup", "task_arithmetic", "ties", "linear", "slerp", "passthrough")


def parse_recipe(data: Any) -> Recipe:
    """Validate a recipe mapping; raise RecipeError naming the first offending field."""
    if not isinstance(data, dict):
        raise RecipeError.for_field("recipe", "must be a mapping")
    if data.get("method") not in METHODS:
        raise RecipeError.for_field(
            "method", f"must be one of {', '.join(METHODS)} (got {data.get('method')!r})"
        )
    try:
        return _ADAPTER.validate_python(data)
    except ValidationError as e:
        raise _recipe_error(e) from None


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
    # ("should be 'uniform'") is the least helpful when the value was a mapping or list.
    literal = {
        i
        for i, item in enumerate(errors)
        if item["type"] == "literal_error" and not isinstance(item.get("input"), str)
    }
    first = min(range(len(problems)), key=lambda i: (i in literal and len(problems) > 1, i))
    where = _mentioned_field(problems[first]["message"]) or problems[first]["field"]
    return RecipeError(
        f"{where}: {problems[first]['message']}", details={"field": where, "problems": problems}
    )


def _is_union_tag(part: str | int) -> bool:
    """Pydantic names union members in error locations (`literal['a']`, `RoleWeights`)."""
    return isinstance(part, str) and (
        any(c in part for c in "[(-") or part[:1].isupper() or part in {"int", "str", "float"}
    )


def _mentioned_field(message: str) -> str | None:
    """Model-level checks name their field in the message ('base is required ...')."""
    match = re.match(r"^(base|params\.[\w.]*\w|models(?:\.\d+)?|experts\.\w+)\b", message)
    return match.group(1) if match else None


@dataclass(frozen=True)
class NamedSource:
    """One checkpoint a recipe names, in plan order."""

    field: str  # where in the recipe: experts.task.0, models.1, base
    label: str  # task[0], language[1], models[2], base
    role: str  # task, language, model, base
    source: str  # as written: a path or hf://org/name[@revision]


def named_sources(recipe: Recipe) -> list[NamedSource]:
    if isinstance(recipe, LayerSwapRecipe):
        named = [NamedSource(f"experts.{role}.{i}", f"{role}[{i}]", role, s)
                 for role, items in (("task", recipe.experts.task),
                                     ("language", recipe.experts.language))
                 for i, s in enumerate(items)]  # fmt: skip
    else:
        named = [NamedSource(f"models.{i}", f"models[{i}]", "model", s)
                 for i, s in enumerate(recipe.models)]  # fmt: skip
    if recipe.base is not None:
        named.append(NamedSource("base", "base", "base", recipe.base))
    return named


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    return recipe.model_dump(mode="json", by_alias=True)
