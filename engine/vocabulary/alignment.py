"""Merging checkpoints whose vocabularies differ (`tokenizer_source`, as mergekit's).

The output's vocabulary is the base's, the union of every input's, or one input's. An input's
vocabulary is its tokenizer.json's tokens whose ids are below its embedding's row count (rows
past the tokenizer, padding, hold no token). The union is the base's tokens with their ids,
then every token new to it, numbered on: first those of the inputs' model vocabularies, then
their added tokens, each input in recipe order, its tokens by id (mergekit's order, which it
takes from hash order where this takes recipe order). New tokens become added tokens.

The embedding and head tensors (`vocabulary_tensors`) get one row per output token. Each input
contributes its own row for a token it has; for a token it lacks, as mergekit 0.1.5 by default:
the row of the one input that has it; else the base's row when the base has it; else the mean
of the rows of the inputs that have it (summed from zero in recipe order and divided, each step
rounded to the tensor's dtype: mergekit's arithmetic in the checkpoints' dtype). The method's
arithmetic then runs on these aligned rows. A recipe's `tokens` entries add tokens and give
their rows by their own rules instead (configured.py). The output has one row per token, then,
with `pad_to_multiple_of`, padding rows up to its next multiple: each input's are the mean of
its aligned token rows (torch.mean, as mergekit: rows.py, cascade.py), merged as any row.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from engine.architectures import LayerStack, vocabulary_modules
from engine.errors import RecipeError
from engine.io.checkpoint import Checkpoint
from engine.io.file_access import Opener, open_file
from engine.plan.model import EVERY, MEAN, InputRef, Op, TensorPlan
from engine.schema.parts import TOKENIZER_BASE, TOKENIZER_MODEL_PREFIX, TOKENIZER_UNION, TokenFill
from engine.vocabulary.configured import add_tokens, configure_fill
from engine.vocabulary.tokenizer_json import (
    TokenizerVocabulary,
    new_entry,
    read_tokenizer,
    write_tokenizer,
)

FIELD = "tokenizer_source"
UNION, BASE, MODEL_PREFIX = TOKENIZER_UNION, TOKENIZER_BASE, TOKENIZER_MODEL_PREFIX
AVERAGED_DTYPES = frozenset({"BF16", "F16", "F32", "F64"})  # what vocabulary_rows averages


@dataclass(eq=False)
class VocabularyPlan:
    """The output's vocabulary and, per input, the row each output token is read from."""

    source: str  # tokenizer_source, as written
    tokenizer_input: int  # whose tokenizer files the output's are made from
    tokens: list[str]  # the output's tokens, by id (= row)
    appended: list[dict[str, Any]]  # added_tokens entries of the tokens new to that tokenizer
    dropped: int  # that tokenizer's tokens past its embedding rows, left out
    tensors: frozenset[str]  # the embedding and head tensors, indexed by token id
    input_rows: list[int]  # each input's rows in those tensors
    rows: list[array[int]]  # per input, per output token: the input's row, or -1
    fill: array[int]  # per output token: where inputs lacking it read it (MEAN, EVERY, input)
    donors: list[frozenset[int]]  # per input: the inputs its missing rows are read from
    forced: array[int]  # per output token: 1 where every input reads the fill (`tokens` force)
    fill_row: array[int]  # per output token: the row the fill input is read at (-1: the token's)
    padding: int = 0  # rows past the tokens (pad_to_multiple_of): each input's, its rows' mean
    means: dict[tuple[int, str], bytes] = field(default_factory=dict, repr=False)

    @property
    def size(self) -> int:
        """The embedding's rows: one per token, then the padding."""
        return len(self.tokens) + self.padding

    @property
    def tokenizer_changed(self) -> bool:
        """Whether the tokenizer input's files are rewritten (tokens added or dropped)."""
        return bool(self.appended) or self.dropped > 0

    def unchanged(self, source: int) -> bool:
        """Whether input `source`'s rows are the output's as they are (same count and order)."""
        rows = self.rows[source]
        if self.padding or any(self.forced):
            return False
        return self.input_rows[source] == self.size and all(r == i for i, r in enumerate(rows))

    def reads(self, sources: set[int]) -> set[int]:
        """The inputs read to align the rows of `sources` (they and the inputs they fill from)."""
        return sources.union(*(self.donors[s] for s in sources))

    def align(self, tensor: TensorPlan) -> TensorPlan:
        """`tensor` with the output's rows; a copy stays one only where its rows do."""
        if tensor.read_name not in self.tensors:
            return tensor
        shape = (self.size, *tensor.shape[1:])
        copied = tensor.op == "copy" and self.unchanged(tensor.terms[0].source)
        return replace(tensor, shape=shape, op="copy" if copied else _computed(tensor))

    def config_changes(self, config: dict[str, Any]) -> dict[str, Any]:
        """config.json's vocabulary sizes set to the output's (nested text_config too)."""
        keys = [k for k in ("vocab_size",) if k in config]
        nested = config.get("text_config")
        if isinstance(nested, dict) and "vocab_size" in nested:
            keys.append("text_config.vocab_size")
        return dict.fromkeys(keys or ["vocab_size"], self.size)

    def to_dict(self) -> dict[str, Any]:
        """What the plan and manifest record: the source, the sizes, and a digest of the rows
        every input contributes (the tokens and row maps themselves are large)."""
        return {
            "tokenizer_source": self.source,
            "tokenizer_input": self.tokenizer_input,
            "size": self.size,
            "added_tokens": len(self.appended),
            "dropped_tokens": self.dropped,
            "tensors": sorted(self.tensors),
            "missing": self.missing,
            "rows_sha256": self._digest,
            **({"padding_rows": self.padding} if self.padding else {}),
        }

    @cached_property
    def missing(self) -> list[int]:
        """Per input: how many output tokens it lacks (their rows are filled in)."""
        return [sum(r < 0 for r in rows) for rows in self.rows]

    @cached_property
    def _digest(self) -> str:
        digest = hashlib.sha256(json.dumps(self.tokens, ensure_ascii=False).encode())
        for rows in self.rows:
            digest.update(rows.tobytes())
        digest.update(self.fill.tobytes())
        if any(self.forced) or any(r >= 0 for r in self.fill_row):  # set by `tokens` only
            digest.update(self.forced.tobytes())
            digest.update(self.fill_row.tobytes())
        return digest.hexdigest()

    def describe(self, labels: Sequence[str]) -> str:
        """One line for the plan table."""
        lacking = [f"{labels[i]} {n}" for i, n in enumerate(self.missing) if n]
        return (
            f"vocabulary: {self.size} tokens (tokenizer_source {self.source}: "
            f"{labels[self.tokenizer_input]}'s tokenizer"
            f"{f' + {len(self.appended)} added' if self.appended else ''}"
            f"{f' - {self.dropped} past its rows' if self.dropped else ''}"
            f"{f', + {self.padding} padding rows' if self.padding else ''}); rows aligned in "
            f"{', '.join(sorted(self.tensors))}"
            f"{'; tokens filled in: ' + ', '.join(lacking) if lacking else ''}"
        )

    def write_tokenizer(self, source: Path, out: Path, opener: Opener = open_file) -> list[str]:
        """Write the output's tokenizer files into `out` from the tokenizer input's directory
        `source`, read through `opener` (rewritten only where tokens were added or dropped;
        else the caller copies them as they are). Returns the names written."""
        return write_tokenizer(
            source, out, rows=self.input_rows[self.tokenizer_input], appended=self.appended,
            tokens=self.tokens, opener=opener,
        )  # fmt: skip

    def read_into(
        self, checkpoints: Sequence[Checkpoint], source: int, name: str, buffer: memoryview,
        first_byte: int,
    ) -> None:  # fmt: skip
        """Fill `buffer` with input `source`'s aligned rows of tensor `name` from `first_byte`."""
        # numpy: imported by the first computed tensor, never by planning
        from engine.vocabulary.rows import read_aligned

        read_aligned(self, checkpoints, source, name, buffer, first_byte)


