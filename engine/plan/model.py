"""The plan: for every output tensor, how it is made. Computed from headers, before any write.

A plan is plain data: it can be printed (`--dry-run`), stored with a job, and digested for
lineage. The opened checkpoints travel beside it (`Plan.checkpoints`) but are not part of it.
"""

from __future__ import annotations

import hashlib
import json
import math
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from engine.architectures import LayerStack, Refusal
from engine.io.checkpoint import Checkpoint
from engine.io.file_access import Opener, open_file
from engine.io.safetensors_format import DTYPE_SIZES

# weighted_sum / weighted_mean: mergekit's linear (fused multiply-adds, then ÷ Σ coefficients
# for the mean); slerp: terms (models[0], 1 − t), (models[1], t), its angle found per tensor;
# sparsify: DARE, breadcrumbs, DELLA (Plan.sparsify, TensorPlan.thinning);
# task_arithmetic: base + λ·Σ c_i·(T_i − base) in that order (plan.ties holds base, λ, normalize);
# nuslerp (+ base when a third term), model_stock (models, then base): angles between the whole
# tensors, or per row (along the last dim), or per column (along the first): angle_torch.py;
# multislerp (models, then the base if any) and karcher (every input): spherical means of the
# whole tensors (sphere_torch.py); nearswap, arcee_fusion (base, then the model) and sce
# (models, then base): nearswap_torch.py, fusion_torch.py, sce_torch.py; ram and ramplus_tl
# (models, then base): ram_torch.py. TensorPlan.scalars holds what these take besides their
# terms.
Op = Literal[
    "copy",
    "linear",
    "ties",
    "weighted_sum",
    "weighted_mean",
    "slerp",
    "task_arithmetic",
    "sparsify",
    "nuslerp",
    "nuslerp_rows",
    "nuslerp_columns",
    "model_stock",
    "model_stock_rows",
    "multislerp",
    "karcher",
    "nearswap",
    "sce",
    "arcee_fusion",
    "ram",
    "ramplus_tl",
]
ANGLE_OPS = frozenset(
    {"nuslerp", "nuslerp_rows", "nuslerp_columns", "model_stock", "model_stock_rows"}
)


@dataclass(frozen=True)
class Term:
    """One input tensor with its coefficient: output += coefficient * input[source]."""

    source: int
    coefficient: float


@dataclass(frozen=True)
class Thinning:
    """One `sparsify` tensor's amounts, per term (the terms' coefficients are their weights)."""

    densities: tuple[float, ...]  # the fraction of each delta kept (1: all of it)
    lambda_: float  # scale of the merged delta
    gammas: tuple[float, ...] = ()  # breadcrumbs: the share of the largest |δ| dropped
    epsilons: tuple[float, ...] = ()  # DELLA: keep probabilities span density ± epsilon


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]
    dtype: str  # output safetensors dtype
    op: Op
    terms: tuple[Term, ...]
    layer: int | None
    origin: str  # provenance label: language, task, transition, average, soup, ...
    # The inputs' name for it, when the output renames it (passthrough renumbers layers).
    input_name: str = ""
    thinning: Thinning | None = None  # op sparsify; ties/task_arithmetic whose amounts vary
    # The op's own numbers besides its terms' coefficients, by name (multislerp's eps,
    # karcher's tol, nearswap's t, sce's select_topk, ...), resolved for this tensor.
    scalars: tuple[tuple[str, float], ...] = ()

    @property
    def read_name(self) -> str:
        return self.input_name or self.name

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class InputRef:
    label: str  # base, task[0], language[1], models[2]
    role: str  # base, task, language, model
    source: str  # as written in the recipe
    path: str  # resolved local directory


@dataclass(frozen=True)
class TiesSettings:
    base: int
    density: float  # every model's on every tensor; 1.0 where each tensor's thinning says
    lambda_: float  # 1.0 where each tensor's thinning says
    normalize: bool

    def kept(self, numel: int, density: float | None = None) -> int:
        """How many entries of a delta of `numel` TIES keeps at `density` (default: the shared
        one): ⌊density·numel⌋ of the float product, at least one (mergekit's rule, and the TIES
        paper's); every one at density 1."""
        density = self.density if density is None else density
        return numel if density >= 1.0 else max(1, int(density * numel))

    def scale(self, tensor: TensorPlan) -> float:
        """λ on `tensor`: its thinning's where λ varies by layer or tensor, else the shared one."""
        return self.lambda_ if tensor.thinning is None else tensor.thinning.lambda_

    def densities(self, tensor: TensorPlan) -> tuple[float, ...]:
        """Each term's density on `tensor`: its thinning's where it varies by model, layer or
        tensor, else the shared one."""
        if tensor.thinning is not None:
            return tensor.thinning.densities
        return (self.density,) * len(tensor.terms)


Dropping = Literal["random", "outliers", "magprune", "magnitude"]


