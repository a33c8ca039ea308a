"""What every method builder receives and returns."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.errors import RecipeError
from engine.io.checkpoint import Checkpoint
from engine.plan.model import InputRef, Op, SparsifySettings, Term, Thinning, TiesSettings
from engine.progress import CancelCheck
from engine.schema.params import Param, describe
from engine.schema.parts import RecipeBase, Strict
from engine.schema.settings import (
    Condition,
    Depth,
    Setting,
    Switch,
    SwitchCondition,
    position,
    resolve,
)
from engine.translation.translators import Translation

# (tensor name, layer index or None) -> (op, terms, provenance label)
Rule = Callable[[str, int | None], tuple[Op, tuple[Term, ...], str]]
# (tensor name, layer index or None) -> a `sparsify` tensor's amounts
ThinningRule = Callable[[str, int | None], Thinning]
# (tensor name, layer index or None) -> the op's own numbers for it (TensorPlan.scalars)
ScalarsRule = Callable[[str, int | None], tuple[tuple[str, float], ...]]


@dataclass
class Inputs:
    """The recipe's checkpoints, opened, in plan order."""

    refs: list[InputRef]
    checkpoints: list[Checkpoint]
    chunk_elements: int
    should_cancel: CancelCheck | None = None  # asked while magnitudes are computed
    headers_only: bool = False  # magnitudes are not computed (all equal): a validation plan
    slices: tuple[int, ...] = ()  # the recipe's slices' layer counts (plan/slices.py); ()
    # where the recipe has none

    def indices(self, role: str) -> list[int]:
        return [i for i, ref in enumerate(self.refs) if ref.role == role]

    @property
    def base(self) -> int | None:
        found = self.indices("base")
        return found[0] if found else None

    def own_names(self, indices: Sequence[int], name: str) -> list[str]:
        """Each input's own name of output tensor `name`: a slice's view numbers its layers
        as the output does, and a per-model setting's filters match the model's own names,
        as mergekit's do."""
        found = [self.checkpoints[i].tensors.get(name) for i in indices]
        return [name if info is None else info.name for info in found]

    def magnitudes(self, indices: Sequence[int], field: str) -> list[float]:
        """Each expert's mean row MAV against the base (DESIGN §3.3); needs the base."""
        from engine.analysis.deltas import expert_magnitude  # imports torch: only magnitude weights

        if self.base is None:
            raise RecipeError.for_field("base", f"required for magnitude weights ({field})")
        base_tensors = self.checkpoints[self.base].tensors
        for i in indices:  # only aligned vocabularies differ in shape (compatibility.py)
            other = self.checkpoints[i].tensors
            if resized := [n for n, t in base_tensors.items() if other[n].shape != t.shape]:
                raise RecipeError.for_field(
                    field,
                    f"magnitude weights compare {self.refs[i].label} with the base tensor by "
                    f"tensor, and its {resized[0]} has other rows (another vocabulary); give "
                    "explicit weights",
                )
        if self.headers_only:
            return [1.0] * len(indices)
        base = self.checkpoints[self.base]
        values = []
        for i in indices:
            m = expert_magnitude(base, self.checkpoints[i], self.chunk_elements, self.should_cancel)
            if m <= 0.0:
                raise RecipeError.for_field(
                    field, f"magnitude weights undefined: {self.refs[i].label} equals the base"
                )
            values.append(m)
        return values


@dataclass(frozen=True)
class Placement:
    """One output tensor copied from one input's tensor of (maybe) another name, maybe scaled."""

    name: str
    source: int
    input_name: str
    layer: int | None  # in the output
    origin: str
    scale: float = 1.0  # the output is input × scale (passthrough's `scale`)


@dataclass
class MethodPlan:
    rule: Rule
    config_input: int
    tokenizer_input: int
    ties: TiesSettings | None = None
    sparsify: SparsifySettings | None = None
    thinning: ThinningRule | None = None  # asked for each `sparsify` (or `ties`) tensor
    scalars: ScalarsRule | None = None  # asked for each tensor the rule makes, if given
    resolved_weights: dict[str, Any] = field(default_factory=dict)
    # A method that changes the model's shape lists every output tensor itself, in order,
    # instead of a rule over config_input's tensors; and the output's layer count.
    placements: tuple[Placement, ...] | None = None
    num_layers: int | None = None


