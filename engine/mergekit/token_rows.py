"""mergekit's `tokenizer.tokens` and `tokenizer.pad_to_multiple_of` as the recipe's `tokens` and
`pad_to_multiple_of` (engine/vocabulary/configured.py, rows.py), with mergekit 0.1.5's meaning.

A token's source names a model as mergekit does (engine/mergekit/config.py model_source); it
must be one of the merged models, whose rows mergekit reads. An entry without a source is
refused: mergekit fails on it wherever a model lacks the token or `force` is set, and it
changes nothing otherwise. A pad_to_multiple_of of 0 (or null) pads nothing, as in mergekit.
"""

from __future__ import annotations

from typing import Any

from engine.errors import RecipeError
from engine.mergekit.config import IsLocal, mapping, model_source

_ENTRY = {"source", "force"}
_MODEL_TOKEN = {"kind", "model", "token", "token_id"}


def translate_tokens(block: dict[str, Any], inputs: list[str], is_local: IsLocal) -> dict[str, Any]:
    """The recipe's `tokens` and `pad_to_multiple_of` from a mergekit `tokenizer` block
    (those it sets); `inputs` are the recipe's sources."""
    found: dict[str, Any] = {}
    tokens = block.get("tokens")
    if tokens:
        found["tokens"] = {
            token: _entry(value, f"tokenizer.tokens.{token}", inputs, is_local)
            for token, value in mapping(tokens, "tokenizer.tokens").items()
        }
    pad = block.get("pad_to_multiple_of")
    if pad is not None and (not isinstance(pad, int) or isinstance(pad, bool) or pad < 0):
        raise RecipeError.for_field(
            "tokenizer.pad_to_multiple_of", f"must be a whole number, at least 1 (got {pad!r})"
        )
    if pad:
        found["pad_to_multiple_of"] = pad
    return found


def _entry(value: Any, field: str, inputs: list[str], is_local: IsLocal) -> dict[str, Any]:
    entry = mapping(value, field)
    if unknown := set(entry) - _ENTRY:
        raise RecipeError.for_field(f"{field}.{sorted(unknown)[0]}", "unknown field")
    force = entry.get("force", False)
    if not isinstance(force, bool):
        raise RecipeError.for_field(f"{field}.force", f"must be true or false (got {force!r})")
    source = entry.get("source")
    if source is None:
        raise RecipeError.for_field(
            f"{field}.source", "required: mergekit has no row for the token without one"
        )
    return {"source": _source(source, f"{field}.source", inputs, is_local), "force": force}


def _source(source: Any, field: str, inputs: list[str], is_local: IsLocal) -> Any:
    kind = source.get("kind") if isinstance(source, dict) else None
    if kind == "zero":
        if len(source) > 1:
            raise RecipeError.for_field(field, "{kind: zero} takes no other field")
        return {"kind": "zero"}
    if kind != "model_token":
        return _merged(model_source(source, field, is_local), field, inputs)
    if unknown := set(source) - _MODEL_TOKEN:
        raise RecipeError.for_field(f"{field}.{sorted(unknown)[0]}", "unknown field")
    if (source.get("token") is None) == (source.get("token_id") is None):
        raise RecipeError.for_field(field, "give token or token_id (one of them)")
    model = model_source(source.get("model"), f"{field}.model", is_local)
    found: dict[str, Any] = {
        "kind": "model_token",
        "model": _merged(model, f"{field}.model", inputs),
    }
    if source.get("token") is not None:
        found["token"] = _text(source["token"], f"{field}.token")
    else:
        found["token_id"] = _whole(source["token_id"], f"{field}.token_id")
    return found


def _merged(source: str, field: str, inputs: list[str]) -> str:
    if source not in inputs:
        raise RecipeError.for_field(field, f"{source} is not one of the merged models")
    return source


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise RecipeError.for_field(field, f"must be a token (got {value!r})")
    return value


def _whole(value: Any, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RecipeError.for_field(field, f"must be a token id, at least 0 (got {value!r})")
    return value
