"""A mergekit 0.1.5 config read into what a method translator needs (engine/translation/config.py:
its inputs, base, the places its parameters are set), and the output options. Every field it
cannot honour is refused here or by the method, by its mergekit name
(`models.1.parameters.density`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from engine.errors import RecipeError, quoted
from engine.schema.parts import HUB_REPO_PATTERN
from engine.translation.config import Input, MergekitConfig, Slice
from engine.translation.settings import Place

# Fields of mergekit's MergeConfiguration; `name` is no field of mergekit's (it ignores it),
# but configs on model cards carry it and it names the output here.
TOP_LEVEL = frozenset(
    {"merge_method", "models", "slices", "modules", "base_model", "parameters", "dtype",
     "out_dtype", "tokenizer_source", "tokenizer", "chat_template", "name"}
)  # fmt: skip
# mergekit's float dtype names (common.dtype_from_name; it knows int64 too, which no merge
# computes in): what it computes in (`dtype`) and writes.
DTYPES = ("bfloat16", "float16", "float32", "float64")
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,199}$")
IsLocal = Callable[[str], bool]


def read(data: Any, is_local: IsLocal) -> MergekitConfig:
    """The config's structure, every model reference turned into a Layerswap source."""
    data = mapping(data, "config")
    method = data.get("merge_method")
    if not isinstance(method, str) or not method:
        raise RecipeError.for_field("merge_method", "required: the name of a mergekit method")
    shared = [Place("parameters", parameters_of(data.get("parameters"), "parameters"))]
    layout, prefix = data, ""
    if data.get("modules") is not None:
        layout, prefix = _only_module(data), "modules.default."
        shared.insert(0, Place(f"{prefix}parameters", parameters_of(
            layout.get("parameters"), f"{prefix}parameters")))  # fmt: skip
    if bool(layout.get("models")) == bool(layout.get("slices")):
        raise RecipeError.for_field(f"{prefix}models", "give exactly one of models and slices")
    base = None
    if data.get("base_model") is not None:
        base = Input("base_model", model_source(data["base_model"], "base_model", is_local), {})
    ignored = [f"{key}: not a field of mergekit's config; ignored, as mergekit does"
               for key in data if key not in TOP_LEVEL]  # fmt: skip
    config = MergekitConfig(method, [], None, base, shared, ignored)
    if layout.get("models"):
        entries = items(layout["models"], f"{prefix}models")
        config.inputs = _distinct([_input(m, f"{prefix}models.{i}", is_local, config.warnings)
                                   for i, m in enumerate(entries)])  # fmt: skip
    else:
        entries = items(layout["slices"], f"{prefix}slices")
        config.slices = [_slice(s, f"{prefix}slices.{i}", is_local, config.warnings)
                         for i, s in enumerate(entries)]  # fmt: skip
    if base is not None:  # listed among the models: its parameters are those given there
        config.base = next((m for m in config.inputs if m.source == base.source), base)
    return config


def _only_module(data: dict[str, Any]) -> dict[str, Any]:
    """`modules:` naming the one module of a decoder (mergekit calls it `default`): the same
    as its slices or models at the top. Several modules (a multimodal model's vision tower and
    projector beside the decoder) are refused: Layerswap merges one stack of layers."""
    if data.get("models") or data.get("slices"):
        raise RecipeError.for_field("modules", "give exactly one of models, slices and modules")
    modules = mapping(data["modules"], "modules")
    if list(modules) != ["default"]:
        names = ", ".join(map(str, modules)) or "none"
        raise RecipeError.for_field(
            "modules",
            f"names {names}: Layerswap merges a decoder's one stack of layers, the module "
            "mergekit calls `default`; a multimodal model's towers are not merged",
        )
    module = mapping(modules["default"], "modules.default")
    if unknown := set(module) - {"slices", "models", "parameters"}:
        raise RecipeError.for_field(f"modules.default.{sorted(unknown)[0]}", "unknown field")
    return module


def _input(
    entry: Any, field: str, is_local: IsLocal, warnings: list[str], *, slice_source: bool = False
) -> Input:
    entry = mapping(entry, field)
    allowed = {"model", "parameters"} | ({"layer_range"} if slice_source else set())
    warnings.extend(_ignored(entry, allowed, field))
    if "model" not in entry:
        raise RecipeError.for_field(f"{field}.model", "required")
    source = model_source(entry["model"], f"{field}.model", is_local)
    return Input(field, source, parameters_of(entry.get("parameters"), f"{field}.parameters"))


