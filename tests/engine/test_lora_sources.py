"""`model+adapter` sources: a PEFT LoRA adapter (adapter_config.json, adapter_model.safetensors
with PEFT's key names, written here) read into the tiny bf16 Llama it adapts. Each merge is
compared with the adapted weights computed here from the files, W + scaling·(B @ A) rounded
once to W's dtype, and with what mergekit 0.1.5 writes for the same config (it merges the LoRA
with PEFT first, into --lora-merge-cache); refusals name the adapter's file and field."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from engine.io import lora as lora_module
from engine.io.safetensors_format import read_header
from layerswap.cli.merge import merge
from tests.conftest import Family
from tests.engine.mergekit_parity import mergekit_reply
from tests.reference import load

# name -> (rank, alpha, rslora, the adapter's dtype, the modules it adapts, in which layers)
ADAPTERS: dict[str, tuple[int, float, bool, torch.dtype, tuple[str, ...], range]] = {
    "attention-f32": (4, 8.0, False, torch.float32, ("q_proj", "v_proj"), range(6)),
    "mlp-bf16-rslora": (2, 16.0, True, torch.bfloat16, ("o_proj", "down_proj"), range(1, 4)),
}
MODULE = {"q_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn", "down_proj": "mlp"}


def save_adapter(base: Path, out: Path, name: str, *, seed: int, **config: Any) -> Path:
    """A PEFT LoRA adapter of `base`: random A and B (B nonzero, so the weights change)."""
    rank, alpha, rslora, dtype, modules, layers = ADAPTERS[name]
    weights = load_file(str(base / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in layers:
        for module in modules:
            where = f"model.layers.{layer}.{MODULE[module]}.{module}"
            out_features, in_features = weights[f"{where}.weight"].shape
            key = f"base_model.model.{where}"
            a = torch.randn(rank, in_features, generator=generator) * 0.1
            b = torch.randn(out_features, rank, generator=generator) * 0.1
            tensors[f"{key}.lora_A.weight"] = a.to(dtype)
            tensors[f"{key}.lora_B.weight"] = b.to(dtype)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    settings = {
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": rslora,
        "target_modules": list(modules), "fan_in_fan_out": False, "bias": "none",
        "use_dora": False, "modules_to_save": None, "lora_dropout": 0.0,
        "base_model_name_or_path": str(base), "task_type": "CAUSAL_LM", **config,
    }  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(settings, indent=2))
    return out


def adapted(base: Path, adapter: Path) -> dict[str, torch.Tensor]:
    """The base's tensors with the adapter merged, computed from the files: float32 A and B,
    (B @ A)·scaling in float32, added to the weight in float32 and rounded once to its dtype."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    rank, alpha = config["r"], config["lora_alpha"]
    scaling = alpha / math.sqrt(rank) if config["use_rslora"] else alpha / rank
    tensors = load(base)
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    for key in lora:
        if key.endswith(".lora_A.weight"):
            name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            a, b = lora[key].float(), lora[key.replace("lora_A", "lora_B")].float()
            delta = (b @ a) * scaling
            w = tensors[name]
            tensors[name] = (w.float() + (delta.T if config["fan_in_fan_out"] else delta)).to(
                w.dtype
            )
    return tensors


def run_layerswap(config: dict[str, Any], tmp_path: Path) -> tuple[int, str, Path]:
    """`layerswap merge CONFIG --out OUT` in this process: (exit code, stderr, OUT)."""
    path, out = tmp_path / "config.yml", tmp_path / "layerswap"
    path.write_text(yaml.safe_dump(config))
    env = {"LAYERSWAP_CACHE_DIR": str(tmp_path / ".cache")}
    result = CliRunner().invoke(merge, [str(path), "--out", str(out), "-q", "--no-fsync"], env=env)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stderr, out


def run_mergekit(config: dict[str, Any], tmp_path: Path) -> Path:
    path, out = tmp_path / "mergekit.yml", tmp_path / "mergekit"
    path.write_text(yaml.safe_dump(config))
    reply = mergekit_reply(path, out, "--lora-merge-cache", str(tmp_path / "lora-cache"))
    assert reply["ok"], f"mergekit failed:\n{reply['error']}"
    return out


def passthrough(model: str, layers: int) -> dict[str, Any]:
    """The whole of one model, through mergekit's passthrough (one slice of every layer)."""
    sources = [{"model": model, "layer_range": [0, layers]}]
    return {"merge_method": "passthrough", "dtype": "bfloat16", "slices": [{"sources": sources}]}


