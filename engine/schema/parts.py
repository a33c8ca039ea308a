"""What every recipe shares: sources, output options, and the base class of each method's recipe.

Each method's own recipe (its parameters and checks) lives beside its plan in engine/methods/;
engine/recipe.py gathers them into the one schema the CLI and the API validate. Importable
without torch: the API process validates recipes too.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.schema.params import ONE_PER_MODEL
from engine.schema.settings import Setting

__all__ = ["Setting"]

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
# tokenizer_source's keywords; any other value names one of the recipe's sources.
TOKENIZER_BASE, TOKENIZER_UNION, TOKENIZER_MODEL_PREFIX = "base", "union", "model:"
# Each source is opened (and, at submit, its headers read): bounded like every other input.
MAX_EXPERTS_PER_ROLE = 32
MAX_MODELS = 64
MAX_CONFIGURED_TOKENS = 4096  # `tokens` entries
MAX_PAD_MULTIPLE = 65536  # pad_to_multiple_of (mergekit configs use 8 to 256)
MAX_SLICES = 256  # each is a run of layers; MAX_LAYERS bounds their total at plan time
# The dtype a merge computes in (mergekit's `dtype`): the inputs are rounded to it and each step
# rounded in it as mergekit rounds it. float32: float32 (float64 where an input is F64), rounded
# once to the output dtype; source: each tensor's inputs' own dtype (promoted where they
# differ), as mergekit computes without a `dtype`.
Arithmetic = Literal["float32", "float64", "bfloat16", "float16", "source"]
Weights = (
    Literal["uniform", "magnitude"]
    | Annotated[list[float], Field(max_length=MAX_MODELS), ONE_PER_MODEL]
)


class Strict(BaseModel):
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


class HubDestination(Strict):
    repo: str = Field(pattern=HUB_REPO_PATTERN, description="org/name; created if missing")
    private: bool = True
    branch: str = Field("main", pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,99}$")
    credential: Credential = None


class MlflowDestination(Strict):
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


class OutputOptions(Strict):
    name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$",
        description="service only: the output artifact's name (default: from the job id)",
    )
    dtype: Literal["source", "bfloat16", "float16", "float32", "float64"] = "source"
    # 2 GB by default: the shards are hashed side by side (a sha256 is serial, ~2 GB/s a core),
    # here and when the Hub client uploads them, where one 5 GB file would take one core.
    shard_size: int | str = Field("2GB", description="largest shard, e.g. 2GB, 500MB, 1GiB")
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


def check_weights(weights: Weights, count: int, *, positive: bool = False) -> None:
    if not isinstance(weights, list):
        return
    if len(weights) != count:
        raise ValueError(f"params.weights has {len(weights)} entries for {count} models")
    if positive and any(w <= 0 for w in weights):
        raise ValueError("params.weights must all be positive")
    if math.isclose(sum(weights), 0.0, abs_tol=1e-12):
        raise ValueError("params.weights must not sum to zero")


def check_base_apart(recipe: ModelsRecipe) -> None:
    """A base listed among the models too would be merged as a model whose task vector is
    zero; mergekit takes it as the base alone. Refused rather than guessed."""
    if recipe.base is not None and recipe.base in recipe.models:
        i = recipe.models.index(recipe.base)
        raise ValueError(f"models.{i}: is the base; list the base only as base")


def check_at_a_time(recipe: ModelsRecipe, count: int, method: str) -> None:
    """A method that merges `count` models at a time (slerp's and nuslerp's two, besides any
    base): the recipe names `count`, or with slices any number, each slice `count` of them."""
    if not recipe.slices and len(recipe.models) != count:
        raise ValueError(f"models lists {len(recipe.models)}: {method} merges {count} models "
                         "(with slices, each slice merges its own)")  # fmt: skip
    for s, piece in enumerate(recipe.slices or []):
        named = [x for x in piece.sources if x.model != recipe.base]
        if len(named) != count:
            raise ValueError(f"slices.{s}.sources names {len(named)} models besides any base: "
                             f"{method} merges {count}")  # fmt: skip


@dataclass(frozen=True)
class NamedSource:
    """One checkpoint a recipe names, in plan order."""

    field: str  # where in the recipe: experts.task.0, models.1, base
    label: str  # task[0], language[1], models[2], base
    role: str  # task, language, model, base
    source: str  # as written: a path or hf://org/name[@revision]


class ZeroRow(Strict):
    """A `tokens` entry's row of zeros."""

    kind: Literal["zero"]


class TokenRow(Strict):
    """A `tokens` entry's row: one source's row of a token (or id) in its own vocabulary."""

    kind: Literal["model_token"]
    model: Source = Field(description="one of the recipe's sources, written as there")
    token: str | None = Field(None, min_length=1, max_length=1024)
    token_id: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _one_token(self) -> Self:
        if (self.token is None) == (self.token_id is None):
            raise ValueError("give token or token_id (one of them)")
        return self


class TokenFill(Strict):
    """Where an input that lacks a token (every input, with force) reads the token's rows."""

    source: Source | ZeroRow | TokenRow = Field(
        description="one of the recipe's sources (its row of this token), {kind: zero}, or "
        "{kind: model_token, model: <source>, token: <token> | token_id: <id>}"
    )
    force: bool = Field(
        False, description="every input reads the row from `source`, even one that has the token"
    )