def _slice(entry: Any, field: str, is_local: IsLocal, warnings: list[str]) -> Slice:
    entry = mapping(entry, field)
    warnings.extend(
        _ignored(entry, {"sources", "base_model", "residual_weight", "parameters"}, field)
    )
    if entry.get("residual_weight") is not None:
        warnings.append(f"{field}.residual_weight: mergekit 0.1.5 never uses it; ignored")
    base = None
    if entry.get("base_model") is not None:
        where = f"{field}.base_model"
        base = Input(where, model_source(entry["base_model"], where, is_local), {})
    sources = items(entry.get("sources"), f"{field}.sources")
    inputs = _distinct([_input(s, f"{field}.sources.{i}", is_local, warnings, slice_source=True)
                        for i, s in enumerate(sources)])  # fmt: skip
    ranges = [layer_range(s.get("layer_range"), f"{field}.sources.{i}.layer_range")
              for i, s in enumerate(sources)]  # fmt: skip
    for i, found in enumerate(ranges):
        if found[1] - found[0] != ranges[0][1] - ranges[0][0]:
            raise RecipeError.for_field(
                f"{field}.sources.{i}.layer_range",
                f"spans {found[1] - found[0]} layers, the slice's first source "
                f"{ranges[0][1] - ranges[0][0]}: a slice's sources take as many layers each",
            )
    block = parameters_of(entry.get("parameters"), f"{field}.parameters")
    return Slice(field, inputs, tuple(ranges), block, base)


def _ignored(entry: dict[str, Any], fields: set[str], where: str) -> list[str]:
    """mergekit's config models ignore keys they do not define (a `revision:` beside `model:`
    selects nothing: mergekit reads a revision from `model: org/name@revision`)."""
    return [f"{where}.{key}: not a field of mergekit's config; ignored, as mergekit does"
            for key in entry if key not in fields]  # fmt: skip


def whole_models(config: MergekitConfig) -> MergekitConfig:
    """A non-passthrough config written with `slices`: they become the recipe's (each source's
    layers merged index by index, the slices stacked; one slice of every layer merges whole
    models), the config's models every one the slices merge (a slice's own models and
    parameters: slice_views)."""
    assert config.slices is not None
    first = config.slices[0]
    for piece in config.slices[1:]:
        _same_base(piece, first)
    config.sliced = True
    union: dict[str, Input] = {}  # every slice's models, each where first named
    for piece in config.slices:
        for model in piece.inputs:
            union.setdefault(model.source, model)
    config.inputs = list(union.values())
    config.shared.insert(0, Place(f"{first.field}.parameters", first.parameters))
    if first.base is not None:  # mergekit: a slice's own base comes first
        config.base, config.base_field = first.base, first.base.field
    if config.base is not None:
        config.base = next(
            (m for m in config.inputs if m.source == config.base.source), config.base
        )
    return config


def _same_base(piece: Slice, first: Slice) -> None:
    """A later slice merges over the first's base (its models and parameters may differ:
    slice_views)."""
    if (piece.base and piece.base.source) != (first.base and first.base.source):
        raise RecipeError.for_field(
            f"{piece.field}.base_model",
            f"differs from {first.field}.base_model: Layerswap's slices merge over one base",
        )


def slice_views(config: MergekitConfig) -> list[MergekitConfig]:
    """Per slice of a sliced config whose slices merge other models or set parameters
    differently, the config as that slice reads it (its sources, their parameters and its own
    before the config's); [] where every slice merges the config's models as the first."""
    assert config.slices is not None
    if all(_as_written(piece, config.slices[0], config) for piece in config.slices):
        return []
    views = []
    for piece in config.slices:
        shared = [Place(f"{piece.field}.parameters", piece.parameters), *config.shared[1:]]
        base = config.base and next(
            (m for m in piece.inputs if m.source == config.base.source), config.base
        )
        views.append(replace(config, inputs=piece.inputs, shared=shared, base=base))
    return views


def _as_written(piece: Slice, first: Slice, config: MergekitConfig) -> bool:
    """Whether a slice merges the config's models (all of them, in order) with the parameters
    the config reads for them (the first slice's)."""
    return (
        piece.parameters == first.parameters
        and [m.source for m in piece.inputs] == [m.source for m in config.inputs]
        and all(m.parameters == theirs.parameters
                for m, theirs in zip(piece.inputs, config.inputs, strict=True))
    )  # fmt: skip


def recipe_slices(config: MergekitConfig) -> list[dict[str, Any]]:
    """The recipe's `slices`: each slice's sources and ranges, as written."""
    assert config.slices is not None
    return [
        {"sources": [{"model": m.source, "layer_range": list(r)}
                     for m, r in zip(piece.inputs, piece.ranges, strict=True)]}
        for piece in config.slices
    ]  # fmt: skip


def _distinct(inputs: list[Input]) -> list[Input]:
    seen: dict[str, str] = {}
    for model in inputs:
        if model.source in seen:
            raise RecipeError.for_field(
                f"{model.field}.model",
                f"{model.source} is listed twice (also {seen[model.source]})",
            )
        seen[model.source] = model.field
    return inputs