def normalized(weights: Sequence[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


def inverse_normalized(magnitudes: Sequence[float]) -> list[float]:
    """Weights proportional to 1/magnitude, summing to 1 (paper §5.1)."""
    return normalized([1.0 / m for m in magnitudes])


def terms(indices: Sequence[int], coefficients: Sequence[float], scale: float = 1.0) -> list[Term]:
    return [Term(i, scale * c) for i, c in zip(indices, coefficients, strict=True)]


def layer_count(inputs: Inputs, method: str, settings: Sequence[Setting | Switch]) -> Depth:
    """The layers a gradient spreads over: each slice's, or the whole stack's; a checkpoint
    without a known stack is refused only when some setting is a gradient (a scalar or
    filters need no layers)."""
    if not any(_has_gradient(s) for s in settings):
        return Depth((1,))
    if inputs.slices:  # mergekit spreads a gradient over each slice anew
        return Depth(inputs.slices)
    return Depth((inputs.checkpoints[0].require_layers(method).count,))


def setting_scalars(inputs: Inputs, method: str, settings: dict[str, Setting]) -> ScalarsRule:
    """A tensor's scalars: each param's setting resolved for the tensor's name and layer."""
    num_layers = layer_count(inputs, method, list(settings.values()))

    def scalars(name: str, layer: int | None) -> tuple[tuple[str, float], ...]:
        found = []
        for key, setting in settings.items():
            value = resolve(setting, name=name, at=position(layer, num_layers))
            if value is None:
                raise RecipeError.for_field(f"params.{key}", f"no filter matches {name}")
            found.append((key, value))
        return tuple(found)

    return scalars


def described(settings: dict[str, Setting]) -> dict[str, Any]:
    """The settings as a plan's resolved_weights record them: a number, or "varies"."""
    return {key: s if isinstance(s, float) else "varies" for key, s in settings.items()}


def _has_gradient(setting: Setting | Switch) -> bool:
    if isinstance(setting, float | int):  # a bool too
        return False
    conditions = (Condition, SwitchCondition)
    values = [c.value if isinstance(c, conditions) else c for c in setting]
    return any(isinstance(v, list) for v in values) or not any(
        isinstance(c, conditions) for c in setting
    )


@dataclass(frozen=True)
class Method:
    """Everything the product knows of one merge method, declared once in its module. What is
    derived from it (the recipe schema, the API's request schema, GET /v1/methods, the docs'
    table, the model card, sweep baselines, the mergekit front end) reads engine.methods.METHODS
    when it is built or asked, so registering a method is all it takes."""

    name: str  # the recipe's `method`
    recipe: type[RecipeBase]  # its schema, with `method: Literal[name]`
    params: type[Strict]  # its `params`, described per param by GET /v1/methods and the docs
    plan: Callable[[Any, Inputs], MethodPlan]  # (recipe, inputs) -> per-tensor rule
    summary: str  # one line for GET /v1/methods and the CLI
    formula: str  # the result per tensor, for GET /v1/methods and the docs' table
    title: str  # the model card's "made with Layerswap by <title>"
    tags: tuple[str, ...]  # the model card's Hub tags
    base: Literal["required", "optional", "unused"]
    inputs: Literal["models", "experts"] = "models"
    # kept: the output has the inputs' layers, each tensor merged from theirs; restacked: its
    # layers are the inputs' layers stacked anew (mergekit's slices), copied.
    layer_stack: Literal["kept", "restacked"] = "kept"
    # Runs on a sweep's (task, language) pair as `models` with params alone (a sweep baseline).
    pair_baseline: bool = True
    # mergekit runs it with models[0] as its base_model: the base of vocabulary alignment's
    # rule (engine/vocabulary/alignment.py), whatever the recipe's `base`.
    first_model_is_base: bool = False
    # Merges this many models at a time (slerp, nuslerp: 2, besides any base): a recipe names
    # as many, or with slices any number, each slice as many (its schema checks it).
    at_a_time: int | None = None
    mergekit: Translation | None = None  # the mergekit methods it translates

    def parameters(self) -> tuple[Param, ...]:
        """Each of its params: type, default, bounds, per model, varying by layer."""
        return describe(self.params)
