"""What a sweep asks for: expert pairs, layer-swap configurations (a list, a grid or a preset),
baselines on the same pairs, the evaluation, the objective, the search and what to keep.

Every list and string has a limit (a 422 naming the field and the limit past it), so a request's
size bounds the work of checking it; what a grid expands to is counted from its lists' lengths
before any configuration is built (service/sweeps/expand.py)."""

from __future__ import annotations

import itertools
import math
import re
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from core.evaluation.spec import EvaluationSpec
from engine.methods import METHODS
from engine.methods.layer_swap import LayerSwapParams
from engine.recipe import (
    HUB_REPO_PATTERN,
    Credential,
    HubDestination,
    Source,
)

MAX_EXPERTS = 16
MAX_BUDGET = 1000  # jobs one sweep may create (merges + evaluations)
MAX_SPACE = 10_000  # configurations a random or optuna search chooses among
MAX_LAYER_COUNT = 1024  # a grid value: more layers than any model has
MAX_SOURCE_LENGTH = 4096  # as POST /v1/evaluations' source
MAX_NAME_LENGTH = 100  # task, metric and filter names

SweepSource = Annotated[Source, Field(max_length=MAX_SOURCE_LENGTH)]
LayerCount = Annotated[int, Field(le=MAX_LAYER_COUNT)]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_LENGTH)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Pair(_Strict):
    task: SweepSource
    language: SweepSource


class Grid(_Strict):
    """Each layer-swap parameter's values; the configurations are their product, less those
    that do not fit the model. Up to 64 × 64 × 16 × 16 × 2 × 3 values may be listed; what fits
    must stay within the sweep's budget (grid search) or 10,000 configurations (random and
    optuna search), counted before any is built."""

    bottom: list[LayerCount] = Field(min_length=1, max_length=64)
    top: list[LayerCount] = Field(min_length=1, max_length=64)
    bottom_transition: list[LayerCount] = Field([0], min_length=1, max_length=16)
    top_transition: list[LayerCount] = Field([0], min_length=1, max_length=16)
    transition_weights: list[Literal["uniform", "magnitude"]] = Field(
        ["uniform"], min_length=1, max_length=2
    )
    non_layer: list[Literal["average", "task", "language"]] = Field(
        ["average"], min_length=1, max_length=3
    )

    @model_validator(mode="after")
    def _non_negative(self) -> Self:
        for name in ("bottom", "top", "bottom_transition", "top_transition"):
            values = getattr(self, name)
            if any(v < 0 for v in values):
                raise ValueError(f"{name}: layer counts are >= 0")
            if len(set(values)) != len(values):
                raise ValueError(f"{name}: a value is listed twice")
        return self


class PublishBest(HubDestination):
    """Where the best configuration's model of each pair is published. `repo` may name the
    pair's experts as `{task}` and `{language}` (their repository or directory names); with
    several pairs it must, so that each pair gets its own repository."""

    repo: str = Field(
        pattern=r"^[A-Za-z0-9{][A-Za-z0-9._{}-]{0,95}/[A-Za-z0-9{][A-Za-z0-9._{}-]{0,95}$",
        description="org/name, e.g. acme/llama-{task}-{language}-swap; created if missing",
    )


def short_name(source: str) -> str:
    """A source's last name without revision: hf://org/math-7b@abc -> math-7b."""
    name = source.split("@", 1)[0] if source.startswith("hf://") else source
    name = name.rstrip("/").rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"


def baseline_methods() -> tuple[str, ...]:
    """The registered methods a sweep may run as a baseline: those that run on a pair."""
    return tuple(name for name, m in METHODS.items() if m.pair_baseline)


def _list_baseline_methods(schema: dict[str, Any]) -> None:
    """The schema's description names the baselines registered when it is made."""
    schema["description"] = f"{BASELINE_HELP}: {', '.join(baseline_methods())}"


BASELINE_HELP = "experts, or a method that runs on a pair with params alone"


MAX_BASELINE_POINTS = 64  # merges one baseline's space expands to, per pair


class Baseline(_Strict):
    """Another method on the same pairs (`models` = [task, language]), or the experts alone.
    `space` lists values for some of the method's params: the baseline runs once per point of
    their product, each point on top of `params` (e.g. TIES at three densities)."""

    method: str = Field(description=BASELINE_HELP, json_schema_extra=_list_baseline_methods)
    params: dict[str, Any] = Field(default_factory=dict, max_length=16)
    space: dict[str, Annotated[list[Any], Field(min_length=1, max_length=16)]] = Field(
        default_factory=dict,
        max_length=4,
        description="param -> values to try; the baseline runs at each point of their product "
        f"(at most {MAX_BASELINE_POINTS})",
    )

    @model_validator(mode="after")
    def _space(self) -> Self:
        if self.method == "experts" and (self.params or self.space):
            raise ValueError("space: the experts baseline takes no params")
        if both := sorted(set(self.params) & set(self.space)):
            raise ValueError(f"space.{both[0]}: also given in params")
        if math.prod(len(v) for v in self.space.values()) > MAX_BASELINE_POINTS:
            raise ValueError(f"space: more than {MAX_BASELINE_POINTS} points")
        return self

    def points(self) -> list[dict[str, Any]]:
        """The params of each merge the baseline makes, in the order of the space's lists."""
        names = list(self.space)
        return [
            {**self.params, **dict(zip(names, values, strict=True))}
            for values in itertools.product(*self.space.values())
        ]

    @field_validator("method")
    @classmethod
    def _known(cls, value: str) -> str:
        if value != "experts" and value not in baseline_methods():
            raise ValueError(f"must be experts or one of {', '.join(baseline_methods())}")
        return value


