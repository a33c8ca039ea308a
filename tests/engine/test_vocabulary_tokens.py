"""`tokens` and `pad_to_multiple_of` (mergekit's tokenizer.tokens and pad_to_multiple_of) against
mergekit 0.1.5: a linear merge of a base and two fine-tunes that added chat tokens
(tests/engine/vocabularies.py), merged by mergekit-yaml and by `layerswap merge` from the same
config; every output file is compared (tensors bit for bit, config.json and the tokenizer files
parsed). The union's new tokens come in one order whichever model mergekit's set yields first
(chat2's are chat's first two), so token ids, and so the padding rows' means, are comparable.

The configured tokens cover each kind of source: a model (<|im_start|>, which the base lacks and
both fine-tunes have: the default would be their mean), zeros (<|im_end|>), a model's row of
another token by content (<|user|>) and by id (<|assistant|>, forced), a token every input has,
forced (`3`) and not (`.`), and tokens no input has (<|new|>, <|void|>).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.errors import RecipeError
from engine.kernels.row_cascade import RowSum
from engine.mergekit import translate
from engine.recipe import parse_recipe
from tests.engine.mergekit_parity import run_mergekit
from tests.engine.test_mergekit_outputs import assert_same_files, assert_same_tensors, merge_both
from tests.engine.vocabularies import ChatFamily, make_chat_family
from tests.reference import load

WEIGHTS = {"base": 0.5, "chat": 0.3, "chat2": 0.2}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(scope="module", params=list(DTYPES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ChatFamily:
    root = tmp_path_factory.mktemp(f"tokens-{request.param}")
    return make_chat_family(root, dtype=DTYPES[request.param], seed=21)


def union_tokens(f: ChatFamily) -> dict[str, Any]:
    return {
        "<|im_start|>": {"source": str(f.chat2)},
        "<|im_end|>": {"source": {"kind": "zero"}},
        "<|user|>": {"source": {"kind": "model_token", "model": str(f.base), "token": "<s>"}},
        "<|assistant|>": {
            "source": {"kind": "model_token", "model": str(f.chat2), "token_id": 7},
            "force": True,
        },
        "3": {"source": str(f.chat), "force": True},
        ".": {"source": str(f.chat2), "force": False},
        "<|new|>": {
            "source": {"kind": "model_token", "model": str(f.chat), "token": "<|assistant|>"}
        },
        "<|void|>": {"source": {"kind": "zero"}, "force": True},
    }


def base_tokens(f: ChatFamily) -> dict[str, Any]:
    """With `source: base` mergekit fails on a token the base lacks: these it has."""
    return {
        "3": {"source": str(f.chat), "force": True},
        "<s>": {"source": {"kind": "zero"}, "force": True},
        "+": {"source": {"kind": "model_token", "model": str(f.chat2), "token_id": 9},
              "force": True},
        ".": {"source": str(f.chat2)},
    }  # fmt: skip


def config(f: ChatFamily, tokenizer: dict[str, Any]) -> dict[str, Any]:
    dtype = "float32" if load(f.base)["lm_head.weight"].dtype == torch.float32 else "bfloat16"
    return {
        "merge_method": "linear",
        "base_model": str(f.base),
        "models": [{"model": str(getattr(f, m)), "parameters": {"weight": w}}
                   for m, w in WEIGHTS.items()],
        "dtype": dtype,
        "out_dtype": dtype,
        "tokenizer": tokenizer,
    }  # fmt: skip


def assert_same_output(ours: Path, theirs: Path, mergekit_config: dict[str, Any]) -> None:
    assert_same_files(ours, theirs)
    assert_same_tensors(ours, theirs, mergekit_config)


def test_union_with_tokens_and_padding_equals_mergekit(family: ChatFamily, tmp_path: Path) -> None:
    tokenizer = {"source": "union", "tokens": union_tokens(family), "pad_to_multiple_of": 64}
    mergekit_config = config(family, tokenizer)
    ours, theirs, _ = merge_both(mergekit_config, tmp_path)
    assert_same_output(ours, theirs, mergekit_config)
    assert json.loads((ours / "config.json").read_text())["vocab_size"] == 320  # 262 tokens
    added = json.loads((ours / "tokenizer.json").read_text())["added_tokens"]
    plain = {e["content"]: e for e in added if e["id"] >= 260}
    assert list(plain) == ["<|new|>", "<|void|>"] and not plain["<|new|>"]["special"]
    embed = load(ours)["model.embed_tokens.weight"]
    assert not embed[261].any() and embed[262:].eq(embed[262]).all() and embed[262].any()


def test_base_with_tokens_and_padding_equals_mergekit(family: ChatFamily, tmp_path: Path) -> None:
    tokenizer = {"source": "base", "tokens": base_tokens(family), "pad_to_multiple_of": 48}
    mergekit_config = config(family, tokenizer)
    ours, theirs, _ = merge_both(mergekit_config, tmp_path)
    assert_same_output(ours, theirs, mergekit_config)
    assert json.loads((ours / "config.json").read_text())["vocab_size"] == 288  # 256 tokens


def test_padding_alone_equals_mergekit(family: ChatFamily, tmp_path: Path) -> None:
    """Padding with the default rows: <|im_start|> and <|im_end|> the mean of the fine-tunes'."""
    mergekit_config = config(family, {"source": "union", "pad_to_multiple_of": 100})
    ours, theirs, _ = merge_both(mergekit_config, tmp_path)
    assert_same_output(ours, theirs, mergekit_config)
    assert json.loads((ours / "config.json").read_text())["vocab_size"] == 300


