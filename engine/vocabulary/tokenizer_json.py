"""tokenizer.json: read for the vocabulary it numbers, and written for a merged vocabulary.

Only the fast tokenizers' one-file format is read: `model.vocab` (token -> id, or Unigram's
list whose index is the id) and `added_tokens`. A merged tokenizer is one input's file with the
tokens past that input's embedding rows removed and the new tokens appended as added tokens,
so its normaliser, pre-tokeniser, post-processor and special tokens stay that input's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import CheckpointError, RecipeError
from engine.io.checkpoint import read_json
from engine.io.file_access import Opener, copy_file, open_file
from engine.limits import MAX_SIDE_FILE_BYTES, MAX_TOKENIZER_BYTES, MAX_VOCABULARY

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# Copied beside a rewritten tokenizer.json. The slow tokenizers' files (tokenizer.model,
# vocab.json, merges.txt, added_tokens.json) number the input's vocabulary, not the output's,
# so they are left out: transformers then loads the fast tokenizer from tokenizer.json.
COPIED_BESIDE = ("chat_template.jinja",)
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
_SPECIAL_LISTS = ("additional_special_tokens", "extra_special_tokens")
_ENTRY_KEYS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


@dataclass(frozen=True)
class TokenizerVocabulary:
    """One tokenizer's tokens: each token (of the model's vocabulary or added) with its id."""

    path: Path
    ids: dict[str, int]
    added: dict[str, dict[str, Any]]  # added_tokens entries by content

    def below(self, rows: int) -> TokenizerVocabulary:
        """The tokens an embedding of `rows` rows holds (ids past it have no row)."""
        if all(i < rows for i in self.ids.values()):
            return self
        added = {t: e for t, e in self.added.items() if e["id"] < rows}
        return TokenizerVocabulary(
            self.path, {t: i for t, i in self.ids.items() if i < rows}, added
        )

    def in_id_order(self, field: str, label: str) -> list[str]:
        """The tokens by id; refused unless the ids are exactly 0..n-1 (each row one token)."""
        tokens: list[str | None] = [None] * len(self.ids)
        for token, i in self.ids.items():
            if i >= len(tokens) or tokens[i] is not None:
                raise RecipeError.for_field(
                    field,
                    f"the tokenizer of {label} ({self.path}) does not number its "
                    f"{len(self.ids)} tokens 0..{len(self.ids) - 1} (id {i}: {token!r}); "
                    "an output vocabulary needs one token per row",
                )
            tokens[i] = token
        return [t for t in tokens if t is not None]

    def model_tokens(self) -> list[str]:
        """The tokens that are not added tokens, by id."""
        return sorted((t for t in self.ids if t not in self.added), key=self.ids.__getitem__)

    def added_tokens(self) -> list[str]:
        return sorted(self.added, key=lambda t: self.added[t]["id"])


def read_tokenizer(
    directory: Path, *, field: str, label: str, opener: Opener = open_file
) -> TokenizerVocabulary:
    """The vocabulary of `directory`'s tokenizer.json (read through `opener`, the checkpoint's);
    a RecipeError naming `field` when there is none, a CheckpointError naming the file when it
    is malformed."""
    path = directory / TOKENIZER_JSON
    if not path.is_file():
        raise RecipeError.for_field(
            field,
            f"{label} has no {TOKENIZER_JSON} ({directory}): aligning vocabularies reads every "
            "input's fast tokenizer (transformers writes one with "
            "AutoTokenizer.from_pretrained(dir).save_pretrained(dir))",
        )
    data = read_json(path, MAX_TOKENIZER_BYTES, opener=opener)
    model = data.get("model") if isinstance(data, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, list):  # Unigram: [token, score] pairs, the index is the id
        vocab = {e[0]: i for i, e in enumerate(vocab) if isinstance(e, list) and e}
    if not isinstance(vocab, dict) or not all(
        isinstance(t, str) and _is_id(i) for t, i in vocab.items()
    ):
        raise CheckpointError.at(path, "model.vocab must map tokens to ids (or list them)")
    ids = dict(vocab)
    added: dict[str, dict[str, Any]] = {}
    for entry in data.get("added_tokens") or []:
        if not (isinstance(entry, dict) and isinstance(entry.get("content"), str)
                and _is_id(entry.get("id"))):  # fmt: skip
            raise CheckpointError.at(path, "added_tokens entries need a content and an id")
        added[entry["content"]] = entry
        ids[entry["content"]] = entry["id"]
    if len(ids) > MAX_VOCABULARY:
        raise CheckpointError.at(path, f"{len(ids)} tokens; at most {MAX_VOCABULARY}")
    return TokenizerVocabulary(path, ids, added)


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_VOCABULARY


def new_entry(token: str, vocabulary: TokenizerVocabulary, new_id: int) -> dict[str, Any]:
    """The added_tokens entry a token new to the output gets: its own entry where it was an
    added token, else a plain one (plain_entry)."""
    found = vocabulary.added.get(token)
    if found is None:
        return plain_entry(token, new_id)
    return {"id": new_id, **{k: found[k] for k in _ENTRY_KEYS if k in found}}


def plain_entry(token: str, new_id: int) -> dict[str, Any]:
    """The added_tokens entry of a string added as transformers' add_tokens adds it: normalised,
    not special."""
    return {
        "id": new_id, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
        "normalized": True, "special": False,
    }  # fmt: skip


def write_tokenizer(
    source: Path, out: Path, *, rows: int, appended: Sequence[dict[str, Any]], tokens: list[str],
    opener: Opener = open_file,
) -> list[str]:  # fmt: skip
    """Write the merged tokenizer into `out` from `source`'s: its tokenizer.json without the
    ids from `rows` on, with `appended` added; its tokenizer_config.json with the added
    tokens it lists made the output's (special_tokens_map.json too, see _edit_config).
    Checked by loading it: it must number `tokens` (the
    output's, by id) exactly. `source`'s files are read through `opener`. Returns the names
    written."""
    data = read_json(source / TOKENIZER_JSON, MAX_TOKENIZER_BYTES, opener=opener)
    _drop_from(data, rows)
    data["added_tokens"] = [*data.get("added_tokens", []), *appended]
    text = json.dumps(data, ensure_ascii=False, indent=2)
    _check_numbering(text, tokens, source / TOKENIZER_JSON)
    (out / TOKENIZER_JSON).write_text(text, encoding="utf-8")
    written = [TOKENIZER_JSON]
    kept = set(tokens)
    for name in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP):
        if (source / name).is_file():
            config = read_json(source / name, opener=opener)
            if isinstance(config, dict):
                _edit_config(config, data["added_tokens"], kept)
            text = json.dumps(config, ensure_ascii=False, indent=2) + "\n"
            (out / name).write_text(text, encoding="utf-8")
            written.append(name)
    for name in COPIED_BESIDE:
        if (source / name).is_file():
            copy_file(source / name, out / name, MAX_SIDE_FILE_BYTES, opener)
            written.append(name)
    return written


def _edit_config(config: dict[str, Any], added: list[dict[str, Any]], kept: set[str]) -> None:
    """A tokenizer config made the output's: the added tokens it lists (transformers 4 does)
    are the output's, and its lists of extra special tokens hold only tokens the output has
    (transformers would add a missing one as a new token, past the embedding's rows)."""
    if isinstance(config.get("added_tokens_decoder"), dict):
        config["added_tokens_decoder"] = {
            str(e["id"]): {k: e[k] for k in _ENTRY_KEYS if k in e} for e in added
        }
    for key in _SPECIAL_LISTS:
        value = config.get(key)
        if isinstance(value, list):
            config[key] = [v for v in value if _content(v) in kept]
        elif isinstance(value, dict):
            config[key] = {k: v for k, v in value.items() if _content(v) in kept}


def _content(value: Any) -> Any:
    return value.get("content") if isinstance(value, dict) else value


def _drop_from(data: dict[str, Any], rows: int) -> None:
    """Remove the tokens numbered `rows` or more (no embedding row holds them), and the BPE
    merges that make or use them, as mergekit strips its base tokenizer."""
    model = data["model"]
    vocab = model["vocab"]
    if isinstance(vocab, list):
        gone = {e[0] for e in vocab[rows:]}
        model["vocab"] = vocab[:rows]
    else:
        gone = {t for t, i in vocab.items() if i >= rows}
        model["vocab"] = {t: i for t, i in vocab.items() if i < rows}
    gone |= {e["content"] for e in data.get("added_tokens", []) if e["id"] >= rows}
    data["added_tokens"] = [e for e in data.get("added_tokens", []) if e["id"] < rows]
    if gone and isinstance(model.get("merges"), list):
        model["merges"] = [m for m in model["merges"] if not _merge_uses(m, gone)]


def _merge_uses(merge: Any, gone: set[str]) -> bool:
    parts = merge.split(" ") if isinstance(merge, str) else list(merge)
    return any(p in gone for p in parts) or "".join(parts) in gone


def _check_numbering(text: str, tokens: list[str], source: Path) -> None:
    """Load the written tokenizer as transformers will (tokenizers: imported only when a merged
    tokenizer is written) and hold its numbering to the output's embedding rows."""
    # tokenizers: heavy; loaded only when a merged tokenizer is written
    from tokenizers import Tokenizer

    try:
        loaded = Tokenizer.from_str(text).get_vocab(with_added_tokens=True)
    except Exception as e:  # the library's own error types are not exported
        raise CheckpointError.at(source, f"the merged tokenizer does not load: {e}") from None
    expected = {token: i for i, token in enumerate(tokens)}
    if loaded != expected:
        wrong = sorted(
            t for t in expected.keys() | loaded.keys() if loaded.get(t) != expected.get(t)
        )
        raise CheckpointError.at(
            source,
            f"the merged tokenizer numbers {len(loaded)} tokens, {len(wrong)} not as the "
            f"embedding rows do (e.g. {wrong[:3]})",
        )