def _computed(tensor: TensorPlan) -> Op:
    return "linear" if tensor.op == "copy" else tensor.op


def vocabulary_tensors(checkpoint: Checkpoint) -> tuple[int, list[str]]:
    """(rows, names) of a checkpoint's tensors indexed by token id: the weights and biases of
    its family's embedding and head modules (architectures.FAMILIES) outside the layer stack,
    with config.json's `vocab_size` rows. A RecipeError naming tokenizer_source if none."""
    modules = vocabulary_modules(checkpoint.config)
    stack = checkpoint.layer_stack
    configured = checkpoint.text_config.get("vocab_size")
    names, rows = [], set()
    for name, info in sorted(checkpoint.tensors.items()):
        *path, leaf = name.split(".")
        if not path or path[-1] not in modules or leaf not in ("weight", "bias"):
            continue
        if isinstance(stack, LayerStack) and stack.layer_of(name) is not None:
            continue
        if len(info.shape) not in (1, 2) or (
            isinstance(configured, int) and info.shape[0] != configured
        ):
            continue
        names.append(name)
        rows.add(info.shape[0])
    if len(rows) != 1:
        found = f"rows {sorted(rows)} in {names}" if names else "none"
        raise RecipeError.for_field(
            FIELD,
            f"{checkpoint.path}: no single embedding row count to align (looked for "
            f"{'/'.join(sorted(modules))} weights with config vocab_size "
            f"{configured!r} rows; found {found})",
        )
    return rows.pop(), names


