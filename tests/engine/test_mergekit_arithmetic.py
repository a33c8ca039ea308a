"""mergekit configs that compute in bfloat16 or float16 (their `dtype`, or without one the
checkpoints' own) against mergekit 0.1.5's own output: every tensor equal bit for bit (DARE's and
DELLA's random drops: given the same masks; a tensor too large to sort whole: but where equal
|δ| sit at a cut, which mergekit's unstable sort orders as it happens to); and
`arithmetic: float32` gives Layerswap's float32 result, mergekit's with `dtype: float32`.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import save_file

from engine.merge import MergeOptions, MergeResult, merge
from engine.mergekit import translate
from tests.conftest import Family, _family
from tests.engine.mergekit_parity import MERGEKIT, run_mergekit, ulp_distance
from tests.engine.sparsify_reference import dare_mask, della_mask, gradient, tie_ambiguous
from tests.reference import layer_of, load

Tensors = dict[str, torch.Tensor]
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
        torch.float64: torch.int64}  # fmt: skip
# What each family's checkpoints are stored in, and mergekit's name for it.
DTYPES = {"llama": "bfloat16", "llama16": "float16"}


@pytest.fixture(scope="module")
def llama16(tmp_path_factory: pytest.TempPathFactory) -> Family:
    """fp16 Llama, 6 layers (conftest's llama in float16)."""
    return _family(tmp_path_factory.mktemp("llama16"), dtype=torch.float16, seed=50)


def configs(fam: Family) -> dict[str, dict[str, Any]]:
    """One config per method, as a model card holds it, without its dtype."""

    def m(name: str) -> str:
        return str(getattr(fam, name))

    task_vectors = {"base_model": m("base")}
    return {
        "linear": {"merge_method": "linear", "parameters": {"normalize": True}, "models": [
            {"model": m("task"), "parameters": {"weight": 0.7}},
            {"model": m("language"), "parameters": {"weight": [0.2, 0.9]}},
            {"model": m("task2"), "parameters": {"weight": 0.4}}]},
        "slerp": {"merge_method": "slerp", "base_model": m("task"),
                  "models": [{"model": m("task")}, {"model": m("language")}],
                  "parameters": {"t": [0, 0.3, 0.8]}},
        "task_arithmetic": {"merge_method": "task_arithmetic", **task_vectors, "models": [
            {"model": m("task"), "parameters": {"weight": 0.7}},
            {"model": m("language"), "parameters": {"weight": -0.3}},
            {"model": m("task2"), "parameters": {"weight": [0.45, 0.1]}}],
            "parameters": {"lambda": [1.3, 0.8], "normalize": True}},
        "ties": {"merge_method": "ties", **task_vectors, "models": [
            {"model": m("task"), "parameters": {"density": 0.5, "weight": 0.7}},
            {"model": m("language"), "parameters": {"density": 0.5, "weight": 0.3}},
            {"model": m("task2"), "parameters": {"density": 0.5, "weight": 0.5}}],
            "parameters": {"normalize": True, "lambda": 1.2}},
        # mergekit's examples/ties.yml, one weight negative, and λ by tensor and layer:
        # weights and densities by layer and tensor, per model
        "ties_gradients": {"merge_method": "ties", **task_vectors, "models": [
            {"model": m("task"), "parameters": {"density": [1, 0.7, 0.1], "weight": 1.0}},
            {"model": m("language"), "parameters": {"density": 0.5, "weight": [0, 0.3, 0.7, 1]}},
            {"model": m("task2"), "parameters": {"density": 0.33, "weight": [
                {"filter": "mlp", "value": 0.5}, {"value": -0.2}]}}],
            "parameters": {"normalize": True, "int8_mask": True,
                           "lambda": [{"filter": "self_attn", "value": [0.7, 1.2]}, {"value": 1}]}},
        "breadcrumbs": {"merge_method": "breadcrumbs", **task_vectors, "models": [
            {"model": m("task"), "parameters": {"weight": 0.7, "gamma": 0.05}},
            {"model": m("language"), "parameters": {"weight": 0.6}}],
            "parameters": {"density": 0.8, "gamma": 0.1, "normalize": True}},
        "breadcrumbs_ties": {"merge_method": "breadcrumbs_ties", **task_vectors, "models": [
            {"model": m("task"), "parameters": {"weight": 1.0, "density": 0.5}},
            {"model": m("language"), "parameters": {"weight": 0.6, "density": 0.75}}],
            "parameters": {"gamma": 0.02, "lambda": 0.8, "rescale": True}},
        "nuslerp": {"merge_method": "nuslerp", **task_vectors, "models": [
            {"model": m("task"), "parameters": {"weight": [0.2, 1.0]}},
            {"model": m("language"), "parameters": {"weight": 0.5}}],
            "parameters": {"nuslerp_flatten": [{"filter": "mlp", "value": False}]}},
        "model_stock": {"merge_method": "model_stock", **task_vectors,
                        "models": [{"model": m(x)} for x in ("task", "language", "task2")],
                        "parameters": {"filter_wise": [True, False]}},
        "passthrough": {"merge_method": "passthrough", "slices": [
            {"sources": [{"model": m("task"), "layer_range": [0, 4]}]},
            {"sources": [{"model": m("language"), "layer_range": [2, 6]}]}]},
    }  # fmt: skip


def merge_config(
    config: dict[str, Any], out: Path, arithmetic: str | None = None, **options: Any
) -> MergeResult:
    """What `layerswap merge CONFIG OUT [--arithmetic A]` writes, without its process."""
    translated = translate(config, is_local=lambda ref: Path(ref).is_dir(), arithmetic=arithmetic)
    chosen = MergeOptions(durable=False, mergekit=translated.origin, **options)
    return merge(translated.recipe, out, resolve=Path, options=chosen)


def differing(ours: Tensors, theirs: Tensors) -> dict[str, torch.Tensor]:
    """Per tensor that differs, where its bits differ."""
    assert set(ours) == set(theirs)
    found = {}
    for name, tensor in ours.items():
        assert tensor.dtype == theirs[name].dtype, name
        bits = BITS[tensor.dtype]
        differ = tensor.view(bits) != theirs[name].view(bits)
        if differ.any():
            found[name] = differ
    return found


def tied_at_a_cut(config: dict[str, Any], name: str, dtype: torch.dtype) -> torch.Tensor:
    """Entries of `name` whose mask hangs on how mergekit's sort orders equal |δ| (rounded to
    the arithmetic's dtype) at a cut, for any of the config's models (TIES: the k-th largest;
    breadcrumbs: both ends of the kept band)."""
    base = load(Path(config["base_model"]))[name].to(dtype)
    found = torch.zeros_like(base, dtype=torch.bool)
    for entry in config["models"]:
        given = {**config.get("parameters", {}), **entry.get("parameters", {})}

        def value(v: Any) -> float:
            return gradient(v, layer_of(name), 6) if isinstance(v, list) else float(v)

        delta = load(Path(entry["model"]))[name].to(dtype) - base
        gamma = value(given.get("gamma", 0.01)) if "breadcrumbs" in config["merge_method"] else 0
        found |= tie_ambiguous(delta.float(), value(given.get("density", 1.0)), gamma)
    return found


def assert_mergekits(
    config: dict[str, Any], ours: Path, theirs: Path, *, ties_at_cuts: bool = False
) -> int:
    """Every tensor's bits equal (`ties_at_cuts`: but where |δ| ties at a cut of a trimming
    method); returns how many elements differ."""
    mine, reference = load(ours), load(theirs)
    dtype = torch.bfloat16 if config.get("dtype", "bfloat16") == "bfloat16" else torch.float16
    tied = 0
    for name, differ in differing(mine, reference).items():
        assert ties_at_cuts, f"{name}: {int(differ.sum())} of {differ.numel()} elements differ"
        ambiguous = tied_at_a_cut(config, name, dtype)
        assert not (differ & ~ambiguous).any(), f"{name}: differs beyond tied |δ| at a cut"
        tied += int(differ.sum())
    return tied


@pytest.mark.parametrize("family", ["llama", "llama16"])
@pytest.mark.parametrize(
    "method",
    ["linear", "slerp", "task_arithmetic", "ties", "ties_gradients", "breadcrumbs",
     "breadcrumbs_ties", "nuslerp", "model_stock", "passthrough"],
)  # fmt: skip
def test_a_narrow_config_merges_as_mergekit_computes(
    method: str, family: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    fam: Family = request.getfixturevalue(family)
    config = {**configs(fam)[method], "dtype": DTYPES[family]}
    result = merge_config(config, tmp_path / "ours")
    assert result.manifest["recipe"]["arithmetic"] == DTYPES[family]
    assert_mergekits(config, result.out_dir, run_mergekit(config, tmp_path / "mergekit"))


@pytest.mark.parametrize("method", ["task_arithmetic", "ties", "model_stock"])
def test_without_a_dtype_mergekit_computes_in_the_checkpoints_own(
    method: str, llama: Family, tmp_path: Path
) -> None:
    config = configs(llama)[method]
    result = merge_config(config, tmp_path / "ours")
    assert result.manifest["recipe"]["arithmetic"] == "source"
    assert_mergekits(config, result.out_dir, run_mergekit(config, tmp_path / "mergekit"))


@pytest.mark.parametrize("method", ["linear", "ties", "passthrough"])
def test_wider_checkpoints_are_rounded_to_the_dtype_first(
    method: str, llama32: Family, tmp_path: Path
) -> None:
    """float32 checkpoints, `dtype: bfloat16`, written in float32 (`out_dtype`): mergekit
    rounds every input to bf16 (a passthrough's copies too) and its results to bf16."""
    config = {**configs(llama32)[method], "dtype": "bfloat16", "out_dtype": "float32"}
    result = merge_config(config, tmp_path / "ours")
    assert {t.dtype for t in load(result.out_dir).values()} == {torch.float32}
    assert_mergekits(config, result.out_dir, run_mergekit(config, tmp_path / "mergekit"))
    rounded = load(result.out_dir)["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(rounded, rounded.bfloat16().float())


@pytest.mark.parametrize("method", ["ties", "ties_gradients", "breadcrumbs_ties"])
def test_a_tensor_too_large_to_sort_whole_differs_only_at_tied_cuts(
    method: str, llama: Family, tmp_path: Path
) -> None:
    """Chunks of 512 elements: every tensor over 8 of them (4096) is selected from without
    sorting it whole, the first of equal |δ| at a cut kept; mergekit's sort orders them as it
    happens to, so the two differ there, and only there."""
    config = {**configs(llama)[method], "dtype": "bfloat16"}
    ours = merge_config(config, tmp_path / "ours", chunk_elements=512).out_dir
    tied = assert_mergekits(
        config, ours, run_mergekit(config, tmp_path / "mergekit"), ties_at_cuts=True
    )
    assert tied > 0  # bf16 deltas tie: the selections did differ


@pytest.mark.parametrize("method", ["nuslerp", "model_stock"])
def test_a_vector_longer_than_a_chunk_is_measured_by_its_moments(
    method: str, llama: Family, tmp_path: Path
) -> None:
    """Chunks of 512 elements: an angle over a whole tensor of more (nuslerp's and
    model_stock's default) comes from the exact moments of its bf16 entries, where mergekit
    normalises and sums them in bf16: its cos θ, and so the outputs, differ by an ulp or two."""
    config = {**configs(llama)[method], "dtype": "bfloat16"}
    mine = load(merge_config(config, tmp_path / "ours", chunk_elements=512).out_dir)
    theirs = load(run_mergekit(config, tmp_path / "mergekit"))
    assert max(ulp_distance(mine[name], theirs[name]) for name in mine) <= 2


@pytest.mark.parametrize("method", ["linear", "slerp", "task_arithmetic", "ties"])
def test_a_float64_config_computes_and_writes_float64(
    method: str, llama32: Family, tmp_path: Path
) -> None:
    """`dtype: float64`: float32 checkpoints merged in float64 and written in it, as mergekit
    computes and writes them."""
    config = {**configs(llama32)[method], "dtype": "float64"}
    result = merge_config(config, tmp_path / "ours")
    assert result.manifest["recipe"]["arithmetic"] == "float64"
    mine = load(result.out_dir)
    assert {t.dtype for t in mine.values()} == {torch.float64}
    assert not differing(mine, load(run_mergekit(config, tmp_path / "mergekit")))


@pytest.mark.parametrize("method", ["task_arithmetic", "nuslerp", "model_stock"])
def test_float32_arithmetic_is_mergekits_float32_and_differs_from_its_bf16(
    method: str, llama: Family, tmp_path: Path
) -> None:
    """`--arithmetic float32` on a bf16 config: Layerswap's float32 arithmetic, which is what
    mergekit computes with `dtype: float32` (rounded once to bf16), not its bf16 result."""
    config = {**configs(llama)[method], "dtype": "bfloat16"}
    precise = merge_config(config, tmp_path / "float32", arithmetic="float32")
    assert precise.manifest["recipe"]["arithmetic"] == "float32"
    assert any(w.startswith("arithmetic float32: mergekit computes in bfloat16") for w in
               precise.manifest["warnings"])  # fmt: skip
    wide = {**config, "dtype": "float32", "out_dtype": "bfloat16"}
    theirs = load(run_mergekit(wide, tmp_path / "mergekit-float32"))
    mine = load(precise.out_dir)
    assert not differing(mine, theirs)
    narrow = load(merge_config(config, tmp_path / "bfloat16").out_dir)
    assert differing(mine, narrow), "float32 and bf16 arithmetic gave the same bits"


# -- DARE and DELLA: mergekit given the same drops --------------------------------------------
GIVEN_DROPS = Path(__file__).with_name("mergekit_given_drops.py")


def engine_masks(config: dict[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The masks Layerswap draws (seed 0) for each model's delta, rounded to `dtype`."""
    base = load(Path(config["base_model"]))
    models = [load(Path(entry["model"])) for entry in config["models"]]
    params = config["parameters"]
    masks = {}
    for name, b in base.items():
        for i, model in enumerate(models):
            delta = (model[name].to(dtype) - b.to(dtype)).float()
            if config["merge_method"].startswith("dare"):
                mask = dare_mask(delta, params["density"], 0, name, i)
            else:
                mask = della_mask(delta, params["density"], params["epsilon"], 0, name, i)
            masks[f"{name}/{i}"] = mask.contiguous()
    return masks


def run_mergekit_given(config: dict[str, Any], masks: dict[str, torch.Tensor], out: Path) -> Path:
    out.with_suffix(".yml").write_text(yaml.safe_dump(config))
    save_file(masks, str(out.with_suffix(".masks")))
    done = subprocess.run(
        [str(MERGEKIT.with_name("python")), str(GIVEN_DROPS), str(out.with_suffix(".yml")),
         str(out), str(out.with_suffix(".masks"))],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.parametrize("family", ["llama", "llama16"])
@pytest.mark.parametrize(
    ("method", "parameters"),
    [("dare_ties", {"density": 0.4, "normalize": True}), ("dare_linear", {"density": 0.6}),
     ("della", {"density": 0.5, "epsilon": 0.2, "lambda": 1.1})],
)  # fmt: skip
def test_random_drops_given_the_same_masks_merge_as_mergekit_computes(
    method: str, parameters: dict[str, Any], family: str, request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:  # fmt: skip
    """mergekit's DARE and DELLA with torch.bernoulli answering the masks Layerswap draws:
    the thinned deltas rescaled (their L1 norms summed as mergekit sums them: in the narrow
    dtype, in float32 for fp16 on the CPU), weighted, elected and summed as mergekit does,
    bit for bit."""
    fam: Family = request.getfixturevalue(family)
    config = {"merge_method": method, "base_model": str(fam.base), "dtype": DTYPES[family],
              "models": [{"model": str(fam.task), "parameters": {"weight": 1.0}},
                         {"model": str(fam.language), "parameters": {"weight": 0.6}}],
              "parameters": parameters}  # fmt: skip
    ours = merge_config(config, tmp_path / "ours").out_dir
    dtype = torch.bfloat16 if family == "llama" else torch.float16
    theirs = run_mergekit_given(config, engine_masks(config, dtype), tmp_path / "mergekit")
    assert_mergekits(config, ours, theirs)