@dataclass(frozen=True)
class SparsifySettings:
    """How a sparsifying task-vector method thins each delta δᵢ = Tᵢ − base and merges them
    (engine/methods/sparsify.py); the amounts are per tensor (TensorPlan.thinning)."""

    base: int
    # DARE's random drop, breadcrumbs' outliers and small ones, DELLA's; magnitude: TIES's
    # (all but the k largest |δ|), when it rescales
    dropping: Dropping
    consensus: bool  # keep only the deltas that agree with the elected sign (TIES)
    normalize: bool
    rescale: bool  # scale each thinned delta back to its original L1 norm
    seed: int | None  # of the random drops (random, magprune)


@dataclass(frozen=True)
class Shard:
    filename: str
    tensors: tuple[int, ...]  # indices into Plan.tensors, in file order (save_file's)


@dataclass(frozen=True)
class LayerRow:
    """One line of the provenance table: where a layer (or the non-layer tensors) comes from."""

    layer: str  # "0".."L-1" or "non-layer"
    origin: str
    parts: tuple[str, ...]  # what it is made from: one, or one per module (`mlp: ...`)

    @property
    def terms(self) -> str:
        return "; ".join(self.parts)


# AlignedVocabulary.fill: an input index (that input's row), or one of these
MEAN = -1  # the mean of the rows of the inputs that have the token
EVERY = -2  # every input has the token: nothing to fill


class AlignedVocabulary(Protocol):
    """What a plan, its readers and its writer use of the inputs' aligned vocabularies
    (tokenizer_source): vocabulary.VocabularyPlan. Declared here, where the plan holds one, so
    that the plan does not depend on the module that plans the vocabulary."""

    tensors: frozenset[str]  # the embedding and head tensors, indexed by token id
    rows: list[array[int]]  # per input, per output token: the input's row, or -1
    fill: array[int]  # per output token: where inputs lacking it read it (MEAN, EVERY, input)

    @property
    def tokenizer_changed(self) -> bool: ...

    def reads(self, sources: set[int]) -> set[int]: ...

    def describe(self, labels: Sequence[str]) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...

    def write_tokenizer(self, source: Path, out: Path, opener: Opener = open_file) -> list[str]: ...

    def read_into(
        self, checkpoints: Sequence[Checkpoint], source: int, name: str, buffer: memoryview,
        first_byte: int,
    ) -> None: ...  # fmt: skip


