"""Merging checkpoints whose vocabularies differ (tokenizer_source): every output token's rows
against a plain-torch reference of the documented rule (tests/engine/vocabularies.py), the
merged tokenizer loaded by transformers and numbering the rows, tied and padded embeddings,
every kernel (numpy, numba, torch) reading aligned rows, and the errors that name the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.errors import IncompatibleCheckpointsError, RecipeError
from engine.io.checkpoint import Checkpoint
from engine.vocabulary.alignment import vocabulary_tensors
from tests.engine.families import FAMILY_SPECS, installed, model_class, save_family
from tests.engine.test_interpolation_methods import _slerp
from tests.engine.test_output import assert_forward_pass
from tests.engine.vocabularies import (
    CHAT_TOKENS,
    PADDED_ROWS,
    WORDS,
    ChatFamily,
    aligned,
    embedding_names,
    make_chat_family,
    make_word_family,
    vocabulary,
)
from tests.reference import (
    accumulation_slack,
    assert_equal,
    assert_within_ulps,
    combine,
    load,
    sha256,
    ties,
)


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> ChatFamily:
    return make_chat_family(tmp_path_factory.mktemp("chat"), dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def chat_tied(tmp_path_factory: pytest.TempPathFactory) -> ChatFamily:
    return make_chat_family(tmp_path_factory.mktemp("tied"), dtype=torch.float32, tie=True)


@pytest.fixture(scope="module")
def words(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_word_family(tmp_path_factory.mktemp("words"), dtype=torch.float32)


def _check_rows(
    out_dir: Path, paths: list[Path], base: int | None, expected: Any, terms: list[int]
) -> dict[str, int]:
    """Every tensor of the output against `expected(name, term tensors)`, the embedding and
    head computed on the reference's aligned rows of the inputs `terms`. The output vocabulary."""
    out, output = load(out_dir), vocabulary(out_dir)
    inputs = [load(p) for p in paths]
    vocabularies = [vocabulary(p) for p in paths]
    assert set(out) == set(inputs[0])
    for name in out:
        if name in embedding_names(out):
            rows = aligned(output, vocabularies, [t[name] for t in inputs], base=base)
            assert_equal(out[name], expected(name, [rows[i] for i in terms]), name)
        else:
            assert_equal(out[name], expected(name, [inputs[i][name] for i in terms]), name)
    config = json.loads((out_dir / "config.json").read_text())
    assert config["vocab_size"] == len(output) == out["model.embed_tokens.weight"].shape[0]
    return output


