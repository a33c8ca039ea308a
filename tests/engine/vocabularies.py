"""Tiny Llama checkpoints whose vocabularies differ, saved by transformers, and a reference
for the rows a vocabulary-aligned merge gives each token (plain torch, no engine).

`make_chat_family`: a base with the tiny BPE tokenizer of worker.examples (256 tokens, 256
rows); `chat`, a fine-tune that added four chat tokens (260 rows); `tool`, one that added a
plain token and two special ones, one of them also chat's (259 rows); `chat2`, one that added
the first two chat tokens (258 rows: <|im_start|> is in three fine-tunes, <|im_end|> in two);
`padded`, the base's 256 tokens in 272 rows. `make_word_family`: WordLevel tokenizers whose
model vocabularies differ and number shared words differently, so rows move and some tokens
are in two of three inputs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CHAT_TOKENS = ("<|im_start|>", "<|im_end|>", "<|user|>", "<|assistant|>")
TOOL_PLAIN = ("zzq",)
TOOL_SPECIAL = ("<|im_start|>", "<tool>")
PADDED_ROWS = 272
WORDS = {
    "base": ["<unk>", "a", "b", "c", "d"],
    "left": ["<unk>", "a", "c", "e", "f", "g"],  # lacks b, d; c moved; e in right too
    "right": ["<unk>", "e", "c", "b"],  # lacks a, d; b shared with base only
}


@dataclass(frozen=True)
class ChatFamily:
    base: Path
    chat: Path
    tool: Path
    chat2: Path
    padded: Path


def make_chat_family(
    root: Path, *, dtype: torch.dtype, tie: bool = False, seed: int = 0
) -> ChatFamily:
    from worker.examples import make_checkpoint

    base = make_checkpoint(
        root / "base", arch="llama", layers=2, dtype=dtype, seed=seed, tie_embeddings=tie
    )
    return ChatFamily(
        base,
        _extend(base, root / "chat", dtype, seed + 1, special=CHAT_TOKENS),
        _extend(base, root / "tool", dtype, seed + 2, plain=TOOL_PLAIN, special=TOOL_SPECIAL),
        _extend(base, root / "chat2", dtype, seed + 4, special=CHAT_TOKENS[:2]),
        _extend(base, root / "padded", dtype, seed + 3, rows=PADDED_ROWS),
    )


def _extend(
    base: Path, out: Path, dtype: torch.dtype, seed: int, *, plain: Sequence[str] = (),
    special: Sequence[str] = (), rows: int | None = None,
) -> Path:  # fmt: skip
    """A fine-tune of `base` that added tokens (its embedding resized to hold them, or to
    `rows`), every weight moved by seeded noise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base))
    tokenizer.add_tokens(list(plain))
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    with torch.random.fork_rng(devices=[]):  # new rows are initialised from the global RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=dtype)
        model.resize_token_embeddings(rows or len(tokenizer), mean_resizing=False)
        with torch.no_grad():
            for param in model.parameters():
                noise = torch.randn(param.shape) * 0.05 * float(param.float().std() or 0.02)
                param.copy_((param.float() + noise).to(param.dtype))
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def make_word_family(root: Path, *, dtype: torch.dtype, seed: int = 40) -> dict[str, Path]:
    """base, left and right: tiny Llamas with WordLevel tokenizers numbering WORDS."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    paths = {}
    for i, (name, words) in enumerate(WORDS.items()):
        word_level = Tokenizer(models.WordLevel({w: k for k, w in enumerate(words)}, "<unk>"))
        word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="<unk>")
        config = LlamaConfig(
            vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )  # fmt: skip
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + i)
            model = AutoModelForCausalLM.from_config(config).to(dtype)
        paths[name] = root / name
        model.save_pretrained(str(paths[name]))
        tokenizer.save_pretrained(str(paths[name]))
    return paths


# -- the reference --------------------------------------------------------------------------
def vocabulary(directory: Path) -> dict[str, int]:
    """token -> id from tokenizer.json (model vocabulary and added tokens), only the ids below
    config.json's vocab_size (those the embedding holds)."""
    data = json.loads((directory / "tokenizer.json").read_text())
    rows = json.loads((directory / "config.json").read_text())["vocab_size"]
    ids: dict[str, int] = dict(data["model"]["vocab"])
    ids.update({entry["content"]: entry["id"] for entry in data["added_tokens"]})
    return {token: i for token, i in ids.items() if i < rows}


def aligned(
    output: dict[str, int],
    vocabularies: Sequence[dict[str, int]],
    tensors: Sequence[torch.Tensor],
    *,
    base: int | None,
) -> list[torch.Tensor]:
    """Each input's tensor with one row per output token: its own row; for a token it lacks,
    the row of the one input that has it, else the base's if the base has it, else the mean of
    the inputs that have it, computed in the tensor's dtype as torch does it from zero (the
    docs' rule, mergekit's default)."""
    size = len(output)
    assert sorted(output.values()) == list(range(size))
    results = []
    for vocab, tensor in zip(vocabularies, tensors, strict=True):
        rows = torch.zeros((size, *tensor.shape[1:]), dtype=tensor.dtype)
        for token, i in output.items():
            rows[i] = (
                tensor[vocab[token]]
                if token in vocab
                else _fill(token, vocabularies, tensors, base)
            )
        results.append(rows)
    return results


def _fill(
    token: str,
    vocabularies: Sequence[dict[str, int]],
    tensors: Sequence[torch.Tensor],
    base: int | None,
) -> torch.Tensor:
    present = [j for j, v in enumerate(vocabularies) if token in v]
    assert present, token
    if len(present) == 1:
        return tensors[present[0]][vocabularies[present[0]][token]]
    if base is not None and base in present:
        return tensors[base][vocabularies[base][token]]
    total = torch.zeros(tensors[0].shape[1:], dtype=tensors[0].dtype)
    for j in present:
        total = total + tensors[j][vocabularies[j][token]]
    return total / len(present)


def embedding_names(tensors: dict[str, Any]) -> list[str]:
    return [n for n in ("model.embed_tokens.weight", "lm_head.weight") if n in tensors]