def plan_vocabulary(
    source: str,
    refs: Sequence[InputRef],
    checkpoints: Sequence[Checkpoint],
    *,
    base: int | None,
    tokens: Mapping[str, TokenFill] | None = None,
    pad_to_multiple_of: int | None = None,
) -> VocabularyPlan:
    """Align the inputs' vocabularies as `source` asks; `base` is the input whose row fills a
    token others lack when it has it (None: the recipe has none); `tokens` and
    `pad_to_multiple_of` as the recipe's (configured.py, and the padding rows)."""
    start = _source_input(source, refs, base)
    found = [vocabulary_tensors(c) for c in checkpoints]
    input_rows = [rows for rows, _ in found]
    read = [
        read_tokenizer(Path(ref.path), field=FIELD, label=ref.label, opener=checkpoint.opener)
        for ref, checkpoint in zip(refs, checkpoints, strict=True)
    ]
    vocabularies = [v.below(rows) for v, rows in zip(read, input_rows, strict=True)]
    output = vocabularies[start].in_id_order(FIELD, refs[start].label)
    appended: list[dict[str, Any]] = []
    if source == UNION:
        order = [start, *(i for i in range(len(refs)) if i != start)]
        appended = _union(output, [vocabularies[i] for i in order])
    add_tokens(output, appended, tokens or {})
    rows, missing = _row_maps(output, vocabularies)
    fill = _fill(rows, missing, base, skip={i for i, t in enumerate(output) if t in (tokens or {})})
    forced, fill_row = configure_fill(tokens or {}, output, refs, read, input_rows, rows, fill)
    padding = -len(output) % pad_to_multiple_of if pad_to_multiple_of else 0
    names = found[0][1]
    _check_averaged(checkpoints[0], names, MEAN in fill, padding)
    return VocabularyPlan(
        source=source,
        tokenizer_input=start,
        tokens=output,
        appended=appended,
        dropped=len(read[start].ids) - len(vocabularies[start].ids),
        tensors=frozenset(names),
        input_rows=input_rows,
        rows=rows,
        fill=fill,
        donors=[_donors(rows, fill, lacking, forced) for lacking in missing],
        forced=forced,
        fill_row=fill_row,
        padding=padding,
    )