class RecipeBase(Strict):
    """Fields every recipe has; `method` names the subclass (engine.methods.METHODS)."""

    method: str
    base: Source | None = None
    output: OutputOptions = OutputOptions()
    credential: Credential = None  # for hf:// sources
    arithmetic: Arithmetic = Field(
        "float32",
        description="the dtype the merge computes in: float32 (float64 for F64 inputs), "
        "rounded once to the output dtype; bfloat16, float16 or float64 round the inputs to it "
        "and every step in it as mergekit does with that `dtype`; source: the inputs' own dtype "
        "(mergekit without a `dtype`). A translated mergekit config takes its `dtype`",
    )
    tokenizer_source: str | None = Field(
        None,
        min_length=1,
        max_length=2048,
        description="the output's vocabulary when the inputs' differ (as mergekit's): base, "
        "union, or one of the recipe's sources as written (also model:<source>); absent: the "
        "inputs' vocabularies must match",
    )

    tokens: dict[Annotated[str, Field(min_length=1, max_length=1024)], TokenFill] | None = Field(
        None,
        max_length=MAX_CONFIGURED_TOKENS,
        description="with tokenizer_source: tokens the output's vocabulary gets (added where "
        "absent) and where their embedding and head rows come from (as mergekit's "
        "tokenizer.tokens)",
    )
    pad_to_multiple_of: int | None = Field(
        None,
        ge=1,
        le=MAX_PAD_MULTIPLE,
        description="with tokenizer_source: embedding and head rows padded to a multiple of "
        "this, each input's padding rows the mean of its aligned rows (as mergekit's "
        "tokenizer.pad_to_multiple_of)",
    )

    @model_validator(mode="after")
    def _tokenizer_source_is_known(self) -> Self:
        source = self.tokenizer_source
        if source is None and (self.tokens or self.pad_to_multiple_of is not None):
            raise ValueError(
                "tokenizer_source is required by tokens and pad_to_multiple_of (they shape the "
                "output's vocabulary: base, union or one of the recipe's sources)"
            )
        if source is None or source in (TOKENIZER_BASE, TOKENIZER_UNION):
            return self
        written = [n.source for n in self.sources()]
        if source.removeprefix(TOKENIZER_MODEL_PREFIX) not in written:
            raise ValueError(
                f"tokenizer_source {source[:200]!r} is not base, union or one of the recipe's "
                f"sources ({', '.join(map(repr, written))})"
            )
        return self

    def sources(self) -> list[NamedSource]:
        """The checkpoints the recipe names, in plan order (the base last)."""
        return self._with_base([])

    def _with_base(self, named: list[NamedSource]) -> list[NamedSource]:
        if self.base is not None:
            named.append(NamedSource("base", "base", "base", self.base))
        return named

    @property
    def plans_from_weights(self) -> bool:
        """Whether planning reads tensor data (magnitude weights), not only headers."""
        return False


class LayerSource(Strict):
    model: Source = Field(description="one of the recipe's sources, written as there")
    layer_range: tuple[int, int] = Field(
        description="[start, end): its layers start..end-1, as mergekit's layer_range"
    )

    @field_validator("layer_range")
    @classmethod
    def _ordered(cls, value: tuple[int, int]) -> tuple[int, int]:
        if not 0 <= value[0] < value[1]:
            raise ValueError(f"must be [start, end) with 0 <= start < end (got {list(value)})")
        return value


class LayerSlice(Strict):
    """Output layers merged, index by index, from a run of layers of each source."""

    sources: list[LayerSource] = Field(min_length=1, max_length=MAX_MODELS + 1)
    params: dict[str, Any] | None = Field(
        None,
        description="the method's params for this slice's layers, in place of the recipe's "
        "(as a mergekit slice's parameters): the tensors before the layers (embeddings) take "
        "the first slice's, those after them (final norm, head) the last slice's; absent: "
        "the recipe's",
    )

    @property
    def layer_count(self) -> int:
        """The output layers it makes (its sources span as many each: checked by the recipe)."""
        start, end = self.sources[0].layer_range
        return end - start


class ModelsRecipe(RecipeBase):
    """A recipe over a list of models (every method but layer_swap)."""

    models: list[Source] = Field(min_length=1, max_length=MAX_MODELS)
    slices: list[LayerSlice] | None = Field(
        None,
        min_length=1,
        max_length=MAX_SLICES,
        description="the output's layers, stacked in order (mergekit's slices): each slice's "
        "k-th layer merges layer start+k of each of its sources (the base and some or all of "
        "the models, each once, its ranges as long as the others; a slice with its own params "
        "or some of the models merges them in the order it lists them); absent: every layer "
        "of the models, each from the same layer of every one",
    )

    @model_validator(mode="after")
    def _slices_name_every_source(self) -> Self:
        written = [n.source for n in self.sources()]
        used: set[str] = set()
        for s, piece in enumerate(self.slices or []):
            named = [source.model for source in piece.sources]
            if len(set(named)) != len(named) or not set(named) <= set(written):
                raise ValueError(
                    f"slices.{s}.sources names {', '.join(map(repr, named))}: each slice takes "
                    f"a range of the recipe's sources, each once ({', '.join(map(repr, written))})"
                )
            if self.base is not None and self.base not in named:
                raise ValueError(f"slices.{s}.sources lacks the base {self.base!r}: each slice "
                                 "merges over it")  # fmt: skip
            used.update(named)
            spans = [end - start for start, end in (x.layer_range for x in piece.sources)]
            for i, span in enumerate(spans):
                if span != spans[0]:
                    raise ValueError(
                        f"slices.{s}.sources.{i}.layer_range spans {span} layers, the slice's "
                        f"first source {spans[0]}: a slice's sources take as many layers each"
                    )
        if self.slices and (unused := [m for m in written if m not in used]):
            raise ValueError(f"models.{written.index(unused[0])} {unused[0]!r} is in no slice")
        return self

    def sources(self) -> list[NamedSource]:
        named = [NamedSource(f"models.{i}", f"models[{i}]", "model", s)
                 for i, s in enumerate(self.models)]  # fmt: skip
        return self._with_base(named)