def test_a_native_recipe_gives_mergekits_output(
    family: ChatFamily, run_merge: Any, tmp_path: Path
) -> None:
    models = [family.base, family.chat, family.chat2]
    ours = Path(run_merge({
        "method": "linear", "base": family.base, "models": models,
        "params": {"weights": list(WEIGHTS.values())}, "tokenizer_source": "union",
        "tokens": union_tokens(family), "pad_to_multiple_of": 64,
    }).out_dir)  # fmt: skip
    tokenizer = {"source": "union", "tokens": union_tokens(family), "pad_to_multiple_of": 64}
    mergekit_config = config(family, tokenizer)
    theirs = run_mergekit(mergekit_config, tmp_path / "mergekit")
    assert_same_tensors(ours, theirs, mergekit_config)
    for name in ("tokenizer.json", "config.json"):
        mine, reference = (json.loads((d / name).read_text()) for d in (ours, theirs))
        if name == "config.json":
            assert mine["vocab_size"] == reference["vocab_size"] == 320
        else:
            assert mine == reference


# -- refused ------------------------------------------------------------------------------------
def test_the_translation_carries_the_fields(family: ChatFamily) -> None:
    tokenizer = {"source": "union", "tokens": union_tokens(family), "pad_to_multiple_of": 64}
    recipe = translated(config(family, tokenizer)).recipe
    assert recipe.pad_to_multiple_of == 64 and recipe.tokens is not None
    assert set(recipe.tokens) == set(union_tokens(family))
    assert recipe.tokens["<|assistant|>"].force
    zero = config(family, {"source": "union", "pad_to_multiple_of": 0})
    assert translated(zero).recipe.pad_to_multiple_of is None  # mergekit: no padding


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"pad_to_multiple_of": -8}, "tokenizer.pad_to_multiple_of"),
        ({"pad_to_multiple_of": "8"}, "tokenizer.pad_to_multiple_of"),
        ({"tokens": {"x": {"source": "/nowhere/else"}}}, "tokenizer.tokens.x.source"),
        ({"tokens": {"x": {"force": True}}}, "tokenizer.tokens.x.source"),
        ({"tokens": {"x": {"source": {"kind": "model_token", "model": "/nowhere"}}}},
         "tokenizer.tokens.x.source"),
        ({"tokens": {"x": {"source": {"kind": "zero"}, "weight": 1}}}, "tokenizer.tokens.x.weight"),
    ],
)  # fmt: skip
def test_the_translation_refuses_bad_tokens(
    family: ChatFamily, edit: dict[str, Any], field: str
) -> None:
    with pytest.raises(RecipeError) as raised:
        translated(config(family, {"source": "union", **edit}))
    assert raised.value.details["field"] == field


