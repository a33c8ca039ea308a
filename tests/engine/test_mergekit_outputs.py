"""What a mergekit config's output holds beside the weights, compared with what mergekit 0.1.5
writes (.venv-bench): config.json and generation config from the config's base_model, the
tokenizer copied byte for byte or saved anew, the chat template (auto, by name, as text), the
dtype config.json declares; and TIES keeping ⌊density·n⌋ entries, as mergekit does.

The inputs differ in every side file (config values, generation settings, chat templates, a
config.json in the older `torch_dtype` form), so taking one from the wrong model shows."""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from engine.mergekit import translate
from engine.mergekit.chat_templates import NAMED
from tests.conftest import Family
from tests.engine.mergekit_parity import ROOT, run_mergekit
from tests.engine.sparsify_reference import tie_ambiguous
from tests.engine.vocabularies import make_chat_family
from tests.reference import load
from tests.test_cli import layerswap

BASE_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
TUNED_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}\n"
)
TEXT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
)
# Files each tool writes about itself, not compared.
OWN_FILES = {"README.md", "mergekit_config.yml", "layerswap.json"}


@pytest.fixture(scope="module")
def donors(llama32: Family, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """base, task, language and task2 of the float32 family, each with side files of its own:
    the base a chat template in tokenizer_config.json, special_tokens_map.json and sampling
    settings; task and language one chat_template.jinja (the most common), language a
    config.json with `torch_dtype`, task an added_tokens.json; task2 none."""
    root = tmp_path_factory.mktemp("donors")
    made = {}
    for name in ("base", "task", "language", "task2"):
        made[name] = root / name
        shutil.copytree(getattr(llama32, name), made[name], copy_function=_link_weights)
    _edit(made["base"] / "config.json", initializer_range=0.025)
    _edit(made["base"] / "generation_config.json", do_sample=True, temperature=0.6)
    _edit(made["base"] / "tokenizer_config.json", chat_template=BASE_TEMPLATE)
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    (made["base"] / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    for name in ("task", "language"):
        (made[name] / "chat_template.jinja").write_text(TUNED_TEMPLATE)
        _edit(made[name] / "config.json", use_cache=False)
    (made["task"] / "added_tokens.json").write_text("{}\n")
    config = json.loads((made["language"] / "config.json").read_text())
    config["torch_dtype"] = config.pop("dtype")
    _replace(made["language"] / "config.json", config)
    _edit(made["task2"] / "generation_config.json", temperature=0.9)
    return made


def _link_weights(source: str, target: str) -> None:
    """Weights hard-linked (read only, by both tools), every other file copied (edited here)."""
    (os.link if source.endswith(".safetensors") else shutil.copy2)(source, target)


def _edit(path: Path, **changes: Any) -> None:
    _replace(path, {**json.loads(path.read_text()), **changes})


def _replace(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def configs(d: dict[str, Path]) -> dict[str, dict[str, Any]]:
    m = {name: str(path) for name, path in d.items()}
    ties = {
        "merge_method": "ties",
        "base_model": m["base"],
        "models": [{"model": m["task"], "parameters": {"weight": 0.7}},
                   {"model": m["language"], "parameters": {"weight": 0.4}}],
        "parameters": {"density": 0.3, "lambda": 1.1},  # 64 entries: 19 kept, not 20
        "dtype": "float32",
    }  # fmt: skip
    return {
        "ties": ties,
        "task_arithmetic-out_dtype": {
            "merge_method": "task_arithmetic",
            "base_model": m["language"],  # its config.json says torch_dtype
            "models": [
                {"model": m["task"], "parameters": {"weight": 0.5}},
                {"model": m["task2"], "parameters": {"weight": 0.3}},
            ],
            "dtype": "float32",
            "out_dtype": "bfloat16",
        },
        "linear-base-listed-second": {
            "merge_method": "linear",
            "base_model": m["task2"],
            "models": [
                {"model": m["task"], "parameters": {"weight": 0.6}},
                {"model": m["task2"], "parameters": {"weight": 0.4}},
            ],
            "dtype": "float32",
        },
        "breadcrumbs": {**ties, "merge_method": "breadcrumbs", "parameters": {"density": 0.9}},
        "chat_template-auto": {**ties, "chat_template": "auto"},
        "chat_template-text": {**ties, "chat_template": TEXT_TEMPLATE},
        "chat_template-chatml": {**ties, "chat_template": "chatml"},
    }


def merge_both(config: dict[str, Any], tmp_path: Path) -> tuple[Path, Path, str]:
    """(Layerswap's output, mergekit's, `layerswap merge`'s stderr)."""
    config_file = tmp_path / "config.yml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    done = layerswap("merge", config_file, "--out", tmp_path / "ours", "-q", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return tmp_path / "ours", run_mergekit(config, tmp_path / "mergekit"), done.stderr


def side_files(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()} - OWN_FILES - {"model.safetensors"}


def assert_same_files(ours: Path, theirs: Path, *, rendered: frozenset[str] = frozenset()) -> None:
    """The same side files: JSON parsed equal (config.json but for the transformers version
    that wrote it), every other file byte for byte, but those `rendered` (compared by what
    they render, see below)."""
    assert side_files(ours) == side_files(theirs)
    for name in side_files(ours) - rendered:
        mine, reference = (ours / name).read_bytes(), (theirs / name).read_bytes()
        if name == "config.json":
            a, b = json.loads(mine), json.loads(reference)
            assert a.pop("transformers_version") and b.pop("transformers_version")
            assert a == b
        elif name.endswith(".json"):
            assert json.loads(mine) == json.loads(reference), name
        else:
            assert mine == reference, name


def assert_same_tensors(ours: Path, theirs: Path, config: dict[str, Any]) -> None:
    """Every tensor equal, bit for bit, but where a trimmed delta has equal |δ| on both sides
    of a cut: mergekit's sort (not stable) may keep either, Layerswap the first in flat order."""
    mine, reference = load(ours), load(theirs)
    assert set(mine) == set(reference)
    for name in mine:
        assert mine[name].dtype == reference[name].dtype, name
        bits = torch.int32 if mine[name].dtype == torch.float32 else torch.int16
        differ = mine[name].view(bits) != reference[name].view(bits)
        if differ.any():
            assert not (differ & ~tied_at_a_cut(config, name)).any(), name


def tied_at_a_cut(config: dict[str, Any], name: str) -> torch.Tensor:
    """The entries of tensor `name` that some model's trimmed delta keeps or drops by how a
    sort orders equal |δ| (TIES: breadcrumbs without a top cut)."""
    base = load(Path(config["base_model"]))[name]
    found = torch.zeros_like(base, dtype=torch.bool)
    if "density" not in config.get("parameters", {}):
        return found
    gamma = 0.01 if config["merge_method"] == "breadcrumbs" else 0.0  # mergekit's default
    for entry in config["models"]:
        delta = load(Path(entry["model"]))[name] - base
        found |= tie_ambiguous(delta, config["parameters"]["density"], gamma)
    return found


@pytest.mark.parametrize(
    ("case", "donor"),
    [("ties", "base"), ("task_arithmetic-out_dtype", "language"),
     ("linear-base-listed-second", "task2"), ("breadcrumbs", "base")],
)  # fmt: skip
def test_config_and_tokenizer_come_from_base_model_as_mergekit_copies_them(
    case: str, donor: str, donors: dict[str, Path], tmp_path: Path
) -> None:
    config = configs(donors)[case]
    ours, theirs, _ = merge_both(config, tmp_path)
    assert_same_files(ours, theirs)
    for name in side_files(ours) - {"config.json"}:  # copied byte for byte from the donor
        assert (ours / name).read_bytes() == (donors[donor] / name).read_bytes(), name
    written = json.loads((ours / "config.json").read_text())
    assert written["dtype"] == config.get("out_dtype", "float32")
    assert "torch_dtype" not in written
    assert_same_tensors(ours, theirs, config)


def test_ties_keeps_floor_density_n_entries(donors: dict[str, Path], tmp_path: Path) -> None:
    """density 0.3 of a norm's 64 entries: mergekit keeps 19 (⌊19.2⌋); so does Layerswap, with
    no warning left to say otherwise."""
    config = configs(donors)["ties"]
    config["models"] = config["models"][:1]
    config["parameters"] = {"density": 0.3, "normalize": False}
    ours, theirs, stderr = merge_both(config, tmp_path)
    assert_same_tensors(ours, theirs, config)
    name = "model.layers.1.input_layernorm.weight"
    base = load(donors["base"])[name]
    for out in (ours, theirs):
        moved = load(out)[name] != base
        assert (moved.numel(), int(moved.sum())) == (64, 19)
    assert "density·n" not in stderr


@pytest.mark.parametrize("case", ["chat_template-auto", "chat_template-text"])
def test_a_chat_template_is_written_where_and_as_mergekit_writes_it(
    case: str, donors: dict[str, Path], tmp_path: Path
) -> None:
    """With a chat template mergekit saves the tokenizer anew: chat_template.jinja holds the
    template (auto: the one most models carry, stripped), tokenizer_config.json none, and no
    generation config is written; a warning says so."""
    ours, theirs, stderr = merge_both(configs(donors)[case], tmp_path)
    assert_same_files(ours, theirs)
    assert side_files(ours) == {"config.json", "tokenizer.json", "tokenizer_config.json",
                                "chat_template.jinja"}  # fmt: skip
    expected = TUNED_TEMPLATE.strip() if case.endswith("auto") else TEXT_TEMPLATE
    assert (ours / "chat_template.jinja").read_text() == expected
    assert "chat_template" not in json.loads((ours / "tokenizer_config.json").read_text())
    assert "mergekit saves the tokenizer anew and then writes no generation_config.json" in stderr


def test_a_named_chat_template_renders_as_mergekits(
    donors: dict[str, Path], tokenizer: Any, tmp_path: Path
) -> None:
    """chat_template.jinja holds Layerswap's own template of that name, where mergekit's
    tokenizer_config.json holds none either; every conversation renders the same."""
    ours, theirs, _ = merge_both(configs(donors)["chat_template-chatml"], tmp_path)
    assert_same_files(ours, theirs, rendered=frozenset({"chat_template.jinja"}))
    mine, reference = (ours / "chat_template.jinja").read_text(), mergekit_template("chatml")
    assert mine == NAMED["chatml"] != reference  # written anew, not copied
    assert (theirs / "chat_template.jinja").read_text() == reference
    for conversation, prompt in itertools.product(CONVERSATIONS, (False, True)):
        assert render(tokenizer, mine, conversation, prompt) == render(
            tokenizer, reference, conversation, prompt
        )


def test_a_tokenizer_source_saves_the_tokenizer_anew_as_mergekit_does(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """tokenizer_source: mergekit builds the tokenizer and saves it (transformers' form, no
    generation config); the union's tokenizer.json equals mergekit's byte for byte where one
    model brings the new tokens."""
    chats = make_chat_family(tmp_path_factory.mktemp("chats"), dtype=torch.float32, seed=5)
    config = {
        "merge_method": "linear",
        "base_model": str(chats.tool),
        "models": [{"model": str(chats.chat), "parameters": {"weight": 0.6}},
                   {"model": str(chats.tool), "parameters": {"weight": 0.4}}],
        "tokenizer_source": "union",
        "chat_template": "auto",
        "dtype": "float32",
    }  # fmt: skip
    ours, theirs, stderr = merge_both(config, tmp_path)
    assert_same_files(ours, theirs)
    assert side_files(ours) == {"config.json", "tokenizer.json", "tokenizer_config.json"}
    assert json.loads((ours / "config.json").read_text())["vocab_size"] == 262
    assert "tokenizer_source: mergekit saves the tokenizer anew" in stderr


# -- the named templates ------------------------------------------------------------------------
def turn(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


CONVERSATIONS = [
    [turn("user", "Hi there ")],
    [turn("system", "  Be terse.\n"), turn("user", "Hi")],
    [turn("user", "2+2?"), turn("assistant", " 4\n")],
    [turn("system", "s"), turn("user", "a"), turn("assistant", "b"), turn("user", "c")],
    [turn("user", "a"), turn("assistant", "b"), turn("user", "c"), turn("assistant", "d")],
    [turn("system", "first"), turn("system", "second"), turn("user", "q")],  # alpaca: the last
    [turn("assistant", "first")],  # mistral refuses: the user must start
    [turn("user", ""), turn("assistant", "")],
    [turn("system", "alone")],
    [turn("user", "q"), turn("user_context", " ctx "), turn("assistant", "a")],  # alpaca's Input
    [turn("system", "s"), turn("user", "q"), turn("assistant", "a"), turn("system", "again"),
     turn("user", "q2")],
    [turn("user", "multi\nline\n\n text"), turn("assistant", "ok")],
    [turn("tool", "result"), turn("user", "q")],
    [turn("user", "twice"), turn("user", "in a row")],  # mistral refuses: no alternation
]  # fmt: skip


def mergekit_templates() -> Path:
    """The chat templates mergekit ships (read to compare with, never copied)."""
    found = sorted(ROOT.glob(".venv-bench/lib/python*/site-packages/mergekit/_data/chat_templates"))
    if not found:
        pytest.fail("mergekit is missing: run `bash bench/setup.sh`", pytrace=False)
    return found[0]


def mergekit_template(name: str) -> str:
    return (mergekit_templates() / f"{name}.jinja").read_text()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The examples' tokenizer: bos <s>, eos </s>, as the templates use them."""
    from transformers import AutoTokenizer

    from worker.examples import make_tokenizer

    where = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(where)
    return AutoTokenizer.from_pretrained(str(where))


def render(tokenizer: Any, template: str, conversation: list[dict[str, str]], prompt: bool) -> str:
    """What transformers renders (its Jinja settings: trim_blocks, lstrip_blocks), or the kind
    of error it raises."""
    try:
        return str(tokenizer.apply_chat_template(
            conversation, chat_template=template, tokenize=False, add_generation_prompt=prompt
        ))  # fmt: skip
    except Exception as e:  # a template's refusal (TemplateError), a missing key
        return f"raises {type(e).__name__}"


def test_the_named_templates_are_mergekits() -> None:
    assert {p.stem for p in mergekit_templates().glob("*.jinja")} == set(NAMED)


@pytest.mark.parametrize("name", sorted(NAMED))
def test_each_named_template_renders_every_conversation_as_mergekits(
    name: str, tokenizer: Any
) -> None:
    reference = mergekit_template(name)
    rendered = []
    for conversation, prompt in itertools.product(CONVERSATIONS, (False, True)):
        mine = render(tokenizer, NAMED[name], conversation, prompt)
        assert mine == render(tokenizer, reference, conversation, prompt), (conversation, prompt)
        rendered.append(mine)
    assert len(set(rendered)) >= 8  # they render apart (mistral refuses some, has no prompt)


# -- what mergekit leaves to chance, and refusals -----------------------------------------------
def test_without_base_model_the_donor_is_said_where_the_models_files_differ(
    donors: dict[str, Path], tmp_path: Path
) -> None:
    """mergekit's donor is then the first of a set (its order changes from run to run):
    Layerswap takes the first model, and says so only where that could matter."""
    again = tmp_path / "task-again"
    shutil.copytree(donors["task"], again, copy_function=_link_weights)
    said = donor_warnings(donors["task"], donors["task2"])
    assert said == [
        "without base_model, mergekit takes config.json and the tokenizer from whichever model "
        "its set of models yields first (Python's set order, which may change from run to run); "
        f"the models' files differ, and Layerswap takes {donors['task']}'s"
    ]
    assert donor_warnings(donors["task"], again) == []


def donor_warnings(*models: Path) -> list[str]:
    """The plan's warnings on the donor for a linear config over `models`, without base_model
    (its donor checked to be the first model)."""
    from engine.planner import make_plan

    entries = [{"model": str(m), "parameters": {"weight": 1}} for m in models]
    config = {"merge_method": "linear", "dtype": "float32", "models": entries}
    translated = translate(config, is_local=lambda p: Path(p).is_dir())
    plan = make_plan(translated.recipe, resolve=Path)
    try:
        translated.origin.apply(plan)
        assert plan.inputs[plan.config_input].source == str(models[0])
        return [w for w in plan.warnings if "base_model" in w]
    finally:
        plan.close()
