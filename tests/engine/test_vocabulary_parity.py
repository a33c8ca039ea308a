"""tokenizer_source against mergekit 0.1.5: a linear merge of a base and two fine-tunes that
added different tokens (tests/engine/vocabularies.py), with `union` and `base`.

mergekit numbers the union's new tokens in the order of a Python set of its models, so tokens
are compared by content: each output token's embedding and head rows must have the same bits
on both sides (the base lacks <|im_start|>, which three fine-tunes have: its row in the base's
aligned embedding is their mean, computed step by step in the checkpoints' dtype by both).
Every other tensor must be bit-identical, and both tokenizers must hold the same tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.mergekit_parity import run_mergekit, ulp_distance
from tests.engine.vocabularies import ChatFamily, embedding_names, make_chat_family, vocabulary
from tests.reference import load

WEIGHTS = (0.4, 0.3, 0.2, 0.1)  # base, chat, tool, chat2


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ChatFamily:
    return make_chat_family(tmp_path_factory.mktemp("vocab-parity"), dtype=request.param, seed=7)


@pytest.mark.parametrize("source", ["union", "base"])
def test_linear_with_tokenizer_source_equals_mergekit(
    family: ChatFamily, source: str, run_merge: Any, tmp_path: Path
) -> None:
    models = [family.base, family.chat, family.tool, family.chat2]
    ours = run_merge({
        "method": "linear", "base": family.base, "models": models,
        "params": {"weights": list(WEIGHTS)}, "tokenizer_source": source,
    }).out_dir  # fmt: skip
    dtype = "float32" if load(family.base)["lm_head.weight"].dtype == torch.float32 else "bfloat16"
    theirs = run_mergekit(
        {
            "merge_method": "linear",
            "base_model": str(family.base),
            "models": [{"model": str(m), "parameters": {"weight": w}}
                       for m, w in zip(models, WEIGHTS, strict=True)],
            "dtype": dtype,
            "out_dtype": dtype,
            "tokenizer_source": source,
        },
        tmp_path / "mergekit",
    )  # fmt: skip
    mine, reference = vocabulary(ours), vocabulary(theirs)
    assert set(mine) == set(reference)
    assert len(mine) == (262 if source == "union" else 256)
    for out in (ours, theirs):
        assert json.loads((out / "config.json").read_text())["vocab_size"] == len(mine)
    ours_t, theirs_t = load(ours), load(theirs)
    assert set(ours_t) == set(theirs_t)
    for name in ours_t:
        if name in embedding_names(ours_t):
            order = sorted(mine)
            a = ours_t[name][[mine[t] for t in order]]
            b = theirs_t[name][[reference[t] for t in order]]
            assert ulp_distance(a, b) == 0, name
        else:
            assert ulp_distance(ours_t[name], theirs_t[name]) == 0, name
