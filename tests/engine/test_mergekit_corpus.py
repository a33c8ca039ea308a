"""The 64 published configs of mergekit_corpus/, each run by `layerswap merge` and by mergekit
0.1.5 on tiny stand-ins of the models it names (corpus_standins.py), and every output file
compared: each tensor's name, dtype, shape and bytes, and the weight files byte for byte;
config.json, generation_config.json and the tokenizer's files as parsed JSON; the chat template
and any other file byte for byte. Only the files each tool writes about itself are left out
(NOT_COMPARED), and one key of config.json (CONFIG_NORMALISED).

A config is `equal`, or a known difference (KNOWN: why, marked xfail strict, so that a config
that comes out equal fails until its entry goes), or one that mergekit itself refuses
(BOTH_REFUSE: Layerswap must refuse it too, in one line naming the field). mergekit runs in one
long-lived process (mergekit_parity.py); Layerswap's command runs in this process (click's
runner), and as a subprocess for the configs in SUBPROCESS. docs/concepts/mergekit.md's section
on these configs is made from these lists (tests/docs/test_mergekit_corpus_docs.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from layerswap.cli.merge import merge
from tests.engine.corpus_standins import Published, StandIns, corpus, needs_lora
from tests.engine.mergekit_parity import mergekit_reply
from tests.reference import read_header, weight_files
from tests.test_cli import layerswap

# Why outputs differ (a config's entry in KNOWN joins one or more of these with "; ").
RANDOM = "the drops are random: mergekit draws them unseeded, Layerswap from its seed 0"
NAMED_TEMPLATE = (
    "a chat_template named (chatml, llama3, alpaca): Layerswap writes its own text of it, which "
    "renders a conversation as mergekit's does but is another file"
)
MERGEKIT_FAILS = (
    "mergekit 0.1.5 fails on it with a TypeError planning BERT's optional weights (their "
    "aliases are a tuple), while Layerswap merges it"
)


def because(*reasons: str) -> str:
    return "; ".join(reasons)


# Configs whose outputs differ today, and why. An entry goes when its config comes out equal.
KNOWN: dict[str, str] = {
    "22-della-epsilon-llama31-local": RANDOM,
    "23-della-linear-lambda-llama31-local": RANDOM,
    "26-passthrough-single-layer-repeats-fp32": MERGEKIT_FAILS,
    "34-dare-ties-qwen15-local-cjk-paths": RANDOM,
    "36-multislerp-kansensakura-nemo": NAMED_TEMPLATE,
    "38-dare-ties-weight-gradients-l3-8b": RANDOM,
    "42-dare-ties-gemma2-9b": RANDOM,
    "43-dare-ties-chat-template-gemma2": RANDOM,
    "44-dare-ties-local-fused-gemma2": RANDOM,
    "47-dare-ties-daredevil-tutorial": RANDOM,
    "54-della-no-dtype-chat-template-l3-8b": because(RANDOM, NAMED_TEMPLATE),
    "57-della-linear-gradients-nemo": RANDOM,
    "62-breadcrumbs-lambda-alpaca-mistral": NAMED_TEMPLATE,
    "64-della-linear-filters-nemo": because(RANDOM, NAMED_TEMPLATE),
}
# Configs mergekit 0.1.5 refuses -> the field Layerswap's refusal must name.
BOTH_REFUSE = {
    "29-slerp-modules-gemma3-27b": "modules",  # slerp over a vision tower of one model
    "35-passthrough-mistral-large-invalid-dtype": "dtype",  # `bfloat`
}
# Run as a user runs them, `layerswap merge` in its own process; the others in this one.
SUBPROCESS = frozenset({"07-passthrough-gpt2-small", "35-passthrough-mistral-large-invalid-dtype",
                        "45-slerp-neuralpipe-tutorial"})  # fmt: skip
# Output files each tool writes about itself, not compared.
NOT_COMPARED = {
    "README.md": "each tool's model card",
    "mergekit_config.yml": "mergekit's copy of the config",
    "layerswap.json": "Layerswap's manifest",
}
# config.json keys set aside before comparing, and why.
CONFIG_NORMALISED = {
    "transformers_version": "mergekit writes config.json anew with the transformers installed "
    "beside it, Layerswap copies the input's file",
}


@pytest.fixture(scope="session")
def standins(tmp_path_factory: pytest.TempPathFactory) -> StandIns:
    return StandIns(tmp_path_factory)


def _param(name: str) -> Any:
    if name in KNOWN:
        return pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=KNOWN[name]))
    return name


@pytest.mark.parametrize("name", [_param(n) for n in corpus()])
def test_a_published_config_merges_as_mergekit_does(
    name: str, standins: StandIns, tmp_path: Path
) -> None:
    published = corpus()[name]
    config = tmp_path / "config.yml"
    config.write_text(standins.adapt(published), encoding="utf-8")
    ours = run_layerswap(config, tmp_path / "layerswap", subprocess=name in SUBPROCESS)
    theirs = run_mergekit(published, config, tmp_path)
    if name in BOTH_REFUSE:
        assert not theirs["ok"], "mergekit merges a config listed as refused by it"
        line = f"layerswap: error [invalid_recipe]: {BOTH_REFUSE[name]}: "
        assert ours.code == 1 and ours.stderr.startswith(line), ours.stderr
        assert ours.stderr.count("\n") == 1, f"more than one line:\n{ours.stderr}"
        return
    assert ours.code == 0, f"Layerswap refused: {ours.stderr}"
    assert theirs["ok"], f"mergekit refused:\n{theirs['error']}"
    assert differences(tmp_path / "layerswap", tmp_path / "mergekit") == []


def run_mergekit(published: Published, config: Path, tmp_path: Path) -> dict[str, Any]:
    # mergekit-yaml merges a LoRA into its model in a cache directory it must be given
    lora = ("--lora-merge-cache", str(tmp_path / "lora-cache"))
    return mergekit_reply(
        config, tmp_path / "mergekit", *(lora if needs_lora(published.config) else ())
    )


@dataclass(frozen=True)
class Run:
    code: int
    stderr: str


def run_layerswap(config: Path, out: Path, *, subprocess: bool) -> Run:
    """`layerswap merge CONFIG --out OUT`: in a subprocess, or in this process."""
    if subprocess:
        done = layerswap("merge", config, "--out", out, "-q", cwd=config.parent)
        return Run(done.returncode, done.stderr)
    env = {"LAYERSWAP_CACHE_DIR": str(config.parent / ".cache")}
    args = [str(config), "--out", str(out), "-q", "--no-fsync"]
    result = CliRunner().invoke(merge, args, env=env)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception  # not a refusal: a failure, with its traceback
    return Run(result.exit_code, result.stderr)


# -- comparing the outputs ------------------------------------------------------------------------
def differences(ours: Path, theirs: Path) -> list[str]:
    """What differs between two output directories, one line per difference (empty: equal):
    the tensors first, then every file, weights included (same tensors in another layout
    make other bytes, so another sha256)."""
    found = tensor_differences(ours, theirs)
    tensors_equal = not found
    names = {p.name for d in (ours, theirs) for p in d.iterdir() if p.is_file()}
    for name in sorted(names - set(NOT_COMPARED)):
        mine, reference = ours / name, theirs / name
        if not (mine.is_file() and reference.is_file()):
            found.append(f"{name}: only in {'Layerswap' if mine.is_file() else 'mergekit'}'s")
        elif name.endswith(".json"):
            a, b = _json(mine), _json(reference)
            if a != b:
                keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
                found.append(f"{name}: differs at {keys[:8]}" if keys else f"{name}: differs")
        elif mine.read_bytes() != reference.read_bytes():
            layout = name.endswith(".safetensors") and tensors_equal
            found.append(f"{name}: differs" + (": the same tensors, laid out otherwise" * layout))
    return found


def _json(path: Path) -> Any:
    data = json.loads(path.read_text(encoding="utf-8"))
    if path.name == "config.json":
        for key in CONFIG_NORMALISED:
            data.pop(key, None)
    return data if isinstance(data, dict) else {"": data}


def tensor_differences(ours: Path, theirs: Path) -> list[str]:
    """Tensors in one output only, of another dtype or shape, or of other bytes."""
    mine, reference = tensors(ours), tensors(theirs)
    found = []
    for side, names in (("Layerswap", mine.keys() - reference.keys()),
                        ("mergekit", reference.keys() - mine.keys())):  # fmt: skip
        if names:
            found.append(f"tensors only in {side}'s: {len(names)}, e.g. {sorted(names)[:3]}")
    shared = sorted(mine.keys() & reference.keys())
    kinds = [n for n in shared if mine[n][:2] != reference[n][:2]]
    if kinds:
        n = kinds[0]
        found.append(
            f"dtype/shape differ: {len(kinds)}, e.g. {n}: {mine[n][:2]} vs {reference[n][:2]}"
        )
    values = [n for n in shared if n not in kinds and mine[n][2] != reference[n][2]]
    if values:
        found.append(f"bytes differ: {len(values)} of {len(shared)} tensors, e.g. {values[:3]}")
    return found


def tensors(directory: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """name -> (dtype, shape, stored bytes), over every shard."""
    found = {}
    for file in weight_files(directory):
        header, start = read_header(file)
        blob = file.read_bytes()
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            found[name] = (entry["dtype"], entry["shape"], blob[start + begin : start + end])
    return found
