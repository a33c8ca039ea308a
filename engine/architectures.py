"""Where a checkpoint keeps its language model's layer stack: one table per model family.

A layer swap (and per-layer analysis) treats the transformer layers of the *language model*
differently from every other tensor, so it must know which tensors those are and how many layers
there are. Known families (`FAMILIES`, keyed by config.json's `model_type`) say so by data; any
other checkpoint is inferred from its tensor names: the one group `<prefix>.<n>.…` whose indices
are exactly 0..L-1, L the configured layer count. Anything else (no stack, several candidates,
an encoder-decoder) is a `Refusal` that layer methods report; methods that merge every tensor
alike never ask.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from engine.limits import MAX_LAYERS

# Saved layouts differ by transformers version (llava-hf on the Hub: language_model.model.layers;
# transformers >= 4.52 saves model.language_model.layers), so a stack lists its alternatives.
_LANGUAGE_MODEL = ("language_model.model.layers", "model.language_model.layers")
_NESTED_COUNT = ("text_config.num_hidden_layers",)
# Tried in order for families not in the table: a multimodal config nests the language model's.
COMMON_COUNT_KEYS = tuple(
    f"{where}{key}"
    for where in ("text_config.", "")
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
)
SHOWN_PATTERNS = 5
_PATTERN_CHARS = 100  # a tensor name in an error message, cut
_NUMBER_RE = re.compile(r"(?<=\.)\d+(?=\.|$)")
_FIRST_INDEX_RE = re.compile(r"^(.+?)\.(\d+)\.")  # the outermost numbered component


@dataclass(frozen=True)
class Family:
    """How one model family lays out its layers (tensor-name prefixes without the `.<n>.`)."""

    stacks: tuple[str, ...]  # the language model's stack; alternatives, at most one present
    count_keys: tuple[str, ...] = ("num_hidden_layers",)  # dotted paths into config.json
    # Other stacks and modules (a vision tower, a projector), made as a recipe's `towers` says.
    other_stacks: tuple[str, ...] = ()
    refusal: str = ""  # why layer methods are not defined for this family, if they are not
    # Layers stored after the L counted ones (DeepSeek-V3's multi-token-prediction module):
    # not part of the language stack, so merged like non-layer tensors.
    extra_layers_key: str = ""
    # Modules whose rows are indexed by token id (input embeddings, output heads): aligned
    # row by row when the inputs' vocabularies differ (alignment.py).
    vocabulary: tuple[str, ...] = ("embed_tokens", "lm_head")


_DECODER = Family(("model.layers",))
_TRANSFORMER_H = ("transformer.h",)
_WTE = ("wte", "lm_head")
_WORD_EMBEDDINGS = ("word_embeddings", "lm_head")
# Whole modules: a tower's embeddings and norms go with its layers.
_VISION_TOWER = ("vision_tower", "model.vision_tower", "multi_modal_projector",
                 "model.multi_modal_projector")  # fmt: skip
_ENCODER_DECODER = (
    "an encoder-decoder model has two layer stacks ({stacks}), and layers are swapped or "
    "analysed in the one stack of a decoder-only language model"
)

FAMILIES: dict[str, Family] = {
    "llama": _DECODER,
    "mistral": _DECODER,
    "mixtral": _DECODER,
    "qwen2": _DECODER,
    "qwen2_moe": _DECODER,
    "qwen3": _DECODER,
    "qwen3_moe": _DECODER,
    "gemma": _DECODER,
    "gemma2": _DECODER,
    "gemma3_text": _DECODER,
    "phi": _DECODER,
    "phi3": _DECODER,
    "olmo2": _DECODER,
    "granite": _DECODER,
    "stablelm": _DECODER,
    "starcoder2": _DECODER,
    "cohere": _DECODER,
    "deepseek_v3": Family(("model.layers",), extra_layers_key="num_nextn_predict_layers"),
    "olmo": _DECODER,
    "olmo3": _DECODER,
    "smollm3": _DECODER,
    "glm": _DECODER,
    "glm4": _DECODER,
    "gpt_oss": _DECODER,
    "exaone4": _DECODER,
    "ernie4_5": _DECODER,
    "llama4_text": _DECODER,
    "nemotron": _DECODER,
    "granitemoe": _DECODER,
    "phimoe": _DECODER,
    "helium": _DECODER,
    "seed_oss": _DECODER,
    "apertus": _DECODER,
    "arcee": _DECODER,
    "hunyuan_v1_dense": _DECODER,
    "minimax": _DECODER,
    "gpt_neox": Family(("gpt_neox.layers",), vocabulary=("embed_in", "embed_out", "lm_head")),
    "gpt2": Family(_TRANSFORMER_H, ("n_layer",), vocabulary=_WTE),
    "gptj": Family(_TRANSFORMER_H, ("n_layer",), vocabulary=_WTE),
    "falcon": Family(_TRANSFORMER_H, ("num_hidden_layers", "n_layer"), vocabulary=_WORD_EMBEDDINGS),
    "bloom": Family(_TRANSFORMER_H, ("n_layer", "num_hidden_layers"), vocabulary=_WORD_EMBEDDINGS),
    "mpt": Family(("transformer.blocks",), ("n_layers",), vocabulary=_WTE),
    "gemma3": Family(_LANGUAGE_MODEL, _NESTED_COUNT, _VISION_TOWER),
    "llava": Family(_LANGUAGE_MODEL, _NESTED_COUNT, _VISION_TOWER),
    # Qwen2-VL checkpoints on the Hub keep the text stack at model.layers, beside visual.blocks.
    "qwen2_vl": Family(
        ("model.layers", "model.language_model.layers"),
        ("text_config.num_hidden_layers", "num_hidden_layers"),
        ("visual", "model.visual"),
    ),
    "t5": Family(
        (),
        ("num_layers",),
        ("encoder.block", "decoder.block"),
        _ENCODER_DECODER.format(stacks="encoder.block, decoder.block"),
        vocabulary=("shared", "embed_tokens", "lm_head"),
    ),
    "bart": Family(
        (),
        ("encoder_layers",),
        ("model.encoder.layers", "model.decoder.layers"),
        _ENCODER_DECODER.format(stacks="model.encoder.layers, model.decoder.layers"),
        vocabulary=("shared", "embed_tokens", "lm_head"),
    ),
}
# A family not in the table: its token-indexed modules are recognised by these common names.
COMMON_VOCABULARY = frozenset(
    {"embed_tokens", "lm_head", "wte", "word_embeddings", "embed_in", "embed_out",
     "tok_embeddings", "shared"}
)  # fmt: skip


@dataclass(frozen=True)
class LayerStack:
    """The language model's layer stack in one checkpoint, and how it was found."""

    prefix: str  # tensor names `<prefix>.<n>.…` are layer n
    count: int
    count_key: str
    rule: str  # "family table" or "inferred from tensor names"
    model_type: str
    other_stacks: tuple[str, ...] = ()  # found in this checkpoint; not layers to a layer swap

    def layer_of(self, tensor_name: str) -> int | None:
        """The layer a tensor belongs to (`model.layers.7.mlp…` -> 7), else None."""
        match = _FIRST_INDEX_RE.match(tensor_name)
        if match is None or match.group(1) != self.prefix:
            return None
        index = int(match.group(2))
        return index if index < self.count else None  # an extra (MTP) layer is not a layer

    def in_tower(self, tensor_name: str) -> bool:
        """Whether a tensor belongs to another stack or module (a vision tower, a projector)."""
        return any(tensor_name.startswith(prefix + ".") for prefix in self.other_stacks)

    def describe(self) -> str:
        """One line for the plan table: where the layers are and which rule said so."""
        others = f"; towers and other modules (not layers): {', '.join(self.other_stacks)}"
        return (
            f"layers: {self.prefix}.<n> × {self.count} ({self.rule}, model_type "
            f"{self.model_type!r}, {self.count_key}){others if self.other_stacks else ''}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "model_type": self.model_type,
            "prefix": self.prefix,
            "count": self.count,
            "count_key": self.count_key,
            "other_stacks": list(self.other_stacks),
        }


