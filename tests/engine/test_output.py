"""The output directory: loadable by transformers, complete, sharded correctly, verifiable,
and deterministic."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.errors import OutputError
from tests.conftest import Family, Sharded
from tests.reference import load, raw_tensors, read_header, sha256

SWAP = {"bottom": 1, "top": 1, "bottom_transition": 1, "top_transition": 1}
TEXT = "Natalia sold clips to 48 of her friends. Habari ya asubuhi."


def swap_recipe(fam: Family, **output: Any) -> dict[str, Any]:
    recipe: dict[str, Any] = {
        "method": "layer_swap",
        "experts": {"task": [fam.task], "language": [fam.language]},
        "params": SWAP,
    }
    if output:
        recipe["output"] = output
    return recipe


def assert_forward_pass(out_dir: Path) -> None:
    """transformers loads the merged checkpoint, with exactly the files' weights, and runs it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    model = AutoModelForCausalLM.from_pretrained(str(out_dir))
    assert not model.training
    weights = load(out_dir)
    state = model.state_dict()
    for name, tensor in weights.items():
        assert torch.equal(state[name].to(tensor.dtype), tensor), name
    if "lm_head.weight" not in weights:  # tied embeddings
        assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    assert ids.shape[1] > 3
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert bool(torch.isfinite(logits).all())


@pytest.mark.parametrize("family_name", ["llama", "qwen2", "gemma_tied"])
def test_merged_models_load_and_run(
    family_name: str, request: pytest.FixtureRequest, run_merge: Any
) -> None:
    fam: Family = request.getfixturevalue(family_name)
    result = run_merge(swap_recipe(fam))
    assert_forward_pass(result.out_dir)


def test_every_method_output_runs(llama: Family, run_merge: Any) -> None:
    for recipe in (
        {"method": "soup", "models": [llama.task, llama.language]},
        {"method": "task_arithmetic", "base": llama.base, "models": [llama.task, llama.language]},
        {"method": "ties", "base": llama.base, "models": [llama.task, llama.language]},
        {**swap_recipe(llama), "output": {"dtype": "float32"}},
    ):
        assert_forward_pass(run_merge(recipe).out_dir)


def test_output_files_and_manifest(llama: Family, run_merge: Any) -> None:
    result = run_merge(swap_recipe(llama))
    out = result.out_dir
    names = {p.name for p in out.iterdir()}
    assert names == {
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "layerswap.json",
        "README.md",
    }
    assert not list(out.parent.glob(f".{out.name}.*"))
    # config + generation config from the task expert, tokenizer from the language expert
    for name in ("config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (llama.task / name).read_bytes()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (llama.language / name).read_bytes()

    manifest = json.loads((out / "layerswap.json").read_text())
    assert manifest == result.manifest
    assert manifest["recipe"]["method"] == "layer_swap"
    assert manifest["recipe"]["experts"] == {
        "task": [str(llama.task)],
        "language": [str(llama.language)],
    }
    assert manifest["recipe"]["params"]["bottom_transition"] == 1
    # inputs: identity with the sha256 of every file that was read
    inputs = {entry["label"]: entry for entry in manifest["inputs"]}
    assert set(inputs) == {"task[0]", "language[0]"}
    for label, path in (("task[0]", llama.task), ("language[0]", llama.language)):
        assert inputs[label]["source"] == str(path)
        assert inputs[label]["files"] == {
            "model.safetensors": sha256(path / "model.safetensors"),
            "config.json": sha256(path / "config.json"),
        }
    assert inputs["task[0]"]["role"] == "task"
    # per-layer provenance
    layers = [(row["layer"], row["origin"]) for row in manifest["layers"]]
    assert layers == [
        ("0", "language"),
        ("1", "transition"),
        ("2", "task"),
        ("3", "task"),
        ("4", "transition"),
        ("5", "language"),
        ("non-layer", "average"),
    ]
    assert manifest["layers"][0]["made_from"] == "language[0]"
    # output sha256s: of every other file, as they are on disk
    assert set(manifest["outputs"]) == names - {"layerswap.json"}
    for name, digest in manifest["outputs"].items():
        assert digest == sha256(out / name), name
    assert set(result.files) == names
    for name, digest in result.files.items():
        assert digest == sha256(out / name), name
    assert len(manifest["plan_digest"]) == 64


def test_sharded_output(llama: Family, run_merge: Any, tmp_path: Path) -> None:
    result = run_merge(swap_recipe(llama, shard_size="40KB"))
    out = result.out_dir
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2
    assert not (out / "model.safetensors").exists()
    assert shards == sorted(set(index["weight_map"].values()))
    total = 0
    for shard in shards:
        header, data_start = read_header(out / shard)
        assert {n for n, f in index["weight_map"].items() if f == shard} == set(header)
        ends = [entry["data_offsets"][1] for entry in header.values()]
        assert (out / shard).stat().st_size == data_start + max(ends)
        total += sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values())
        # shard budget respected (one oversize tensor alone is allowed)
        assert max(ends) <= 40_000 or len(header) == 1
    assert index["metadata"]["total_size"] == total
    assert "model.safetensors.index.json" in result.manifest["outputs"]
    for name in shards:
        assert result.manifest["outputs"][name] == sha256(out / name)
    # Same tensors, same bytes as the unsharded output.
    single = run_merge(swap_recipe(llama))
    assert raw_tensors(out) == raw_tensors(single.out_dir)
    assert_forward_pass(out)
    # Each file (computed tensors and copies alike) is the one save_file writes of its tensors.
    for file in [*(out / s for s in shards), single.out_dir / "model.safetensors"]:
        assert file.read_bytes() == save_file_bytes(file, tmp_path / "saved.safetensors"), file