def assert_same(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == theirs.keys()
    for name in sorted(ours):
        assert ours[name].dtype == theirs[name].dtype, name
        assert torch.equal(ours[name].view(torch.uint8), theirs[name].view(torch.uint8)), name


@pytest.fixture(scope="module")
def adapters(llama: Family, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {n: save_adapter(llama.base, root / n, n, seed=i) for i, n in enumerate(ADAPTERS)}


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_a_lora_reference_reads_the_adapted_model(
    name: str, llama: Family, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """passthrough of base+adapter: every tensor copied, the adapted ones read through the
    adapter; equal to the weights computed here and to mergekit's."""
    config = passthrough(f"{llama.base}+{adapters[name]}", llama.num_layers)
    code, stderr, out = run_layerswap(config, tmp_path)
    assert code == 0, stderr
    ours, expected = load(out), adapted(llama.base, adapters[name])
    changed = [n for n in expected if not torch.equal(expected[n], load(llama.base)[n])]
    assert len(changed) == 2 * len(ADAPTERS[name][5]), "the adapter changes its targets"
    assert_same(ours, expected)
    assert_same(ours, load(run_mergekit(config, tmp_path)))


def test_a_lora_base_merges_as_mergekit_does(
    llama: Family, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """task arithmetic over a base+adapter base, in bfloat16: mergekit's bytes, every file."""
    config = {
        "merge_method": "task_arithmetic", "dtype": "bfloat16",
        "base_model": f"{llama.base}+{adapters['attention-f32']}",
        "models": [{"model": str(llama.task), "parameters": {"weight": 0.7}},
                   {"model": str(llama.language), "parameters": {"weight": 0.4}}],
    }  # fmt: skip
    code, stderr, out = run_layerswap(config, tmp_path)
    assert code == 0, stderr
    theirs = run_mergekit(config, tmp_path)
    assert_same(load(out), load(theirs))
    for file in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / file).read_bytes() == (theirs / file).read_bytes() or (
            file.endswith(".json") and _json(out / file, file) == _json(theirs / file, file)
        ), file
    assert not (out / "generation_config.json").exists()  # mergekit writes none either


def _json(path: Path, name: str) -> Any:
    data = json.loads(path.read_text())
    if name == "config.json":
        data.pop("transformers_version", None)
    return data


@pytest.mark.parametrize(
    ("breakage", "named"),
    [
        ("no config", "adapter_config.json: missing"),
        ("dora", "use_dora: DoRA"),
        ("modules_to_save", "modules_to_save: whole modules"),
        ("embedding", "lora_embedding_A"),
        ("target missing", "model.layers.9.self_attn.q_proj.weight"),
    ],
)
def test_a_malformed_adapter_is_refused_by_name(
    breakage: str, named: str, llama: Family, tmp_path: Path
) -> None:
    adapter = save_adapter(llama.base, tmp_path / "adapter", "attention-f32", seed=3)
    if breakage == "no config":
        (adapter / "adapter_config.json").unlink()
    elif breakage == "dora":
        _edit(adapter / "adapter_config.json", use_dora=True)
    elif breakage == "modules_to_save":
        _edit(adapter / "adapter_config.json", modules_to_save=["lm_head"])
    else:
        tensors = load_file(str(adapter / "adapter_model.safetensors"))
        key = "base_model.model.model.layers.9.self_attn.q_proj.lora_{}.weight"
        if breakage == "embedding":
            key = "base_model.model.model.embed_tokens.lora_embedding_{}"
        tensors.update({key.format(h): torch.zeros(4, 4) for h in "AB"})
        save_file(tensors, str(adapter / "adapter_model.safetensors"))
    config = passthrough(f"{llama.base}+{adapter}", llama.num_layers)
    code, stderr, out = run_layerswap(config, tmp_path)
    assert code == 1 and not out.exists()
    assert stderr.startswith("layerswap: error [invalid_checkpoint]: "), stderr
    assert str(adapter) in stderr and named in stderr, stderr
    assert stderr.count("\n") == 1, stderr


def _edit(path: Path, **changes: Any) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_a_lora_reference_on_the_hub_is_pinned_and_fetched(
    hub: Any, llama: Family, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """org/base+org/lora: both repositories pinned to their commits and fetched (the adapter
    whole, the model's tensors as the merge reads them); the same bytes as from directories."""
    for repo, directory in (("org/base", llama.base), ("org/lora", adapters["attention-f32"])):
        hub.create_repo(repo)
        files = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
        hub.commit(repo, files, message="upload")
    code, stderr, out = run_layerswap(passthrough("org/base+org/lora", llama.num_layers), tmp_path)
    assert code == 0, stderr
    assert "org/lora@main -> commit" in stderr
    assert_same(load(out), adapted(llama.base, adapters["attention-f32"]))


def test_a_layerswap_recipe_takes_a_lora_reference(
    llama: Family, adapters: dict[str, Path], run_merge: Any
) -> None:
    """`models: [base+adapter, task]` weighted 0.25/0.75 in float32, as the recipe computes any
    two models: the first is the adapted model."""
    adapter = adapters["mlp-bf16-rslora"]
    recipe = {"method": "linear", "models": [f"{llama.base}+{adapter}", str(llama.task)],
              "params": {"weights": [0.25, 0.75]}}  # fmt: skip
    merged = load(run_merge(recipe).out_dir)
    expected, task = adapted(llama.base, adapter), load(llama.task)
    for name, tensor in expected.items():
        mix = (0.25 * tensor.float() + 0.75 * task[name].float()).to(tensor.dtype)
        assert (merged[name].float() - mix.float()).abs().max() <= 1e-2 * mix.float().abs().max()
    o_proj = "model.layers.1.self_attn.o_proj.weight"
    plain = (0.25 * load(llama.base)[o_proj].float() + 0.75 * task[o_proj].float()).to(
        torch.bfloat16
    )
    assert not torch.equal(merged[o_proj], plain), "the adapter's change is in the merge"


@pytest.mark.parametrize("fan_in_fan_out", [False, True])
def test_the_update_added_a_block_of_rows_at_a_time_equals_it_added_whole(
    fan_in_fan_out: bool, llama: Family, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The update goes into a weight a few rows at a time (three here): each adapted weight
    equals W + scaling·(B @ A) computed whole, with the weight's rows as the product's rows or,
    fan_in_fan_out, as its columns."""
    weights = load_file(str(llama.base / "model.safetensors"))
    generator = torch.Generator().manual_seed(7)
    tensors = {}
    for module in ("q_proj", "o_proj"):  # square: the same shape either way round
        where = f"model.layers.1.self_attn.{module}"
        rows, columns = weights[f"{where}.weight"].shape
        # B @ A has the weight's shape, or its transpose's with fan_in_fan_out
        made, taken = (columns, rows) if fan_in_fan_out else (rows, columns)
        key = f"base_model.model.{where}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(4, taken, generator=generator) * 0.1
        tensors[f"{key}.lora_B.weight"] = torch.randn(made, 4, generator=generator) * 0.1
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    save_file(tensors, str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
    settings = {"peft_type": "LORA", "r": 4, "lora_alpha": 8.0, "use_rslora": False,
                "target_modules": ["q_proj", "o_proj"], "fan_in_fan_out": fan_in_fan_out,
                "bias": "none", "use_dora": False, "modules_to_save": None}  # fmt: skip
    (adapter / "adapter_config.json").write_text(json.dumps(settings))
    monkeypatch.setattr(lora_module, "_UPDATE_ELEMENTS", 3 * rows)
    code, stderr, out = run_layerswap(passthrough(f"{llama.base}+{adapter}", llama.num_layers),
                                      tmp_path)  # fmt: skip
    assert code == 0, stderr
    assert rows > 3, "the weight takes several blocks"
    assert_same(load(out), adapted(llama.base, adapter))


@pytest.mark.parametrize("fan_in_fan_out", [False, True])
@pytest.mark.parametrize("rank", [4, 16, 64])
def test_a_float32_weight_read_in_pieces_equals_the_whole_product(
    rank: int, fan_in_fan_out: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In float32, where no rounding to a narrower dtype hides the last bit, an adapted weight
    read in pieces of any size and place equals W + scaling·(B @ A) computed whole, as PEFT
    computes it, though the update is added to it a few rows at a time (MKL's product of a
    block of B's rows is not always, to the bit, those rows of the whole product: it is made
    whole)."""
    monkeypatch.setattr(lora_module, "_UPDATE_ELEMENTS", 20 * 257)  # blocks of 20 and 2 rows
    generator = torch.Generator().manual_seed(rank)
    weights, halves = {}, {}
    for name, (rows, columns) in {"narrow": (203, 257), "wide": (203, 2048)}.items():
        weights[f"{name}.weight"] = torch.randn(rows, columns, generator=generator)
        made, taken = (columns, rows) if fan_in_fan_out else (rows, columns)
        halves[f"base_model.model.{name}.lora_A.weight"] = torch.randn(
            rank, taken, generator=generator
        )
        halves[f"base_model.model.{name}.lora_B.weight"] = torch.randn(
            made, rank, generator=generator
        )
    model, adapter_dir = tmp_path / "model.safetensors", tmp_path / "adapter"
    save_file(weights, str(model))
    adapter_dir.mkdir()
    save_file(halves, str(adapter_dir / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": 3.0, "fan_in_fan_out": fan_in_fan_out}
    (adapter_dir / "adapter_config.json").write_text(json.dumps(settings))
    adapter = lora_module.LoraAdapter.open(adapter_dir)
    infos, _ = read_header(model)
    adapter.check(infos, model)
    fd = os.open(model, os.O_RDONLY)
    try:
        for name, w in weights.items():
            module = name.removesuffix(".weight")
            a, b = (halves[f"base_model.model.{module}.lora_{half}.weight"] for half in "AB")
            update = (b @ a).mul_(3.0 / rank)
            expected = (w + (update.T if fan_in_fan_out else update)).numpy().tobytes()
            size = len(expected)
            for first, n in [(0, size), (0, 4), (size - 4, 4), (12_345, 40_000), (777, size - 999)]:
                piece = bytearray(n)
                adapter.read_into(infos[name], fd, memoryview(piece), first)
                assert piece == expected[first : first + n], (name, first, n)
    finally:
        os.close(fd)
