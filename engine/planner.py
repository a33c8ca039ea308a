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
from engine.io.lora import split_source
from engine.io.safetensors_format import FLOAT_DTYPES, OUTPUT_DTYPES, save_order
from engine.limits import MAX_WEIGHT_FILES
from engine.methods import METHODS, Inputs, MethodPlan
from engine.methods.base import Placement
from engine.plan.arithmetic import keeps
from engine.plan.compatibility import check_compatible
from engine.plan.model import InputRef, Op, Plan, Shard, TensorPlan, Term, Thinning, TiesSettings
from engine.plan.slices import (
    before_layers,
    described,
    input_layers,
    read_at,
    restacked,
    slice_of,
)
from engine.progress import CancelCheck
from engine.recipe import Recipe, named_sources, slice_recipes
from engine.schema.parts import LayerSlice, ModelsRecipe
from engine.vocabulary.alignment import VocabularyPlan, plan_vocabulary

Resolver = Callable[[str], Path]
# Elements per chunk of arithmetic: large enough to amortise Python, small enough that the
# float32 temporaries (reused by the allocator from chunk to chunk) stay in the tens of MB.
DEFAULT_CHUNK_ELEMENTS = 2 * 1024 * 1024


def input_refs(recipe: Recipe, resolve: Resolver) -> list[InputRef]:
    """The recipe's checkpoints in plan order, each with its role and label (the path of a
    `model+adapter` source is its model's)."""
    return [
        InputRef(n.label, n.role, n.source, str(resolve(split_source(n.source)[0])))
        for n in named_sources(recipe)
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
            adapter = split_source(ref.source)[1]
            found = resolve(adapter) if adapter is not None else None
            checkpoints.append(Checkpoint.open(Path(ref.path), guard, adapter=found))
        slices = recipe.slices if isinstance(recipe, ModelsRecipe) else None
        if slices:  # each input seen as the output names its layers (plan/slices.py)
            layers = input_layers(slices, refs, checkpoints)
            checkpoints[:] = [
                restacked(c, found) for c, found in zip(checkpoints, layers, strict=True)
            ]
        vocabulary = _vocabulary(recipe, refs, checkpoints)
        check_compatible(refs, checkpoints, vocabulary.tensors if vocabulary else frozenset())
        counts = tuple(piece.layer_count for piece in slices or [])
        inputs = Inputs(refs, checkpoints, chunk_elements, should_cancel, headers_only, counts)
        method = _method_plan(recipe, inputs)
        if slices:
            _sliced(method, slices, refs, layers)
        plan = _assemble(recipe, refs, checkpoints, method, vocabulary)
        _read_through_adapters(plan, checkpoints)
    except EngineError:
        for ckpt in checkpoints:
            ckpt.close()
        raise
    plan.checkpoints = checkpoints
    return plan


def _method_plan(recipe: Recipe, inputs: Inputs) -> MethodPlan:
    """The method's plan; where slices set their own params, one per slice's recipe, each
    layer merged by its slice's, the tensors outside the layers by the first or last slice's
    (mergekit's)."""
    recipes = slice_recipes(recipe)
    if not recipes:
        return METHODS[recipe.method].plan(recipe, inputs)
    planned: dict[int, MethodPlan] = {}  # a slice merged as the recipe shares its plan
    for r in recipes:
        if id(r) not in planned:
            planned[id(r)] = _plan_over(r, inputs)
    return _by_slice([planned[id(r)] for r in recipes], inputs.slices)


def _plan_over(recipe: Recipe, inputs: Inputs) -> MethodPlan:
    """A slice's plan over the inputs it merges (some of the models), its indices the whole
    recipe's."""
    where = {ref.source: i for i, ref in enumerate(inputs.refs)}
    index = [where[n.source] for n in named_sources(recipe)]
    own = replace(inputs, refs=[inputs.refs[i] for i in index],
                  checkpoints=[inputs.checkpoints[i] for i in index])  # fmt: skip
    plan = METHODS[recipe.method].plan(recipe, own)
    if index == list(range(len(inputs.refs))):
        return plan
    rule = plan.rule

    def renumbered(name: str, layer: int | None) -> tuple[Op, tuple[Term, ...], str]:
        op, terms, origin = rule(name, layer)
        return op, tuple(replace(t, source=index[t.source]) for t in terms), origin

    return replace(
        plan,
        rule=renumbered,
        config_input=index[plan.config_input],
        tokenizer_input=index[plan.tokenizer_input],
        ties=plan.ties and replace(plan.ties, base=index[plan.ties.base]),
        sparsify=plan.sparsify and replace(plan.sparsify, base=index[plan.sparsify.base]),
    )


def _by_slice(plans: list[MethodPlan], counts: tuple[int, ...]) -> MethodPlan:
    def pick(name: str, layer: int | None) -> MethodPlan:
        if layer is None:
            return plans[0] if before_layers(name) else plans[-1]
        return plans[slice_of(layer, counts)]

    first = plans[0]
    ties = _shared_ties(plans)
    for s, other in enumerate(plans):
        if other.sparsify != first.sparsify:
            raise RecipeError.for_field(
                f"slices.{s}.params",
                "differ from slices.0's in how deltas are thinned or merged (normalize, "
                "rescale, seed), which Layerswap sets once for the whole merge",
            )
    varies = ties is not None and ties != first.ties  # amounts then said per tensor

    def thinning(name: str, layer: int | None) -> Thinning:
        own = pick(name, layer)
        if own.thinning is not None:
            return own.thinning(name, layer)
        assert own.ties is not None  # a ties or task_arithmetic tensor, amounts shared
        count = len(own.rule(name, layer)[1])
        return Thinning((own.ties.density,) * count, own.ties.lambda_)

    def scalars(name: str, layer: int | None) -> tuple[tuple[str, float], ...]:
        own = pick(name, layer).scalars
        return () if own is None else own(name, layer)

    return replace(
        first,
        rule=lambda name, layer: pick(name, layer).rule(name, layer),
        ties=ties,
        thinning=thinning if varies or any(p.thinning for p in plans) else None,
        scalars=scalars if first.scalars is not None else None,
        resolved_weights={
            **first.resolved_weights,
            "slice_params": [p.resolved_weights for p in plans],
        },
    )


def _shared_ties(plans: list[MethodPlan]) -> TiesSettings | None:
    """One TiesSettings for plans whose densities or λ may differ (then each tensor's
    thinning says them); their base and normalize must agree."""
    first = plans[0].ties
    if first is None or all(p.ties == first for p in plans):
        return first
    for s, other in enumerate(plans):
        assert other.ties is not None  # the same method's plans
        if (other.ties.base, other.ties.normalize) != (first.base, first.normalize):
            raise RecipeError.for_field(
                f"slices.{s}.params.normalize",
                "differs from slices.0's: Layerswap normalizes the whole merge or none of it",
            )
    return replace(first, density=1.0, lambda_=1.0)


def _sliced(
    method: MethodPlan,
    slices: list[LayerSlice],
    refs: list[InputRef],
    layers: list[list[int | None]],
) -> None:
    """A new depth; the ranges recorded, and each layer's origin naming the layer of each
    input it merges."""
    method.num_layers = len(layers[0])
    method.resolved_weights = {**method.resolved_weights, "slices": described(slices, refs)}
    rule = method.rule

    def labelled(name: str, layer: int | None) -> tuple[Op, tuple[Term, ...], str]:
        op, terms, origin = rule(name, layer)
        return op, terms, origin if layer is None else f"{origin} ({read_at(refs, layers, layer)})"

    method.rule = labelled


def _read_through_adapters(plan: Plan, checkpoints: list[Checkpoint]) -> None:
    """A tensor a LoRA adapter changes is read through it, never copied from its file: x·1 in
    its own dtype, the same bytes as the adapted tensor."""
    plan.tensors = tuple(
        replace(t, op="linear")
        if t.op == "copy" and checkpoints[t.terms[0].source].adapts(t.read_name)
        else t
        for t in plan.tensors
    )


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
    return plan_vocabulary(
        recipe.tokenizer_source, refs, checkpoints, base=base, tokens=recipe.tokens,
        pad_to_multiple_of=recipe.pad_to_multiple_of,
    )  # fmt: skip


def _assemble(
    recipe: Recipe,
    refs: list[InputRef],
    checkpoints: list[Checkpoint],
    method: MethodPlan,
    vocabulary: VocabularyPlan | None = None,
) -> Plan:
    primary = checkpoints[method.config_input]
    # by the names it is seen by: a view renames its layers (plan/slices.py)
    order = sorted(primary.tensors.items(), key=lambda kv: (str(kv[1].file), kv[1].start))
    warnings: list[str] = []
    # Methods that need layers required the stack already; for the others it only labels the
    # provenance rows, and a checkpoint without one is merged all the same.
    found = primary.layer_stack
    stack = found if isinstance(found, LayerStack) else None
    if method.placements is not None:
        tensors = tuple(_placed(recipe, p, checkpoints) for p in method.placements)
    else:
        tensors = tuple(_tensor(recipe, n, primary, method, warnings, stack) for n, _ in order)
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
    if op == "sparsify" or (op in ("ties", "task_arithmetic") and method.thinning is not None):
        assert method.thinning is not None  # ties, task arithmetic: where their amounts vary
        thinning = method.thinning(name, layer)
    scalars = method.scalars(name, layer) if method.scalars is not None else ()
    return TensorPlan(
        name, info.shape, dtype, op, terms, layer, origin, thinning=thinning, scalars=scalars
    )


def _placed(recipe: Recipe, placement: Placement, checkpoints: list[Checkpoint]) -> TensorPlan:
    """A tensor taken whole from one input, maybe renamed: a copy unless it is scaled or the
    dtype changes (integer buffers never do)."""
    info = checkpoints[placement.source].tensors[placement.input_name]
    dtype = info.dtype
    if dtype in FLOAT_DTYPES and recipe.output.dtype != "source":
        dtype = OUTPUT_DTYPES[recipe.output.dtype]
    exact = dtype == info.dtype and keeps(recipe.arithmetic, dtype)  # mergekit rounds to it
    exact = exact and placement.scale == 1.0
    op: Op = "copy" if exact or dtype not in FLOAT_DTYPES else "linear"
    renamed = placement.input_name if placement.input_name != placement.name else ""
    terms = (Term(placement.source, placement.scale),)
    return TensorPlan(
        placement.name, info.shape, dtype, op, terms, placement.layer, placement.origin, renamed
    )


def _shards(tensors: tuple[TensorPlan, ...], budget: int) -> tuple[Shard, ...]:
    """Shards filled in plan order (the primary's file order, a passthrough's layer order: runs
    of consecutive layers, as mergekit fills its shards in the order it computes them), each
    laid out as save_file lays a file out (save_order), so a one-file output is the file
    save_file writes of its tensors. A split output is laid out alike, shard by shard, but cut
    by our budget, not at mergekit's places."""
    groups: list[list[int]] = [[]]
    size = 0
    for i, t in enumerate(tensors):
        if groups[-1] and size + t.nbytes > budget:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += t.nbytes
    for group in groups:
        group.sort(key=lambda i: save_order(tensors[i].dtype, tensors[i].name))
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