@dataclass
class Plan:
    method: str
    inputs: tuple[InputRef, ...]
    tensors: tuple[TensorPlan, ...]
    shards: tuple[Shard, ...]
    num_layers: int | None  # the language model's layers; None when no stack was recognised
    config_input: int  # config.json and generation config come from here
    tokenizer_input: int  # tokenizer files come from here
    ties: TiesSettings | None = None  # TIES's, and task arithmetic's base, λ and normalize
    sparsify: SparsifySettings | None = None
    resolved_weights: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    layer_stack: LayerStack | Refusal | None = None  # where the layers are, by which rule
    # config.json keys (dotted paths) the output changes: a passthrough's layer count.
    config_changes: dict[str, Any] = field(default_factory=dict)
    # The recipe's arithmetic: the dtype each tensor is computed in (plan/arithmetic.py).
    arithmetic: str = "float32"
    # Set when the inputs' vocabularies are aligned (recipe field tokenizer_source).
    vocabulary: AlignedVocabulary | None = field(default=None, repr=False, compare=False)
    checkpoints: list[Checkpoint] = field(default_factory=list, repr=False, compare=False)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def inputs_read(self, tensor: TensorPlan) -> set[int]:
        """The inputs whose copy of `tensor` computing it reads: its terms' and, for TIES and
        the sparsifying methods, the base the deltas are taken from."""
        sources = {t.source for t in tensor.terms}
        if tensor.op == "ties" and self.ties is not None:
            sources.add(self.ties.base)
        if tensor.op == "sparsify" and self.sparsify is not None:
            sources.add(self.sparsify.base)
        if self.vocabulary is not None and tensor.read_name in self.vocabulary.tensors:
            sources = self.vocabulary.reads(sources)
        return sources

    def read_into(self, source: int, name: str, buffer: memoryview, first_byte: int = 0) -> None:
        """Fill `buffer` with input `source`'s tensor `name` from `first_byte` on, as the output
        sees it: its own bytes, or, for an embedding or head whose vocabulary is aligned, its
        rows in the output vocabulary's order (alignment.py)."""
        if self.vocabulary is not None and name in self.vocabulary.tensors:
            self.vocabulary.read_into(self.checkpoints, source, name, buffer, first_byte)
            return
        checkpoint = self.checkpoints[source]
        checkpoint.read_into(checkpoint.tensors[name], buffer, first_byte)

    def describe_terms(self, terms: tuple[Term, ...]) -> str:
        if len(terms) == 1 and terms[0].coefficient == 1.0:
            return self.inputs[terms[0].source].label
        return " + ".join(f"{c.coefficient:.4g}×{self.inputs[c.source].label}" for c in terms)

    def layer_rows(self) -> list[LayerRow]:
        """Per-layer provenance: what a layer's tensors are made from; where its modules differ
        (a setting with filters: self_attn at one t, mlp at another), each module's."""
        made: dict[int | None, dict[str, dict[str, None]]] = {}  # layer -> terms -> modules
        origins: dict[int | None, set[str]] = {}
        for t in self.tensors:
            origins.setdefault(t.layer, set()).add(t.origin)
            modules = made.setdefault(t.layer, {}).setdefault(self._made_from(t), {})
            modules[_module(t.name, t.layer)] = None
        order = sorted(k for k in made if k is not None) + ([None] if None in made else [])
        return [
            LayerRow(
                "non-layer" if layer is None else str(layer),
                "/".join(sorted(origins[layer])),
                _by_module(made[layer]),
            )
            for layer in order
        ]

    def _made_from(self, t: TensorPlan) -> str:
        terms = self.describe_terms(t.terms)
        if t.op in ("ties", "task_arithmetic") and self.ties is not None:
            return f"{t.op}(base={self.inputs[self.ties.base].label}; {terms})"
        if t.op == "sparsify" and self.sparsify is not None:
            return f"{self.method}(base={self.inputs[self.sparsify.base].label}; {terms})"
        return terms

    def table(self) -> str:
        rows = self.layer_rows()
        width = max(len(r.layer) for r in rows)
        owidth = max(len(r.origin) for r in rows)
        lines = [f"{'layer':<{width}}  {'origin':<{owidth}}  made from"]
        for r in rows:  # a layer whose modules differ: one line each
            lines.append(f"{r.layer:<{width}}  {r.origin:<{owidth}}  {r.parts[0]}")
            lines += [f"{'':<{width}}  {'':<{owidth}}  {part}" for part in r.parts[1:]]
        lines.append(
            f"{len(self.tensors)} tensors, {self.total_bytes / 1e9:.3f} GB in "
            f"{len(self.shards)} shard(s); "
            f"{sum(t.op == 'copy' for t in self.tensors)} copied verbatim"
        )
        if self.layer_stack is not None:
            lines.append(self.layer_stack.describe())
        if self.vocabulary is not None:
            lines.append(self.vocabulary.describe([i.label for i in self.inputs]))
        return "\n".join(lines + [f"warning: {w}" for w in self.warnings])

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "num_layers": self.num_layers,
            "layer_stack": self.layer_stack.to_dict() if self.layer_stack else None,
            "inputs": [asdict(i) for i in self.inputs],
            "config_input": self.config_input,
            "tokenizer_input": self.tokenizer_input,
            "ties": asdict(self.ties) if self.ties else None,
            "resolved_weights": self.resolved_weights,
            "tensors": [_tensor_dict(t) for t in self.tensors],
            "shards": [{"filename": s.filename, "tensors": list(s.tensors)} for s in self.shards],
            # only when present, so plans without them keep their digests
            **({"config_changes": self.config_changes} if self.config_changes else {}),
            **({"vocabulary": self.vocabulary.to_dict()} if self.vocabulary else {}),
            **({"sparsify": asdict(self.sparsify)} if self.sparsify else {}),
            **({"arithmetic": self.arithmetic} if self.arithmetic != "float32" else {}),
        }

    def digest(self) -> str:
        """sha256 of the plan's canonical JSON, without local paths (stable across machines)."""
        data = self.to_dict()
        for entry in data["inputs"]:
            entry.pop("path")
        # Follows from the inputs' headers, and every tensor's layer is digested already:
        # leaving it out keeps the digest of plans made before it was recorded.
        data.pop("layer_stack")
        canonical = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(canonical).hexdigest()

    def close(self) -> None:
        for checkpoint in self.checkpoints:
            checkpoint.close()


def _module(name: str, layer: int | None) -> str:
    """The module a tensor belongs to: `self_attn` of model.layers.3.self_attn.q_proj.weight,
    `embed_tokens` of model.embed_tokens.weight."""
    if layer is not None and f".{layer}." in name:
        return name.split(f".{layer}.", 1)[1].split(".", 1)[0]
    parts = name.split(".")
    return parts[-2] if len(parts) > 1 else name


def _by_module(made: dict[str, dict[str, None]]) -> tuple[str, ...]:
    """One description when all of a layer's modules are made alike, else each module's."""
    if len(made) == 1:
        return tuple(made)
    return tuple(f"{', '.join(modules)}: {terms}" for terms, modules in made.items())


def _tensor_dict(t: TensorPlan) -> dict[str, Any]:
    return {
        "name": t.name,
        "shape": list(t.shape),
        "dtype": t.dtype,
        "op": t.op,
        "layer": t.layer,
        "origin": t.origin,
        "terms": [[term.source, term.coefficient] for term in t.terms],
        **({"input_name": t.input_name} if t.input_name else {}),
        **({"thinning": _thinning_dict(t.thinning)} if t.thinning else {}),
        **({"scalars": dict(t.scalars)} if t.scalars else {}),
    }


def _thinning_dict(thinning: Thinning) -> dict[str, Any]:
    data: dict[str, Any] = {"densities": list(thinning.densities), "lambda": thinning.lambda_}
    if thinning.gammas:
        data["gammas"] = list(thinning.gammas)
    if thinning.epsilons:
        data["epsilons"] = list(thinning.epsilons)
    return data