def save_file_bytes(file: Path, path: Path) -> bytes:
    """The bytes the safetensors library's save_file writes of the tensors in `file`."""
    from safetensors.torch import load_file, save_file

    save_file(load_file(str(file)), str(path), metadata={"format": "pt"})
    return path.read_bytes()


# safetensors dtype names -> torch's
TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


def test_save_order_and_header_are_the_safetensors_librarys(tmp_path: Path) -> None:
    """The installed safetensors library lays tensors of every dtype out in SAVE_ORDER, then by
    name, and encode_header writes its header's very bytes (names unescaped, padding)."""
    from safetensors.torch import save_file

    from engine.io.safetensors_format import DTYPE_SIZES, SAVE_ORDER, encode_header, save_order

    assert sorted(SAVE_ORDER) == sorted(DTYPE_SIZES) == sorted(TORCH_DTYPES)
    names = ["b", "a.10", "a.9", "B", "é"]
    tensors = {f"{n}.{d}": torch.zeros(3, dtype=t) for d, t in TORCH_DTYPES.items() for n in names}
    path = tmp_path / "saved.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    header, data_start = read_header(path)
    assert list(header) == sorted(header, key=lambda n: save_order(header[n]["dtype"], n))
    assert list(header) != sorted(header)  # the dtype decides first
    assert encode_header(header, {"format": "pt"}) == path.read_bytes()[:data_start]


def test_sharded_inputs(llama: Family, sharded: Sharded, run_merge: Any) -> None:
    assert (sharded.task / "model.safetensors.index.json").is_file()
    assert len(list(sharded.task.glob("*.safetensors"))) > 2
    plain = run_merge(swap_recipe(llama))
    recipe = swap_recipe(llama)
    recipe["experts"] = {"task": [sharded.task], "language": [llama.language]}
    result = run_merge(recipe)
    assert sha256(result.out_dir / "model.safetensors") == sha256(
        plain.out_dir / "model.safetensors"
    )
    task_input = next(i for i in result.manifest["inputs"] if i["label"] == "task[0]")
    expected = {p.name: sha256(p) for p in sharded.task.glob("*.safetensors")}
    expected["config.json"] = sha256(sharded.task / "config.json")
    assert task_input["files"] == expected