def model_source(ref: Any, field: str, is_local: IsLocal) -> str:
    """A mergekit model reference (`org/name`, `org/name@revision`, a path, or its mapping
    form) as a Layerswap source: hf://org/name[@revision], or the path as written."""
    if isinstance(ref, dict):
        return _mapping_source(ref, field, is_local)
    if not isinstance(ref, str) or not ref:
        raise RecipeError.for_field(field, f"must name a model (got {quoted(ref)})")
    if "+" in ref:  # model+adapter: a PEFT LoRA applied to the model (engine/io/lora.py)
        model, _, adapter = ref.partition("+")
        if not model or not adapter or "+" in adapter:
            raise RecipeError.for_field(field, f"{ref}: a LoRA reference is model+adapter")
        return f"{model_source(model, field, is_local)}+{model_source(adapter, field, is_local)}"
    if ref.count("@") > 1:
        raise RecipeError.for_field(field, f"{ref}: more than one @")
    path, _, revision = ref.partition("@")
    return _source(path, revision or None, field, is_local)


def _mapping_source(ref: dict[str, Any], field: str, is_local: IsLocal) -> str:
    if ref.get("override_architecture") is not None:
        raise RecipeError.for_field(f"{field}.override_architecture", "not supported by Layerswap")
    if unknown := set(ref) - {"model", "lora", "override_architecture"}:
        raise RecipeError.for_field(f"{field}.{sorted(unknown)[0]}", "unknown field")
    model = _path_source(ref.get("model"), f"{field}.model", is_local)
    if ref.get("lora") is None:
        return model
    return f"{model}+{_path_source(ref['lora'], f'{field}.lora', is_local)}"


def _path_source(path: Any, field: str, is_local: IsLocal) -> str:
    """mergekit's ModelPath: `path[@revision]`, or {path, revision}."""
    if isinstance(path, str):
        if "+" in path:
            raise RecipeError.for_field(field, f"{path}: names one model, no +")
        return model_source(path, field, is_local)
    if not isinstance(path, dict) or not isinstance(path.get("path"), str):
        raise RecipeError.for_field(field, "must be a path or {path, revision}")
    if unknown := set(path) - {"path", "revision"}:
        raise RecipeError.for_field(f"{field}.{sorted(unknown)[0]}", "unknown field")
    return _source(path["path"], path.get("revision"), field, is_local)


def _source(path: str, revision: str | None, field: str, is_local: IsLocal) -> str:
    if "@" in path:
        raise RecipeError.for_field(field, f"{path}: more than one @")
    if path.startswith("hf://"):  # already Layerswap's form
        return path if revision is None else f"{path}@{revision}"
    if is_local(path):
        if revision is not None:
            raise RecipeError.for_field(field, f"{path} is a local directory: it has no @revision")
        return path
    if not re.match(HUB_REPO_PATTERN, path):
        raise RecipeError.for_field(
            field, f"{path} is neither a local directory nor a Hub repository org/name"
        )
    if revision is not None and not _REVISION.match(revision):
        raise RecipeError.for_field(field, f"{quoted(revision)} is not a revision")
    return f"hf://{path}" + (f"@{revision}" if revision else "")


def parameters_of(block: Any, field: str) -> dict[str, Any]:
    if block is None:
        return {}
    if not isinstance(block, dict):
        raise RecipeError.for_field(field, "must be a mapping of parameter names to values")
    return block


def mapping(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RecipeError.for_field(field, f"must be a mapping (got {quoted(value)})")
    return value


def items(value: Any, field: str) -> list[Any]:
    if not isinstance(value, list) or not value:
        raise RecipeError.for_field(field, "must be a non-empty list")
    return value


def layer_range(value: Any, field: str) -> tuple[int, int]:
    ok = isinstance(value, list | tuple) and len(value) == 2
    if not ok or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise RecipeError.for_field(field, f"must be [start, end] (got {quoted(value)})")
    start, end = value
    if not 0 <= start < end:
        raise RecipeError.for_field(field, "must be [start, end) with 0 <= start < end")
    return start, end


def dtype_name(value: Any, field: str) -> str:
    name = value.removeprefix("torch.") if isinstance(value, str) else value
    if name not in DTYPES:
        raise RecipeError.for_field(
            field,
            f"{quoted(value)}: Layerswap computes in and writes {', '.join(DTYPES)}",
        )
    return str(name)


def declared_dtype(data: dict[str, Any]) -> str:
    """The dtype a mergekit config writes its output in, as its config.json declares it: its
    out_dtype, else its dtype, else the checkpoints' own ("source")."""
    for key in ("out_dtype", "dtype"):
        if data.get(key) is not None:
            return dtype_name(data[key], key)
    return "source"
