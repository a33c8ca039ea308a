"""A recipe's `tokens` entries: tokens the output's vocabulary gets, and the rows an input that
lacks one (every input, with `force`) reads for it, as mergekit 0.1.5's tokenizer.tokens.

An entry's token is added to the output's tokenizer where absent, as transformers' add_tokens
adds a string (a plain, normalised, not special token), after the union's, in the entries'
order. Its source is one of the recipe's sources (that input's row of the token: it must have
it), {kind: zero}, or {kind: model_token} (a source's row of another token, by content in its
own tokenizer, or by id: below its embedding's row count). An entry's token takes no default
rule: where no input lacks it and it is not forced, every input keeps its own row.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from engine.errors import RecipeError
from engine.plan.model import EVERY, InputRef
from engine.schema.parts import TokenFill, TokenRow, ZeroRow
from engine.vocabulary.fills import FOREIGN_ROW, ZERO
from engine.vocabulary.tokenizer_json import TokenizerVocabulary, plain_entry


def add_tokens(
    tokens: list[str], appended: list[dict[str, Any]], configured: Mapping[str, TokenFill]
) -> None:
    """Append the configured tokens the output lacks to `tokens` and `appended`, in place."""
    known = set(tokens)
    for token in configured:
        if token not in known:
            known.add(token)
            appended.append(plain_entry(token, len(tokens)))
            tokens.append(token)


def configure_fill(
    configured: Mapping[str, TokenFill],
    tokens: list[str],
    refs: Sequence[InputRef],
    read: Sequence[TokenizerVocabulary],
    input_rows: Sequence[int],
    rows: list[array[int]],
    fill: array[int],
) -> tuple[array[int], array[int]]:
    """Set `fill` of the configured tokens in place; (forced, fill_row) per output token
    (fills.FilledVocabulary). `read` is each input's tokenizer as read (before its tokens past
    its rows are left out, as mergekit's original vocabularies)."""
    forced = array("b", bytes(len(tokens)))
    fill_row = array("q", [FOREIGN_ROW]) * len(tokens)
    ids = {token: i for i, token in enumerate(tokens)}
    for token, setting in configured.items():
        t, field = ids[token], f"tokens.{token}.source"
        donor, row = _source_row(setting.source, token, field, refs, read, input_rows, rows, t)
        if setting.force or any(r[t] < 0 for r in rows):
            fill[t], fill_row[t], forced[t] = donor, row, int(setting.force)
        else:
            fill[t] = EVERY
    return forced, fill_row


def _source_row(
    source: str | ZeroRow | TokenRow, token: str, field: str, refs: Sequence[InputRef],
    read: Sequence[TokenizerVocabulary], input_rows: Sequence[int], rows: list[array[int]],
    t: int,
) -> tuple[int, int]:  # fmt: skip
    """(fill, fill_row) of a configured token: ZERO, or the input read and its named row."""
    if isinstance(source, ZeroRow):
        return ZERO, FOREIGN_ROW
    if isinstance(source, str):
        donor = _input_named(source, field, refs)
        if rows[donor][t] < 0:
            raise RecipeError.for_field(
                field, f"{source} has no {token!r} (below its {input_rows[donor]} rows) to give "
                "its row; name a source that has it, or use {kind: model_token}"
            )  # fmt: skip
        return donor, FOREIGN_ROW
    donor = _input_named(source.model, f"{field}.model", refs)
    return donor, _named_row(source, field, read[donor], input_rows[donor])


def _named_row(source: TokenRow, field: str, vocabulary: TokenizerVocabulary, rows: int) -> int:
    if source.token is not None:
        row = vocabulary.ids.get(source.token)
        if row is None:
            raise RecipeError.for_field(
                f"{field}.token",
                f"{source.model}'s tokenizer has no {source.token!r} ({vocabulary.path})",
            )
        where = f"{field}.token"
    else:
        row, where = int(source.token_id or 0), f"{field}.token_id"
    if row >= rows:
        raise RecipeError.for_field(
            where, f"row {row} is past {source.model}'s {rows} embedding rows"
        )
    return row


def _input_named(source: str, field: str, refs: Sequence[InputRef]) -> int:
    for i, ref in enumerate(refs):
        if ref.source == source:
            return i
    sources = ", ".join(repr(r.source) for r in refs)
    raise RecipeError.for_field(field, f"{source!r} is not one of the recipe's inputs ({sources})")