def _soup(name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    return combine([1 / len(tensors)] * len(tensors), tensors).to(tensors[0].dtype)


def _assert_tokenizer_numbers_rows(out_dir: Path, output: dict[str, int], chat: Path) -> None:
    """transformers' tokenizer numbers every token as the rows are; a chat turn splits into
    the tokens chat's own tokenizer gives, and its ids decode as chat's do."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    assert tokenizer.get_vocab() == output
    original = AutoTokenizer.from_pretrained(str(chat))
    text = "<|im_start|>user Habari<|im_end|>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    theirs = original(text, add_special_tokens=False)["input_ids"]
    tokens = original.convert_ids_to_tokens(theirs)
    assert ids == [output[t] for t in tokens]
    assert ids[0] == output["<|im_start|>"] and ids[-1] == output["<|im_end|>"]
    assert tokenizer.decode(ids) == original.decode(theirs)


@pytest.mark.parametrize("chunk_elements", [2 * 1024 * 1024, 200], ids=["default", "part-rows"])
def test_union_soup(chat: ChatFamily, run_merge: Any, chunk_elements: int) -> None:
    recipe = {"method": "soup", "base": chat.base, "models": [chat.chat, chat.tool],
              "tokenizer_source": "union"}  # fmt: skip
    result = run_merge(recipe, chunk_elements=chunk_elements)
    paths = [chat.chat, chat.tool, chat.base]  # plan order: models, then the base
    output = _check_rows(result.out_dir, paths, 2, _soup, [0, 1])
    base = vocabulary(chat.base)
    new = [*CHAT_TOKENS, "zzq", "<tool>"]  # chat's, then tool's not yet there, each by id
    assert output == {**base, **{t: len(base) + i for i, t in enumerate(new)}}
    summary = result.manifest["vocabulary"]
    assert summary["tokenizer_source"] == "union" and summary["size"] == 262
    assert summary["missing"] == [2, 3, 6]  # chat lacks tool's 2 new, tool chat's 3, base all
    assert_forward_pass(result.out_dir)
    _assert_tokenizer_numbers_rows(result.out_dir, output, chat.chat)


def task_arithmetic(
    base: torch.Tensor, models: list[torch.Tensor], weights: list[float], lambda_: float = 1.0
) -> torch.Tensor:
    """base + λ·Σ w_i·(T_i − base) in float32, in that order (as mergekit computes it)."""
    b = base.float()
    total = torch.zeros_like(b)
    for w, t in zip(weights, models, strict=True):
        total = total + w * (t.float() - b)
    return b + lambda_ * total


def test_union_task_arithmetic_averages_where_the_base_lacks_a_token(
    chat: ChatFamily, run_merge: Any
) -> None:
    """The base is a term here, and lacks the chat tokens: its aligned row for <|im_start|>
    is the mean of three fine-tunes' rows, for <|im_end|> of two (computed in bf16)."""
    models = [chat.chat, chat.tool, chat.chat2]
    recipe = {"method": "task_arithmetic", "base": chat.base, "models": models,
              "params": {"weights": [0.7, 0.4, 0.2]}, "tokenizer_source": "union"}  # fmt: skip
    result = run_merge(recipe)

    def expected(name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        *fine_tunes, base_t = tensors
        return task_arithmetic(base_t, fine_tunes, [0.7, 0.4, 0.2]).to(base_t.dtype)

    _check_rows(result.out_dir, [*models, chat.base], 3, expected, [0, 1, 2, 3])
    assert_forward_pass(result.out_dir)


def test_union_ties(chat: ChatFamily, run_merge: Any) -> None:
    recipe = {"method": "ties", "base": chat.base, "models": [chat.chat, chat.tool],
              "params": {"density": 0.5}, "tokenizer_source": "union"}  # fmt: skip
    result = run_merge(recipe)
    paths = [chat.chat, chat.tool, chat.base]
    out, output = load(result.out_dir), vocabulary(result.out_dir)
    inputs, vocabularies = [load(p) for p in paths], [vocabulary(p) for p in paths]
    for name in embedding_names(out):
        rows = aligned(output, vocabularies, [t[name] for t in inputs], base=2)
        reference = ties(rows[2], rows[:2], [1.0, 1.0], density=0.5, lambda_=1.0, normalize=True)
        slack = 4 * torch.finfo(torch.float32).eps * sum(r.float().abs() for r in rows)
        assert_within_ulps(out[name], reference, 1, name, slack)
    assert_forward_pass(result.out_dir)


def test_base_source_keeps_the_base_tokenizer(chat: ChatFamily, run_merge: Any) -> None:
    recipe = {"method": "soup", "base": chat.base, "models": [chat.chat, chat.tool],
              "tokenizer_source": "base"}  # fmt: skip
    result = run_merge(recipe)
    output = _check_rows(result.out_dir, [chat.chat, chat.tool, chat.base], 2, _soup, [0, 1])
    assert output == vocabulary(chat.base) and len(output) == 256
    for name in ("tokenizer.json", "tokenizer_config.json"):  # copied as they are
        assert sha256(result.out_dir / name) == sha256(chat.base / name)
    assert_forward_pass(result.out_dir)


@pytest.mark.parametrize("spelling", ["{}", "model:{}"])
def test_one_input_as_source(chat: ChatFamily, run_merge: Any, spelling: str) -> None:
    recipe = {"method": "soup", "models": [chat.tool, chat.chat],
              "tokenizer_source": spelling.format(chat.chat)}  # fmt: skip
    result = run_merge(recipe)
    output = _check_rows(result.out_dir, [chat.tool, chat.chat], None, _soup, [0, 1])
    assert output == vocabulary(chat.chat) and len(output) == 260
    assert sha256(result.out_dir / "tokenizer.json") == sha256(chat.chat / "tokenizer.json")
    assert result.manifest["vocabulary"]["tokenizer_input"] == 1
    _assert_tokenizer_numbers_rows(result.out_dir, output, chat.chat)


def test_padded_rows_are_left_out(chat: ChatFamily, run_merge: Any) -> None:
    """256 tokens in 272 rows: the output has one row per token, padding rows none."""
    assert load(chat.padded)["model.embed_tokens.weight"].shape[0] == PADDED_ROWS
    union = run_merge({"method": "soup", "models": [chat.padded, chat.chat],
                       "tokenizer_source": "union"})  # fmt: skip
    output = _check_rows(union.out_dir, [chat.padded, chat.chat], None, _soup, [0, 1])
    assert len(output) == 260
    assert_forward_pass(union.out_dir)
    base = run_merge({"method": "soup", "models": [chat.padded, chat.chat],
                      "tokenizer_source": "base"})  # fmt: skip
    output = _check_rows(base.out_dir, [chat.padded, chat.chat], None, _soup, [0, 1])
    assert len(output) == 256
    assert sha256(base.out_dir / "tokenizer.json") == sha256(chat.padded / "tokenizer.json")
    assert_forward_pass(base.out_dir)


def test_tied_embeddings_stay_tied(chat_tied: ChatFamily, run_merge: Any) -> None:
    fam = chat_tied
    result = run_merge({"method": "soup", "base": fam.base, "models": [fam.chat, fam.tool],
                        "tokenizer_source": "union"})  # fmt: skip
    assert "lm_head.weight" not in load(fam.chat)
    _check_rows(result.out_dir, [fam.chat, fam.tool, fam.base], 2, _soup, [0, 1])
    assert "lm_head.weight" not in load(result.out_dir)
    assert json.loads((result.out_dir / "config.json").read_text())["tie_word_embeddings"]
    assert_forward_pass(result.out_dir)  # checks lm_head is the embedding


def test_tokens_past_the_rows_are_dropped(chat: ChatFamily, run_merge: Any, tmp_path: Path) -> None:
    """A tokenizer numbering more tokens than its embedding has rows: those tokens have no
    row, and the output's tokenizer leaves them out."""
    short = tmp_path / "short"
    shutil.copytree(chat.base, short)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(chat.chat / name, short / name)  # 260 tokens, 256 rows
    result = run_merge({"method": "soup", "models": [short, chat.tool],
                        "tokenizer_source": "base"})  # fmt: skip
    output = _check_rows(result.out_dir, [short, chat.tool], None, _soup, [0, 1])
    assert output == vocabulary(chat.base)
    assert result.manifest["vocabulary"]["dropped_tokens"] == len(CHAT_TOKENS)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(result.out_dir)).get_vocab() == output


def test_passthrough_aligns_the_embedding_and_head_it_copies(
    chat: ChatFamily, run_merge: Any
) -> None:
    """passthrough takes the embedding from the first slice's model and the head from the
    last's: each becomes that model's rows aligned to the union (no longer a plain copy)."""
    slices = [(chat.chat, [0, 2]), (chat.tool, [1, 2])]
    recipe = {"method": "passthrough", "models": [chat.chat, chat.tool],
              "params": {"slices": [{"sources": [{"model": m, "layer_range": r}]}
                                    for m, r in slices]},
              "tokenizer_source": "union"}  # fmt: skip
    result = run_merge(recipe)
    out, output = load(result.out_dir), vocabulary(result.out_dir)
    inputs = [load(chat.chat), load(chat.tool)]
    vocabularies = [vocabulary(chat.chat), vocabulary(chat.tool)]
    for name, source in (("model.embed_tokens.weight", 0), ("lm_head.weight", 1)):
        rows = aligned(output, vocabularies, [t[name] for t in inputs], base=None)
        assert_equal(out[name], rows[source], name)
    assert_equal(out["model.layers.2.mlp.up_proj.weight"],
                 inputs[1]["model.layers.1.mlp.up_proj.weight"])  # fmt: skip
    assert_forward_pass(result.out_dir)


def test_magnitude_weights_need_one_vocabulary(chat: ChatFamily, run_merge: Any) -> None:
    with pytest.raises(RecipeError, match="explicit weights") as raised:
        run_merge({"method": "soup", "base": chat.base, "models": [chat.chat, chat.tool],
                   "params": {"weights": "magnitude"}, "tokenizer_source": "union"})  # fmt: skip
    assert raised.value.details["field"] == "params.weights"


# -- WordLevel vocabularies: tokens moved, in two of three inputs, in one ---------------------
def test_word_vocabularies_task_arithmetic(words: dict[str, Path], run_merge: Any) -> None:
    """left lacks b (base and right have it: the base's row) and d (the base's); the base
    lacks e (left and right: their mean) and f, g (left's); c sits at another id in each."""
    recipe = {"method": "task_arithmetic", "base": words["base"],
              "models": [words["left"], words["right"]], "params": {"weights": [0.6, 0.3]},
              "tokenizer_source": "union"}  # fmt: skip
    result = run_merge(recipe)

    def expected(name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        left, right, base = tensors
        return task_arithmetic(base, [left, right], [0.6, 0.3]).to(base.dtype)

    paths = [words["left"], words["right"], words["base"]]
    output = _check_rows(result.out_dir, paths, 2, expected, [0, 1, 2])
    assert list(output) == [*WORDS["base"], "e", "f", "g"]
    assert [output[t] for t in output] == list(range(8))
    assert_forward_pass_words(result.out_dir, output)


def test_word_vocabularies_slerp(words: dict[str, Path], run_merge: Any) -> None:
    """slerp (torch kernels, whole-tensor norms read through the aligned rows); its base for
    the rule is models[0], whose vocabulary the union starts from."""
    recipe = {"method": "slerp", "models": [words["left"], words["right"]],
              "params": {"t": 0.3}, "tokenizer_source": "union"}  # fmt: skip
    result = run_merge(recipe)
    out, output = load(result.out_dir), vocabulary(result.out_dir)
    assert list(output) == [*WORDS["left"], "b"]
    inputs = [load(words["left"]), load(words["right"])]
    vocabularies = [vocabulary(words["left"]), vocabulary(words["right"])]
    for name in embedding_names(out):
        a, b = aligned(output, vocabularies, [t[name] for t in inputs], base=0)
        slack = accumulation_slack([1.0, 1.0], [a, b])
        assert_within_ulps(out[name], _slerp(0.3, a, b).float(), 4, name, slack)


def assert_forward_pass_words(out_dir: Path, output: dict[str, int]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    assert tokenizer.get_vocab() == output
    ids = tokenizer("a e g c", add_special_tokens=False)["input_ids"]
    assert ids == [output[t] for t in "aegc"]
    model = AutoModelForCausalLM.from_pretrained(str(out_dir))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, 4, len(output)) and bool(torch.isfinite(logits).all())


# -- which tensors are indexed by token id, per family --------------------------------------
@pytest.mark.parametrize("family", [f for f in FAMILY_SPECS if installed(f)])
def test_vocabulary_tensors_are_the_embeddings_and_heads(family: str, tmp_path: Path) -> None:
    """By the family table: the saved tensors that hold what transformers loads as the input
    embedding and output head (and the head's bias), never another tensor of vocab_size rows
    (saved names may differ from the loaded ones: gpt_neox's head is saved as embed_out)."""
    saved = save_family(family, tmp_path / family, seed=1)
    model = model_class(FAMILY_SPECS[family].kind).from_pretrained(saved)
    modules = [model.get_input_embeddings(), model.get_output_embeddings()]
    loaded = [m.weight.detach() for m in modules if m is not None]
    files = load(saved)
    weights = {
        name for name, t in files.items()
        if any(t.shape == w.shape and torch.equal(t.float(), w.float()) for w in loaded)
    }  # fmt: skip
    biases = {n.removesuffix("weight") + "bias" for n in weights} & set(files)  # zeros: by name
    expected = weights | biases
    rows, found = vocabulary_tensors(Checkpoint.open(saved))
    assert rows == 64 and expected
    assert set(found) == expected, family


# -- errors ---------------------------------------------------------------------------------
def test_different_vocabularies_need_tokenizer_source(chat: ChatFamily, run_merge: Any) -> None:
    with pytest.raises(IncompatibleCheckpointsError, match="set tokenizer_source"):
        run_merge({"method": "soup", "models": [chat.chat, chat.tool]})


def test_unknown_tokenizer_source_is_refused(chat: ChatFamily, run_merge: Any) -> None:
    with pytest.raises(RecipeError, match="tokenizer_source") as raised:
        run_merge({"method": "soup", "models": [chat.chat, chat.tool],
                   "tokenizer_source": "./elsewhere"})  # fmt: skip
    assert raised.value.details["field"] == "tokenizer_source"


def test_input_without_tokenizer_is_refused(
    chat: ChatFamily, run_merge: Any, tmp_path: Path
) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(chat.tool, bare)
    (bare / "tokenizer.json").unlink()
    with pytest.raises(RecipeError, match=r"models\[1\] has no tokenizer.json") as raised:
        run_merge({"method": "soup", "models": [chat.chat, bare], "tokenizer_source": "union"})
    assert raised.value.details["field"] == "tokenizer_source"


def test_other_tensors_must_still_match(chat: ChatFamily, run_merge: Any, tmp_path: Path) -> None:
    from worker.examples import make_checkpoint

    wider = make_checkpoint(tmp_path / "wider", layers=2, intermediate=96, vocab=260, seed=5)
    with pytest.raises(IncompatibleCheckpointsError) as raised:
        run_merge({"method": "soup", "models": [chat.chat, wider], "tokenizer_source": "union"})
    mismatches = raised.value.details["mismatches"]
    assert mismatches and all("mlp" in m for m in mismatches), mismatches
    assert "model.layers.0.mlp.down_proj.weight: shape [64, 128]" in raised.value.message
