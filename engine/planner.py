"""Recipe + checkpoint headers -> validated Plan. Nothing is written here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.architectures import LayerStack
from engine.errors import EngineError, RecipeError
from engine.io.checkpoint import Checkpoint
from engine.io.file_access import FileGuard
from engine.io.safetensors_format import FLOAT_DTYPES, OUTPUT_DTYPES
from engine.limits import MAX_WEIGHT_FILES
from engine.methods import METHODS, Inputs, MethodPlan
from engine.methods.base import Placement
from engine.plan.arithmetic import keeps
from engine.plan.compatibility import check_compatible
from engine.plan.model import InputRef, Op, Plan, Shard, TensorPlan, Term
from engine.progress import CancelCheck
from engine.recipe import Recipe, named_sources
from engine.vocabulary.alignment import VocabularyPlan, plan_vocabulary

Resolver = Callable[[str], Path]
# Elements per chunk of arithmetic: large enough to amortise Python, small enough that the
# float32 temporaries (reused by the allocator from chunk to chunk) stay in the tens of MB.
DEFAULT_CHUNK_ELEMENTS = 2 * 1024 * 1024


def input_refs(recipe: Recipe, resolve: Resolver) -> list[InputRef]:
    """The recipe's checkpoints in plan order, each with its role and label."""
    return [
        InputRef(n.label, n.role, n.source, str(resolve(n.source))) for n in named_sources(recipe)
    ]


def make_plan(
    recipe: Recipe,
    *,
    resolve: Resolver,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    should_cancel: CancelCheck | None = None,
    headers_only: bool = False,
    guard: FileGuard | None = None,
) -> Plan:
    """Open every input (headers only), validate them together and plan every output tensor.
    `should_cancel` is asked while planning reads weights (magnitude weights). `headers_only`
    skips those reads (magnitude weights come out equal): every check, none of the cost, for
    validating a request before it is accepted. `guard` confines the files read from the
    inputs (engine/io/file_access.py)."""
    refs = input_refs(recipe, resolve)
    checkpoints: list[Checkpoint] = []
    try:
        for ref in refs:
            checkpoints.append(Checkpoint.open(Path(ref.path), guard))
        vocabulary = _vocabulary(recipe, refs, checkpoints)
        check_compatible(refs, checkpoints, vocabulary.tensors if vocabulary else frozenset())
        inputs = Inputs(refs, checkpoints, chunk_elements, should_cancel, headers_only)
        method = METHODS[recipe.method].plan(recipe, inputs)
        plan = _assemble(recipe, refs, checkpoints, method, vocabulary)
    except EngineError:
        for ckpt in checkpoints:
            ckpt.close()
        raise
    plan.checkpoints = checkpoints
    return plan


def _vocabulary(
    recipe: Recipe, refs: list[InputRef], checkpoints: list[Checkpoint]
) -> VocabularyPlan | None:
    """The output's vocabulary when the recipe sets tokenizer_source. The base whose rows fill
    a token others lack is the recipe's base (slerp's: models[0], mergekit's base_model)."""
    if recipe.tokenizer_source is None:
        return None
    bases = [i for i, ref in enumerate(refs) if ref.role == "base"]
    if METHODS[recipe.method].first_model_is_base:
        bases = [0]
    base = bases[0] if bases else None
    return plan_vocabulary(recipe.tokenizer_source, refs, checkpoints, base=base)


def _assemble(
    recipe: Recipe,
    refs: list[InputRef],
    checkpoints: list[Checkpoint],
    method: MethodPlan,
    vocabulary: VocabularyPlan | None = None,
) -> Plan:
    primary = checkpoints[method.config_input]
    order = sorted(primary.tensors.values(), key=lambda t: (str(t.file), t.start))
    warnings: list[str] = []
    # Methods that need layers required the stack already; for the others it only labels the
    # provenance rows, and a checkpoint without one is merged all the same.
    found = primary.layer_stack
    stack = found if isinstance(found, LayerStack) else None
    if method.placements is not None:
        tensors = tuple(_placed(recipe, p, checkpoints) for p in method.placements)
    else:
        tensors = tuple(
            _tensor(recipe, info.name, primary, method, warnings, stack) for info in order
        )
    changes: dict[str, Any] = {}
    if stack is not None and method.num_layers is not None:  # the method set a new depth
        found = stack = replace(stack, count=method.num_layers)
        changes[stack.count_key] = stack.count
    if vocabulary is not None:  # one row per output token
        tensors = tuple(vocabulary.align(t) for t in tensors)
        changes.update(vocabulary.config_changes(primary.config))
    plan = Plan(
        method=recipe.method,
        inputs=tuple(refs),
        tensors=tensors,
        shards=_shards(tensors, recipe.output.shard_bytes),
        num_layers=stack.count if stack else None,
        config_input=method.config_input,
        tokenizer_input=vocabulary.tokenizer_input if vocabulary else method.tokenizer_input,
        ties=method.ties,
        sparsify=method.sparsify,
        resolved_weights=method.resolved_weights,
        warnings=warnings,
        layer_stack=found,
        config_changes=changes,
        vocabulary=vocabulary,
        arithmetic=recipe.arithmetic,
    )
    optional = METHODS[recipe.method].base != "required"
    if optional and recipe.base is not None and not recipe.plans_from_weights:
        used = {source for p in tensors for source in plan.inputs_read(p)}
        if (base := len(refs) - 1) not in used:
            warnings.append(f"base {refs[base].source} is not used by this recipe")
    return plan