def test_a_token_absent_from_the_base_with_source_base_is_said(family: ChatFamily) -> None:
    tokens = {"<|new|>": {"source": {"kind": "zero"}}}
    warnings = translated(config(family, {"source": "base", "tokens": tokens})).origin.warnings
    assert any("mergekit 0.1.5 fails" in w for w in warnings)


@pytest.mark.parametrize("pad", [0, -8])
def test_a_recipe_refuses_padding_below_one(family: ChatFamily, pad: int) -> None:
    with pytest.raises(RecipeError) as raised:
        parse_recipe(native(family, pad_to_multiple_of=pad))
    assert raised.value.details["field"] == "pad_to_multiple_of"


def test_tokens_need_a_tokenizer_source(family: ChatFamily) -> None:
    recipe = native(family, tokens={"x": {"source": {"kind": "zero"}}})
    del recipe["tokenizer_source"]
    with pytest.raises(RecipeError, match="tokenizer_source is required by tokens") as raised:
        parse_recipe(recipe)
    assert raised.value.details["field"] == "tokenizer_source"


@pytest.mark.parametrize(
    ("source", "field", "message"),
    [
        ("/nowhere", "tokens.<xq>.source", "not one of the recipe's inputs"),
        ("chat", "tokens.<xq>.source", "has no '<xq>'"),
        ({"kind": "model_token", "model": "chat", "token": "<absent>"}, "tokens.<xq>.source.token",
         "has no '<absent>'"),
        ({"kind": "model_token", "model": "base", "token": "<|im_start|>"},
         "tokens.<xq>.source.token", "has no '<|im_start|>'"),
        ({"kind": "model_token", "model": "chat2", "token_id": 258}, "tokens.<xq>.source.token_id",
         "past"),
        ({"kind": "model_token", "model": "/nowhere", "token_id": 1}, "tokens.<xq>.source.model",
         "not one of the recipe's inputs"),
    ],
)  # fmt: skip
def test_a_recipe_refuses_a_source_without_the_row(
    family: ChatFamily, run_merge: Any, source: Any, field: str, message: str
) -> None:
    if isinstance(source, dict) and source["model"] != "/nowhere":
        source = {**source, "model": str(getattr(family, source["model"]))}
    elif source == "chat":
        source = str(family.chat)
    with pytest.raises(RecipeError, match=message) as raised:
        run_merge(native(family, tokens={"<xq>": {"source": source}}))
    assert raised.value.details["field"] == field


def native(family: ChatFamily, **fields: Any) -> dict[str, Any]:
    return {
        "method": "linear", "base": str(family.base),
        "models": [str(family.base), str(family.chat), str(family.chat2)],
        "params": {"weights": list(WEIGHTS.values())}, "tokenizer_source": "union", **fields,
    }  # fmt: skip


def translated(mergekit_config: dict[str, Any]) -> Any:
    return translate(mergekit_config, is_local=lambda source: Path(source).is_dir())


# -- torch's mean -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 255, 256, 257, 1000, 4099])
def test_row_sums_are_torchs_mean(dtype: torch.dtype, rows: int) -> None:
    """RowSum fed in uneven blocks, divided and rounded as rows.py does, is torch.mean's."""
    generator = torch.Generator().manual_seed(rows)
    tensor = (torch.randn((rows, 128), generator=generator) * 4).to(dtype)
    tensor[0, :8] = -0.0  # a column that sums to -0.0 from zero gives +0.0
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    total = RowSum(rows, 128, np.float64 if dtype == torch.float64 else np.float32)
    for block in tensor.to(wide).split(37):
        total.add(block.numpy())
    mean = torch.from_numpy(total.total() / total.levels[0].dtype.type(rows)).to(dtype)
    expected = torch.mean(tensor, dim=0)
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16}[expected.element_size()]
    assert torch.equal(mean.view(bits), expected.view(bits))