@dataclass(frozen=True)
class Refusal:
    """Why no single language-model stack was found; a layer method reports `reason`."""

    reason: str
    model_type: str
    # The config and the tensor names contradict each other: refused by every method, as
    # transformers would refuse to load the result.
    contradiction: bool = False

    def describe(self) -> str:
        return f"layers: none recognised ({self.reason})"

    def to_dict(self) -> dict[str, Any]:
        return {"rule": "none", "model_type": self.model_type, "reason": self.reason}


def model_type_of(config: Mapping[str, Any]) -> str:
    value = config.get("model_type")
    return value[:80] if isinstance(value, str) else "unknown"


def vocabulary_modules(config: Mapping[str, Any]) -> frozenset[str]:
    """Names of the modules whose weight rows are indexed by token id (`lm_head`, `wte`, …):
    the family table's, or common names for a family not in it."""
    family = FAMILIES.get(model_type_of(config))
    return frozenset(family.vocabulary) if family else COMMON_VOCABULARY


def configured_layer_count(config: Mapping[str, Any]) -> int | None:
    """The language model's configured layer count (a positive int), else None."""
    family = FAMILIES.get(model_type_of(config))
    found = _count(config, family.count_keys if family else COMMON_COUNT_KEYS)
    return found[1] if found is not None and found[1] > 0 else None