def _tensor(
    recipe: Recipe,
    name: str,
    primary: Checkpoint,
    method: MethodPlan,
    warnings: list[str],
    stack: LayerStack | None,
) -> TensorPlan:
    info = primary.tensors[name]
    layer = stack.layer_of(name) if stack else None
    op, terms, origin = method.rule(name, layer)
    if op == "linear":  # other ops read every term: mergekit's arithmetic keeps 0·x
        terms = tuple(t for t in terms if t.coefficient != 0.0) or terms[:1]
    if info.dtype not in FLOAT_DTYPES:
        # Integer/bool buffers cannot be averaged: take them from the base deltas are taken
        # from, else from the dominant input.
        base = method.ties or method.sparsify
        source = base.base if base else max(terms, key=lambda t: t.coefficient).source
        warnings.append(f"{name}: {info.dtype} tensor copied from one input, not merged")
        return TensorPlan(name, info.shape, info.dtype, "copy", (Term(source, 1.0),), layer, origin)
    dtype = info.dtype if recipe.output.dtype == "source" else OUTPUT_DTYPES[recipe.output.dtype]
    one = len(terms) == 1 and terms[0].coefficient == 1.0
    if op == "linear" and one and dtype == info.dtype and keeps(recipe.arithmetic, dtype):
        op = "copy"
    thinning = None
    if op == "sparsify":
        assert method.thinning is not None
        thinning = method.thinning(name, layer)
    scalars = method.scalars(name, layer) if method.scalars is not None else ()
    return TensorPlan(
        name, info.shape, dtype, op, terms, layer, origin, thinning=thinning, scalars=scalars
    )


def _placed(recipe: Recipe, placement: Placement, checkpoints: list[Checkpoint]) -> TensorPlan:
    """A tensor taken whole from one input, maybe renamed: a copy unless the dtype changes
    (integer buffers never do)."""
    info = checkpoints[placement.source].tensors[placement.input_name]
    dtype = info.dtype
    if dtype in FLOAT_DTYPES and recipe.output.dtype != "source":
        dtype = OUTPUT_DTYPES[recipe.output.dtype]
    exact = dtype == info.dtype and keeps(recipe.arithmetic, dtype)  # mergekit rounds to it
    op: Op = "copy" if exact or dtype not in FLOAT_DTYPES else "linear"
    renamed = placement.input_name if placement.input_name != placement.name else ""
    terms = (Term(placement.source, 1.0),)
    return TensorPlan(
        placement.name, info.shape, dtype, op, terms, placement.layer, placement.origin, renamed
    )


def _shards(tensors: tuple[TensorPlan, ...], budget: int) -> tuple[Shard, ...]:
    groups: list[list[int]] = [[]]
    size = 0
    for i, t in enumerate(tensors):
        if groups[-1] and size + t.nbytes > budget:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += t.nbytes
    if len(groups) == 1:
        return (Shard("model.safetensors", tuple(groups[0])),)
    n = len(groups)
    if n > MAX_WEIGHT_FILES:  # each shard is an open file while writing
        raise RecipeError.for_field(
            "output.shard_size",
            f"would split the output into {n} shards; at most {MAX_WEIGHT_FILES} (use a larger "
            "shard_size)",
        )
    return tuple(
        Shard(f"model-{k + 1:05d}-of-{n:05d}.safetensors", tuple(g)) for k, g in enumerate(groups)
    )


def reject_unknown_source(source: str) -> None:
    if "://" in source:
        raise RecipeError.for_field(
            "source", f"{source}: only local checkpoint directories are supported here"
        )