def _check_averaged(checkpoint: Checkpoint, names: list[str], mean: bool, padding: int) -> None:
    """Rows are averaged (a token several inputs have, padding rows) only in float dtypes, and
    padding only in 2-D tensors (torch sums a 1-D one in another order)."""
    dtype = checkpoint.tensors[names[0]].dtype
    if (mean or padding) and dtype not in AVERAGED_DTYPES:
        raise RecipeError.for_field(
            FIELD if mean else "pad_to_multiple_of", f"{names[0]} is {dtype}: rows of several "
            f"inputs are averaged only in {', '.join(sorted(AVERAGED_DTYPES))}",
        )  # fmt: skip
    flat = [n for n in names if len(checkpoint.tensors[n].shape) != 2]
    if padding and flat:
        raise RecipeError.for_field(
            "pad_to_multiple_of", f"{flat[0]} is one-dimensional: padding rows are computed "
            "only for two-dimensional embedding and head weights",
        )  # fmt: skip


def _source_input(source: str, refs: Sequence[InputRef], base: int | None) -> int:
    """The input whose tokenizer the output's starts from."""
    if source in (BASE, UNION):
        return base if base is not None else 0  # as mergekit: the first model without a base
    name = source.removeprefix(MODEL_PREFIX)
    for i, ref in enumerate(refs):
        if ref.source == name:
            return i
    sources = ", ".join(repr(r.source) for r in refs)
    raise RecipeError.for_field(
        FIELD, f"{source!r} is not base, union or one of the recipe's inputs ({sources})"
    )


def _union(tokens: list[str], vocabularies: Sequence[TokenizerVocabulary]) -> list[dict[str, Any]]:
    """Extend `tokens` (the first vocabulary's, by id) with every token new to it, in place;
    the added_tokens entries of the new ones. Model-vocabulary tokens first, then added ones:
    a token added in any input is added with the first such input's settings."""
    known = set(tokens)
    added_anywhere = {t for v in vocabularies for t in v.added}
    new: list[tuple[str, TokenizerVocabulary]] = []
    for vocabulary in vocabularies:
        for token in vocabulary.model_tokens():
            if token not in known and token not in added_anywhere:
                known.add(token)
                new.append((token, vocabulary))
    for vocabulary in vocabularies:
        for token in vocabulary.added_tokens():
            if token not in known:
                known.add(token)
                new.append((token, vocabulary))
    entries = []
    for token, vocabulary in new:
        entries.append(new_entry(token, vocabulary, len(tokens)))
        tokens.append(token)
    return entries


def _row_maps(
    tokens: list[str], vocabularies: Sequence[TokenizerVocabulary]
) -> tuple[list[array[int]], list[list[int]]]:
    """Per input: its row for each output token (-1: it lacks it), and the tokens it lacks."""
    rows, missing = [], []
    for vocabulary in vocabularies:
        ids = vocabulary.ids
        mapped = array("q", (ids.get(t, -1) for t in tokens))
        rows.append(mapped)
        missing.append([t for t, r in enumerate(mapped) if r < 0])
    return rows, missing


def _fill(
    rows: list[array[int]], missing: list[list[int]], base: int | None, skip: set[int]
) -> array[int]:
    """Per output token, whose row an input lacking it reads (mergekit's default rule; the
    tokens in `skip`, a `tokens` entry's, take theirs from configured.py)."""
    fill = array("q", [EVERY]) * len(rows[0])
    for t in sorted({t for lacking in missing for t in lacking} - skip):
        present = [i for i, r in enumerate(rows) if r[t] >= 0]
        if len(present) == 1:
            fill[t] = present[0]
        elif base is not None and rows[base][t] >= 0:
            fill[t] = base
        else:
            fill[t] = MEAN
    return fill


def _donors(
    rows: list[array[int]], fill: array[int], lacking: list[int], forced: array[int]
) -> frozenset[int]:
    """The inputs read for the tokens an input lacks and the forced ones."""
    donors = {fill[t] for t, f in enumerate(forced) if f and fill[t] >= 0}
    for t in lacking:
        if fill[t] >= 0:
            donors.add(fill[t])
        else:
            donors.update(i for i, r in enumerate(rows) if r[t] >= 0)
    return frozenset(donors)