def layer_count_problem(config: Mapping[str, Any]) -> str:
    """What is wrong with a layer count that is present but not an int in 1..MAX_LAYERS, else
    '' (an absent count is no problem: only layer methods need one)."""
    family = FAMILIES.get(model_type_of(config))
    for key in family.count_keys if family else COMMON_COUNT_KEYS:
        value = _lookup(config, key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            return f"{key} is not a positive integer"
        if value > MAX_LAYERS:
            return f"{key} is {value}; at most {MAX_LAYERS}"
    return ""


def find_layer_stack(config: Mapping[str, Any], names: Iterable[str]) -> LayerStack | Refusal:
    """The language model's layer stack by the family table, or inferred from tensor names."""
    model_type, names = model_type_of(config), list(names)
    groups = numbered_groups(names)
    family = FAMILIES.get(model_type)
    if family is None:
        found = _inferred(config, groups, model_type)
    else:
        found = _from_table(config, family, groups, model_type)
        if isinstance(found, LayerStack):  # modules without a numbered group count too
            others = tuple(p for p in family.other_stacks if _has_prefix(names, p))
            found = replace(found, other_stacks=others)
    if isinstance(found, Refusal):  # what a reader needs to see to tell why
        patterns = ", ".join(name_patterns(names))
        return replace(found, reason=f"{found.reason}; its tensor names: {patterns}, …")
    return found


def numbered_groups(names: Iterable[str]) -> dict[str, set[int]]:
    """`<prefix>` -> the indices n seen in names `<prefix>.<n>.…` (outermost number only, so
    the experts numbered inside a layer never look like a stack of their own)."""
    groups: dict[str, set[int]] = {}
    for name in names:
        if match := _FIRST_INDEX_RE.match(name):
            groups.setdefault(match.group(1), set()).add(int(match.group(2)))
    return groups


def name_patterns(names: Iterable[str], limit: int = SHOWN_PATTERNS) -> list[str]:
    """A few distinct tensor-name shapes (`transformer.h.<n>.mlp.weight`), numbered ones first:
    a numbered stack that is not recognised as layers is what a reader needs to see."""
    patterns = {_NUMBER_RE.sub("<n>", name)[:_PATTERN_CHARS] for name in names}
    return sorted(patterns, key=lambda p: ("<n>" not in p, p))[:limit]


def _count(config: Mapping[str, Any], keys: Iterable[str]) -> tuple[str, int] | None:
    """The first of `keys` (dotted paths) that holds an int, with its value."""
    for key in keys:
        value = _lookup(config, key)
        if isinstance(value, int) and not isinstance(value, bool):
            return key, value
    return None


def _lookup(config: Mapping[str, Any], dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def _checked_count(
    config: Mapping[str, Any], keys: tuple[str, ...], model_type: str
) -> tuple[str, int] | Refusal:
    found = _count(config, keys)
    if found is None:
        return Refusal(f"config.json has no layer count (looked for {', '.join(keys)})", model_type)
    key, value = found
    if not 0 < value <= MAX_LAYERS:
        return Refusal(f"config.json {key} is {value}; must be 1..{MAX_LAYERS}", model_type)
    return found


def _from_table(
    config: Mapping[str, Any], family: Family, groups: dict[str, set[int]], model_type: str
) -> LayerStack | Refusal:
    if family.refusal:
        return Refusal(f"model_type {model_type!r}: {family.refusal}", model_type)
    count = _checked_count(config, family.count_keys, model_type)
    if isinstance(count, Refusal):
        return Refusal(f"model_type {model_type!r}: {count.reason}", model_type)
    key, layers = count
    present = [prefix for prefix in family.stacks if prefix in groups]
    if len(present) != 1:
        expected = " or ".join(f"{p}.<n>." for p in family.stacks)
        return Refusal(
            f"model_type {model_type!r} keeps its layers at {expected}, and "
            f"{'none' if not present else 'several'} of these are in the tensor names",
            model_type,
        )
    extra = _count(config, (family.extra_layers_key,)) if family.extra_layers_key else None
    if problem := _index_problem(groups[present[0]], layers, extra[1] if extra else 0):
        return Refusal(problem, model_type, contradiction=True)
    return LayerStack(present[0], layers, key, "family table", model_type)


def _inferred(
    config: Mapping[str, Any], groups: dict[str, set[int]], model_type: str
) -> LayerStack | Refusal:
    count = _checked_count(config, COMMON_COUNT_KEYS, model_type)
    unlisted = f"model_type {model_type!r} is not in the family table and"
    if isinstance(count, Refusal):
        return Refusal(f"{unlisted} {count.reason}", model_type)
    key, layers = count
    candidates = sorted(p for p, found in groups.items() if found == set(range(layers)))
    if not candidates:
        seen = ", ".join(f"{p}.<n> ({len(found)})" for p, found in sorted(groups.items()))
        return Refusal(
            f"{unlisted} no group of tensor names <prefix>.<n>. numbers 0..{layers - 1} "
            f"({key} is {layers}; numbered groups seen: {seen or 'none'})",
            model_type,
        )
    if len(candidates) > 1:
        return Refusal(
            f"{unlisted} {len(candidates)} groups of tensor names hold {layers} layers each "
            f"({', '.join(f'{p}.<n>.' for p in candidates)}): which is the language model's "
            "is ambiguous",
            model_type,
        )
    others = tuple(sorted(p for p in groups if p != candidates[0] and len(groups[p]) > 1))
    return LayerStack(candidates[0], layers, key, "inferred from tensor names", model_type, others)


def _index_problem(found: set[int], layers: int, extra: int) -> str:
    """'' when a stack's indices are exactly 0..layers-1 (plus `extra` trailing layers)."""
    if found in (set(range(layers)), set(range(layers + extra))):
        return ""
    missing = sorted(set(range(layers)) - found)
    return (
        f"config says {layers} layers but tensors name layers {min(found)}..{max(found)} "
        f"({len(found)} distinct" + (f"; missing {_listed(missing)})" if missing else ")")
    )


def _has_prefix(names: list[str], prefix: str) -> bool:
    return any(name.startswith(prefix + ".") for name in names)


def _listed(values: list[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return shown + (f", … ({len(values)} in all)" if len(values) > limit else "")
