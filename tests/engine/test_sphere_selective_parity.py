"""multislerp, karcher, nearswap, sce and arcee_fusion against mergekit 0.1.5 on the same
checkpoints, every tensor compared, and the merged models run by transformers.

mergekit computes in its `dtype` (bf16 arithmetic when that is bfloat16), and so does the
translated recipe; most cases run with dtype float32 and out_dtype the checkpoints' own, one per
method with dtype bfloat16. Expected: equal bits where a tensor is read whole (every tensor of
these test models at the default chunk), and for multislerp where a tensor larger than a chunk
is read in pieces (its sums taken in torch's order, torch_order.py); for karcher and sce in
pieces, within an ulp (karcher's Gram matrix, sce's mean squares summed in another order than
mergekit's one reduction).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import Family
from tests.engine.mergekit_parity import (
    family_config,
    run_mergekit,
    translated_merge,
    ulp_distance,
    worst_ulps,
)
from tests.engine.test_output import assert_forward_pass
from tests.engine.vocabularies import embedding_names, make_chat_family, vocabulary
from tests.reference import load

SMALL_CHUNK = 1000  # every 2-D weight of the test models is larger: read in pieces
# equal to mergekit's bits read in pieces too, at these chunks: sce's selection is torch.topk's
# own while a tensor fits in memory (8 chunks: every tensor here at 4,096), else its ties at
# the cut are kept in flat order (test_tensors_larger_than_a_chunk_within_ulps_of_mergekit)
EXACT_IN_PIECES = {"multislerp": SMALL_CHUNK, "sce": 4096}


def _dtype(family_name: str) -> str:
    return "bfloat16" if family_name == "llama" else "float32"


MULTISLERP_CASES = {
    "two": ("llama", False, [("task", {"weight": 0.3}), ("language", {"weight": 0.7})], {}),
    "three": (
        "llama",
        False,
        [("task", {"weight": 1.0}), ("language", {"weight": [0.5, 2.0]}),
         ("task2", {"weight": 0.8})],
        {},
    ),
    "three-base": (
        "llama32",
        True,
        [("task", {"weight": 1.0}), ("language", {"weight": [0.5, 2.0]}),
         ("task2", {"weight": 0.8})],
        {},
    ),
    "unnormalized-filters-base": (
        "llama",
        True,
        [("task", {"weight": 0.4}), ("language", {"weight": 0.5})],
        {"normalize_weights": [{"filter": "mlp", "value": False}, {"value": True}]},
    ),
    "unnormalized-eps": (
        "llama32",
        False,
        [("task", {"weight": 0.4}), ("language", {"weight": 0.5}), ("task2", {"weight": 0.2})],
        {"normalize_weights": False, "eps": 1e-3},
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(MULTISLERP_CASES))
def test_multislerp_equals_mergekit(
    case: str, request: pytest.FixtureRequest, run_merge: Any, tmp_path: Path
) -> None:
    """Read whole, and in pieces of 1,000 elements (its norms and dot products then summed
    piece by piece in torch's order, torch_order.py). (The bf16 family's norm weights are the
    base's in every model: three task vectors of zero, which mergekit refuses, so the cases
    with a base and three models are float32.)"""
    family_name, with_base, models, shared = MULTISLERP_CASES[case]
    fam: Family = request.getfixturevalue(family_name)
    config = family_config("multislerp", fam, models, _dtype(family_name), parameters=shared)
    if with_base:
        config["base_model"] = str(fam.base)
    theirs = run_mergekit(config, tmp_path / "mergekit")
    assert worst_ulps(translated_merge(config, run_merge), theirs) == 0
    in_pieces = translated_merge(config, run_merge, chunk_elements=SMALL_CHUNK)
    assert worst_ulps(in_pieces, theirs) == 0


@pytest.mark.parametrize("family_name", ["llama", "llama32"])
@pytest.mark.parametrize(
    ("names", "with_base", "shared"),
    [(["task", "language"], False, {}), (["task", "language", "task2"], True, {}),
     (["task", "language", "language2"], False, {"max_iter": 2, "tol": 1e-7}),
     (["task", "language", "language2"], False, {"max_iter": 50, "tol": 1e-9})],
    ids=["two", "base-joins", "stopped-early", "long"],
)  # fmt: skip
def test_karcher_equals_mergekit(
    family_name: str,
    names: list[str],
    with_base: bool,
    shared: dict[str, Any],
    request: pytest.FixtureRequest,
    run_merge: Any,
    tmp_path: Path,
) -> None:
    """Its angles come from torch.dot, whose sum (BLAS) is ordered by the thread count for
    tensors of 8192 elements and more, and arccos near 1 magnifies its last bit: a descent
    stopped before it converges is equal only on mergekit's thread count, the process's
    default, on which the kernel takes them too."""
    fam: Family = request.getfixturevalue(family_name)
    config = family_config("karcher", fam, [(n, {}) for n in names], _dtype(family_name),
                     parameters=shared)  # fmt: skip
    if with_base:  # mergekit merges it as one more model
        config["base_model"] = str(fam.base)
    ours = translated_merge(config, run_merge)
    assert worst_ulps(ours, run_mergekit(config, tmp_path / "mergekit")) == 0
    if shared:  # the parameters count: the defaults give another result
        default = load(translated_merge({**config, "parameters": {}}, run_merge))
        assert any(not torch.equal(default[n], t) for n, t in load(ours).items())


@pytest.mark.parametrize("family_name", ["llama", "llama32"])
@pytest.mark.parametrize(
    "t", [0.002, [0.0005, 0.004, 0.001], [{"filter": "mlp", "value": 0.01}, {"value": 0.0}]],
    ids=["number", "gradient", "filters"],
)  # fmt: skip
def test_nearswap_equals_mergekit(
    family_name: str, t: Any, request: pytest.FixtureRequest, run_merge: Any, tmp_path: Path
) -> None:
    fam: Family = request.getfixturevalue(family_name)
    config = family_config("nearswap", fam, [("task", {})], _dtype(family_name),
                           parameters={"t": t}, base_model=str(fam.base))  # fmt: skip
    ours = translated_merge(config, run_merge)
    assert worst_ulps(ours, run_mergekit(config, tmp_path / "mergekit")) == 0


@pytest.mark.parametrize("family_name", ["llama", "llama32"])
@pytest.mark.parametrize(
    ("names", "select_topk"),
    [(["task", "language"], 1.0), (["task", "language", "task2"], 0.3),
     (["task"], 0.5), (["task", "language"], [0.1, 0.9])],
    ids=["all", "three-top-30", "one-model", "gradient"],
)  # fmt: skip
def test_sce_equals_mergekit(
    family_name: str,
    names: list[str],
    select_topk: Any,
    request: pytest.FixtureRequest,
    run_merge: Any,
    tmp_path: Path,
) -> None:
    fam: Family = request.getfixturevalue(family_name)
    config = family_config("sce", fam, [(n, {}) for n in names], _dtype(family_name),
                     base_model=str(fam.base), parameters={"select_topk": select_topk})  # fmt: skip
    ours = translated_merge(config, run_merge)
    assert worst_ulps(ours, run_mergekit(config, tmp_path / "mergekit")) == 0


@pytest.mark.parametrize("family_name", ["llama", "llama32"])
def test_arcee_fusion_equals_mergekit(
    family_name: str, request: pytest.FixtureRequest, run_merge: Any, tmp_path: Path
) -> None:
    fam: Family = request.getfixturevalue(family_name)
    config = family_config("arcee_fusion", fam, [("base", {}), ("language", {})],
                           _dtype(family_name), base_model=str(fam.base))  # fmt: skip
    ours = translated_merge(config, run_merge)
    assert worst_ulps(ours, run_mergekit(config, tmp_path / "mergekit")) == 0


PIECES = {
    "karcher": ([("task", {}), ("language", {}), ("task2", {})], {}, False),
    "sce": ([("task", {}), ("language", {}), ("task2", {})], {}, True),
    "arcee_fusion": ([("language", {})], {}, True),
}  # fmt: skip


@pytest.mark.parametrize("method", list(PIECES))
def test_tensors_larger_than_a_chunk_within_ulps_of_mergekit(
    method: str, llama: Family, run_merge: Any, tmp_path: Path
) -> None:
    """With chunks of 1,000 elements every weight of the test models is read in pieces: its
    statistics are summed in another order than mergekit's, so the bf16 outputs stay within an
    ulp of mergekit's (arcee_fusion's quantiles are exact order statistics: equal; sce's
    selection in pieces: test_sce_selection_in_pieces_near_mergekit)."""
    models, shared, with_base = PIECES[method]
    config = family_config(method, llama, models, "bfloat16", parameters=shared)
    if with_base:
        config["base_model"] = str(llama.base)
    ours = translated_merge(config, run_merge, chunk_elements=SMALL_CHUNK)
    worst = worst_ulps(ours, run_mergekit(config, tmp_path / "mergekit"))
    assert worst <= (0 if method == "arcee_fusion" else 1)


def test_sce_selection_in_pieces_near_mergekit(
    llama32: Family, run_merge: Any, tmp_path: Path
) -> None:
    """Read in pieces, sce selects the same entries as mergekit where no two variances tie at
    the cut (float32 deltas: none do here; of tied ones Layerswap keeps the first in flat
    order, mergekit's torch.topk its own), and its mean squares are summed in float64: the
    outputs agree to float32 rounding of the weights, 1e-5 of the tensor's largest change."""
    names = ["task", "language", "task2"]
    config = family_config("sce", llama32, [(n, {}) for n in names], "float32",
                     base_model=str(llama32.base), parameters={"select_topk": 0.4})  # fmt: skip
    ours = load(translated_merge(config, run_merge, chunk_elements=SMALL_CHUNK))
    theirs = load(run_mergekit(config, tmp_path / "mergekit"))
    base, models = load(llama32.base), [load(getattr(llama32, n)) for n in names]
    for name, expected in theirs.items():
        deltas = torch.stack([m[name].flatten() - base[name].flatten() for m in models])
        variance = torch.var(deltas, dim=0, unbiased=False).abs()
        k = int(torch.count_nonzero(variance) * 0.4)
        assert k == 0 or int((variance == torch.topk(variance, k).values[-1]).sum()) == 1
        change = float((expected - base[name]).abs().max())
        assert float((ours[name] - expected).abs().max()) <= 1e-5 * change, name


BF16_CASES = {
    "multislerp": ([("task", {"weight": 0.3}), ("language", {"weight": 0.7})], {}, True),
    "karcher": ([("task", {}), ("language", {}), ("task2", {})], {}, False),
    "nearswap": ([("task", {})], {"t": 0.002}, True),
    "sce": ([("task", {}), ("language", {}), ("task2", {})], {"select_topk": 0.4}, True),
    "arcee_fusion": ([("language", {})], {}, True),
}


@pytest.mark.parametrize("method", list(BF16_CASES))
def test_in_mergekits_bfloat16_arithmetic_equal_too(
    method: str, llama: Family, run_merge: Any, tmp_path: Path
) -> None:
    """With `dtype: bfloat16` mergekit computes each step in bf16 (karcher's norms in float32,
    arcee_fusion's mask as float32): the translated recipe computes as it does, bit for bit."""
    models, shared, with_base = BF16_CASES[method]
    config = {
        **family_config(method, llama, models, "bfloat16", parameters=shared),
        "dtype": "bfloat16",
    }
    if with_base:
        config["base_model"] = str(llama.base)
    theirs = run_mergekit(config, tmp_path / "mergekit")
    assert worst_ulps(translated_merge(config, run_merge), theirs) == 0
    if method in EXACT_IN_PIECES:
        in_pieces = translated_merge(config, run_merge, chunk_elements=EXACT_IN_PIECES[method])
        assert worst_ulps(in_pieces, theirs) == 0


@pytest.mark.parametrize("method", ["multislerp", "karcher", "sce", "arcee_fusion"])
def test_with_tokenizer_source_equals_mergekit(
    method: str, tmp_path_factory: pytest.TempPathFactory, run_merge: Any, tmp_path: Path
) -> None:
    """Fine-tunes that added different tokens, merged over the union of their vocabularies:
    each output token's embedding and head rows, compared by token, and every other tensor
    equal mergekit's bit for bit (float32 checkpoints)."""
    family = make_chat_family(tmp_path_factory.mktemp("vocab"), dtype=torch.float32, seed=7)
    models = [family.chat] if method == "arcee_fusion" else [family.chat, family.tool]
    weights: dict[str, Any] = {"weight": 1.0} if method == "multislerp" else {}
    config = {
        "merge_method": method,
        "models": [{"model": str(m), "parameters": weights} for m in models],
        "dtype": "float32",
        "out_dtype": "float32",
        "tokenizer_source": "union",
    }
    if method != "karcher":
        config["base_model"] = str(family.base)
    ours, theirs = translated_merge(config, run_merge), run_mergekit(config, tmp_path / "mergekit")
    mine, reference = vocabulary(ours), vocabulary(theirs)
    assert set(mine) == set(reference) and len(mine) > 256
    ours_t, theirs_t = load(ours), load(theirs)
    assert set(ours_t) == set(theirs_t)
    order = sorted(mine)
    for name in ours_t:
        if name in embedding_names(ours_t):
            a = ours_t[name][[mine[t] for t in order]]
            b = theirs_t[name][[reference[t] for t in order]]
        else:
            a, b = ours_t[name], theirs_t[name]
        assert ulp_distance(a, b) == 0, name


def test_merged_models_load_and_run(llama: Family, run_merge: Any) -> None:
    for recipe in (
        {"method": "multislerp", "base": llama.base,
         "models": [llama.task, llama.language, llama.task2]},
        {"method": "karcher", "models": [llama.task, llama.language, llama.task2]},
        {"method": "nearswap", "base": llama.base, "models": [llama.task],
         "params": {"t": 0.001}},
        {"method": "sce", "base": llama.base, "models": [llama.task, llama.language],
         "params": {"select_topk": 0.5}},
        {"method": "arcee_fusion", "base": llama.base, "models": [llama.language]},
    ):  # fmt: skip
        result = run_merge(recipe)
        assert result.manifest["recipe"]["method"] == recipe["method"]
        assert_forward_pass(result.out_dir)