def test_determinism(llama: Family, run_merge: Any, tmp_path: Path) -> None:
    """Two runs of the same recipe give byte-identical files (durable and not)."""
    for recipe in (
        swap_recipe(llama, shard_size="60KB"),
        {
            "method": "ties",
            "base": llama.base,
            "models": [llama.task, llama.language],
            "params": {"density": 0.5},
        },
    ):
        first = run_merge(recipe, durable=True)
        second = run_merge(recipe)
        assert first.files == second.files
        names = sorted(p.name for p in first.out_dir.iterdir())
        assert names == sorted(p.name for p in second.out_dir.iterdir())
        for name in names:
            assert sha256(first.out_dir / name) == sha256(second.out_dir / name), name
        assert first.plan_digest == second.plan_digest


@pytest.mark.parametrize("method", ["ties", "task_arithmetic", "dare_linear", "breadcrumbs"])
def test_task_vector_methods_take_config_and_tokenizer_from_the_base(
    method: str, llama: Family, run_merge: Any, tmp_path: Path
) -> None:
    """The deltas are the models' differences from the base: the output is a model of the base's
    kind, with its config, generation settings and tokenizer (as mergekit's base_model's)."""
    base = tmp_path / "base"
    shutil.copytree(llama.base, base, copy_function=os.link)
    side = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
    for name in side:
        data = json.loads((base / name).read_text())
        (base / name).unlink()  # a hard link to the family's file: replaced, not written through
        (base / name).write_text(json.dumps({**data, "_base_only": True}, indent=2))
    result = run_merge({"method": method, "base": base, "models": [llama.task, llama.language]})
    for name in side:
        assert (result.out_dir / name).read_bytes() == (base / name).read_bytes(), name


def test_tokenizer_mismatch_is_a_warning(llama: Family, run_merge: Any, tmp_path: Path) -> None:
    odd = tmp_path / "odd-language"
    shutil.copytree(llama.language, odd)
    tokenizer = json.loads((odd / "tokenizer.json").read_text())
    (odd / "tokenizer.json").write_text(json.dumps(tokenizer, indent=1))
    recipe = swap_recipe(llama)
    recipe["experts"] = {"task": [llama.task], "language": [odd]}
    result = run_merge(recipe)
    assert any("tokenizer.json" in w for w in result.manifest["warnings"])
    assert (result.out_dir / "tokenizer.json").read_bytes() == (odd / "tokenizer.json").read_bytes()


def test_unused_base_is_a_warning(llama: Family, run_merge: Any) -> None:
    result = run_merge(
        {"method": "soup", "base": llama.base, "models": [llama.task, llama.language]}
    )
    assert any("not used" in w for w in result.manifest["warnings"])
    assert all(i["label"] != "base" or i["role"] == "base" for i in result.manifest["inputs"])


def test_progress_reports(llama: Family, run_merge: Any, tmp_path: Path) -> None:
    from engine.merge import MergeOptions, merge
    from engine.recipe import parse_recipe
    from tests.helpers import stringify

    reports: list[Any] = []
    merge(
        parse_recipe(stringify(swap_recipe(llama))),
        tmp_path / "progress",
        resolve=Path,
        options=MergeOptions(durable=False),
        on_progress=reports.append,
    )
    merging = [r for r in reports if r.stage == "merging"]
    assert merging and reports[-1].stage == "finalizing"
    assert reports[-1].tensors_done == reports[-1].tensors_total > 0
    assert reports[-1].bytes_done == reports[-1].bytes_total
    done = [r.tensors_done for r in merging]
    assert done == sorted(done)