class Objective(_Strict):
    """The score a sweep ranks by: one task, metric and filter of the evaluation."""

    task: Name
    metric: Name = "exact_match"
    filter: Name | None = Field(
        None,
        description="default: the task's first of flexible-extract, strict-match, "
        "remove_whitespace, none",
    )


class Search(_Strict):
    strategy: Literal["grid", "random", "optuna"] = "grid"
    trials: int | None = Field(
        None,
        ge=1,
        le=MAX_BUDGET,
        description="random / optuna: configurations to try, among at most 10,000 that fit",
    )
    seed: int = Field(0, ge=0, le=2**31 - 1)
    parallel: int = Field(
        2, ge=1, le=64, description="optuna: configurations in flight at once (asked together)"
    )

    @model_validator(mode="after")
    def _trials(self) -> Self:
        if self.strategy != "grid" and self.trials is None:
            raise ValueError(f"trials: required by the {self.strategy} strategy")
        return self


class SweepCreate(_Strict):
    task_experts: list[SweepSource] = Field(min_length=1, max_length=MAX_EXPERTS)
    language_experts: list[SweepSource] = Field(min_length=1, max_length=MAX_EXPERTS)
    pairs: list[Pair] | None = Field(
        None, min_length=1, max_length=MAX_EXPERTS * MAX_EXPERTS,
        description="explicit pairs (default: every task expert with every language expert)",
    )  # fmt: skip
    base: SweepSource | None = None
    configurations: list[LayerSwapParams] | None = Field(None, min_length=1, max_length=256)
    grid: Grid | None = None
    preset: Literal["paper-default", "swap-ablation"] | None = None
    baselines: list[Baseline] = Field(default_factory=list, max_length=8)
    evaluation: EvaluationSpec
    objective: Objective
    search: Search = Search()
    keep: Literal["best", "all", "none"] = "best"
    in_memory: bool = Field(
        True,
        description="evaluate layer-swap configurations assembled in memory, writing none "
        "(with keep: best, the best configuration is written at the end); keep: all and the "
        "vllm backend write every configuration",
    )
    publish_best: PublishBest | None = Field(
        None, description="publish the best configuration's model of each pair to the Hub"
    )
    budget: int = Field(200, ge=1, le=MAX_BUDGET, description="most jobs the sweep may create")
    credential: Credential = None

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        given = [n for n in ("configurations", "grid", "preset") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of configurations, grid or preset")
        if self.objective.task not in self.evaluation.tasks:
            raise ValueError(f"objective.task: {self.objective.task!r} is not evaluated")
        if self.pairs is not None:
            for i, pair in enumerate(self.pairs):
                if pair.task not in self.task_experts:
                    raise ValueError(f"pairs.{i}.task: not one of task_experts")
                if pair.language not in self.language_experts:
                    raise ValueError(f"pairs.{i}.language: not one of language_experts")
        if self.search.strategy == "optuna" and self.configurations is not None:
            raise ValueError("search: optuna searches a grid or preset, not a fixed list")
        for name in ("task_experts", "language_experts"):
            values = getattr(self, name)
            if len(set(values)) != len(values):
                raise ValueError(f"{name}: an expert is listed twice")
        if self.publish_best is not None:
            repos = [self.publish_repo(pair) for pair in self.expert_pairs()]
            for repo in repos:
                if not re.match(HUB_REPO_PATTERN, repo):
                    raise ValueError(f"publish_best.repo: {repo!r} is not a Hub repository name")
            if len(set(repos)) != len(repos):
                raise ValueError(
                    "publish_best.repo: pairs would share a repository; name the experts in "
                    "it with {task} and/or {language}"
                )
        return self

    def publish_repo(self, pair: Pair) -> str:
        assert self.publish_best is not None
        try:
            return self.publish_best.repo.format(
                task=short_name(pair.task), language=short_name(pair.language)
            )
        except (KeyError, IndexError, ValueError):
            raise ValueError(
                "publish_best.repo: only {task} and {language} may be named in braces"
            ) from None

    @property
    def evaluates_in_memory(self) -> bool:
        return self.in_memory and self.keep != "all" and self.evaluation.backend == "hf"

    def expert_pairs(self) -> list[Pair]:
        if self.pairs is not None:
            return list(self.pairs)
        return [Pair(task=t, language=lang) for t in self.task_experts
                for lang in self.language_experts]  # fmt: skip