def test_model_card_states_method_inputs_and_layers(llama: Family, run_merge: Any) -> None:
    import yaml

    result = run_merge(swap_recipe(llama))
    card = (result.out_dir / "README.md").read_text()
    _, front_matter, body = card.split("---\n", 2)
    front = yaml.safe_load(front_matter)
    assert front["library_name"] == "transformers"
    assert front["tags"][:3] == ["merge", "layerswap", "layer-swapping"]
    assert "base_model" not in front  # local inputs are not Hub models
    manifest = json.loads((result.out_dir / "layerswap.json").read_text())
    assert manifest["outputs"]["README.md"] == sha256(result.out_dir / "README.md")
    rows = [line for line in body.splitlines() if line.startswith("| ") and "|---" not in line]
    layer_rows = [r for r in rows if r.split("|")[1].strip().isdigit() or "non-layer" in r]
    assert len(layer_rows) == len(manifest["layers"])
    for entry in manifest["inputs"]:
        assert f"`{entry['source']}`" in body
    assert '"bottom"' in body and "layer swapping" in body


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "page_cache"])
def test_writer_copies_and_writes_land_at_their_offsets(tmp_path: Path, direct: bool) -> None:
    """Both write paths: ranges of a source file (one spanning several blocks, so blocks split
    it) and computed bytes, handed over out of order, at offsets that are not page-aligned,
    make exactly the planned file (its size not a multiple of O_DIRECT's unit either) and its
    sha256."""
    from engine.io.writer import ALIGN, BLOCK, OutputWriter

    source = tmp_path / "source.bin"
    source.write_bytes(os.urandom(2 * BLOCK + 4096))
    data = source.read_bytes()
    header = b"8-bytes!"
    computed = os.urandom(1000)
    expected = header + computed + data[5:] + data[:5]
    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(source, os.O_RDONLY)
    try:
        writer = OutputWriter(
            out,
            [("f.bin", header, len(expected))],
            durable=True,
            direct=direct,
        )
        start = len(header) + len(computed)
        writer.put_copy(0, start + len(data) - 5, fd, 0, 5)
        writer.put_copy(0, start, fd, 5, len(data) - 5)
        writer.put_bytes(0, len(header), memoryview(computed), ends_tensor=True)
        writer.finish()
    finally:
        os.close(fd)
    assert len(expected) % ALIGN
    assert (out / "f.bin").read_bytes() == expected
    assert writer.digests == {"f.bin": hashlib.sha256(expected).hexdigest()}
    assert writer.tensors_written == 3


def test_writer_assembles_more_files_than_it_has_lanes(tmp_path: Path) -> None:
    """More files than files assembled at once, each with computed bytes that cross a block
    boundary (handed over in two chunks) between copies: every file and sha256 is exact."""
    from engine.io.writer import BLOCK, LANES, OutputWriter

    source = tmp_path / "source.bin"
    source.write_bytes(os.urandom(4096))
    data = source.read_bytes()
    count = LANES + 2
    computed = [os.urandom(BLOCK + 3) for _ in range(count)]
    header = b"header!!"
    expected = [header + data[:100] + c + data[100:] for c in computed]
    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(source, os.O_RDONLY)
    try:
        writer = OutputWriter(out, [(f"{i}.bin", header, len(e)) for i, e in enumerate(expected)])
        for i, chunk in enumerate(computed):
            writer.put_copy(i, len(header), fd, 0, 100)
            writer.put_copy(i, len(header) + 100 + len(chunk), fd, 100, len(data) - 100)
        for i, chunk in enumerate(computed):
            at = len(header) + 100
            writer.put_bytes(i, at, memoryview(chunk)[: BLOCK // 2], ends_tensor=False)
            writer.put_bytes(i, at + BLOCK // 2, memoryview(chunk)[BLOCK // 2 :], ends_tensor=True)
        writer.finish()
    finally:
        os.close(fd)
    for i, e in enumerate(expected):
        assert (out / f"{i}.bin").read_bytes() == e
    digests = {f"{i}.bin": hashlib.sha256(e).hexdigest() for i, e in enumerate(expected)}
    assert writer.digests == digests
    assert writer.tensors_written == 3 * count


def test_writer_fails_clearly_when_a_range_is_never_handed_over(tmp_path: Path) -> None:
    from engine.io.writer import OutputWriter

    out = tmp_path / "out"
    out.mkdir()
    writer = OutputWriter(out, [("f.bin", b"header!!", 8 + 10)])
    writer.put_bytes(0, 8, memoryview(b"12345"), ends_tensor=True)  # bytes 13..17 missing
    with pytest.raises(OutputError) as info:
        writer.finish()
    assert "f.bin: bytes at 13 never written" in info.value.message
