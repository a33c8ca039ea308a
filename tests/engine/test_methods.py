"""Soup, task arithmetic and output dtype conversion against in-memory references."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from tests.conftest import Family
from tests.reference import (
    accumulation_slack,
    assert_equal,
    assert_within_ulps,
    combine,
    header_dtypes,
    inverse_weights,
    load,
    magnitude,
    raw_tensors,
)


# -- soup ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("models", "weights", "coefficients"),
    [
        (["task", "language"], "uniform", [0.5, 0.5]),
        (["task", "language", "task2"], "uniform", [1 / 3, 1 / 3, 1 / 3]),
        (["task", "language"], [3, 1], [0.75, 0.25]),
        (["task", "language", "language2"], [2, 1, 1], [0.5, 0.25, 0.25]),
        (["task", "language"], [0.3, 0.6], [0.3 / 0.9, 0.6 / 0.9]),
        (["task", "language"], [2, -1], [2.0, -1.0]),  # extrapolation: sums to 1, allowed
    ],
    ids=[
        "uniform2",
        "uniform3",
        "explicit-3-1",
        "explicit-2-1-1",
        "explicit-unnormalised",
        "negative",
    ],
)
@pytest.mark.parametrize("family_name", ["llama", "llama32"])
def test_soup_matches_reference(
    family_name: str,
    models: list[str],
    weights: Any,
    coefficients: list[float],
    request: pytest.FixtureRequest,
    run_merge: Any,
) -> None:
    fam: Family = request.getfixturevalue(family_name)
    paths = [getattr(fam, m) for m in models]
    result = run_merge({"method": "soup", "models": paths, "params": {"weights": weights}})
    inputs = [load(p) for p in paths]
    out = load(result.out_dir)
    assert set(out) == set(inputs[0])
    assert result.manifest["resolved_weights"]["models"] == pytest.approx(coefficients)
    for name, first in inputs[0].items():
        expected = combine(coefficients, [m[name] for m in inputs]).to(first.dtype)
        assert_equal(out[name], expected, name)


@pytest.mark.parametrize("family_name", ["llama", "llama32"])
def test_soup_magnitude_weights(
    family_name: str, request: pytest.FixtureRequest, run_merge: Any
) -> None:
    fam: Family = request.getfixturevalue(family_name)
    paths = [fam.task, fam.language, fam.language3]
    result = run_merge(
        {"method": "soup", "base": fam.base, "models": paths, "params": {"weights": "magnitude"}}
    )
    base = load(fam.base)
    inputs = [load(p) for p in paths]
    coefficients = inverse_weights([magnitude(m, base) for m in inputs])
    assert max(coefficients) - min(coefficients) > 0.01
    assert result.manifest["resolved_weights"]["models"] == pytest.approx(coefficients, rel=1e-5)
    out = load(result.out_dir)
    for name, first in inputs[0].items():
        tensors = [m[name] for m in inputs]
        slack = accumulation_slack(coefficients, tensors)
        assert_within_ulps(out[name], combine(coefficients, tensors), 1, name, slack)
        assert out[name].dtype == first.dtype


def test_soup_other_architectures(qwen2: Family, gemma_tied: Family, run_merge: Any) -> None:
    for fam in (qwen2, gemma_tied):
        result = run_merge({"method": "soup", "models": [fam.task, fam.language]})
        task, language = load(fam.task), load(fam.language)
        out = load(result.out_dir)
        assert set(out) == set(task)
        for name in task:
            expected = (0.5 * task[name].float() + 0.5 * language[name].float()).to(
                task[name].dtype
            )
            assert_equal(out[name], expected, name)


# -- task arithmetic -------------------------------------------------------------------------
def task_arithmetic_reference(
    base: torch.Tensor, experts: list[torch.Tensor], weights: list[float], lambda_: float
) -> torch.Tensor:
    """base + λ Σ w_i (T_i − base), in float64 (unrounded)."""
    b = base.double()
    total = torch.zeros_like(b)
    for w, t in zip(weights, experts, strict=True):
        total += w * (t.double() - b)
    return b + lambda_ * total


@pytest.mark.parametrize(
    ("models", "weights", "lambda_"),
    [
        (["task", "language"], "uniform", 1.0),
        (["task", "language"], [1.0, 0.5], 0.7),
        (["task", "language", "language2"], [0.3, 0.3, 0.4], 1.5),
        (["task"], "uniform", 0.5),
    ],
    ids=["uniform", "weights-lambda", "three-models", "single"],
)
@pytest.mark.parametrize("family_name", ["llama32", "llama"])
def test_task_arithmetic(
    family_name: str,
    models: list[str],
    weights: Any,
    lambda_: float,
    request: pytest.FixtureRequest,
    run_merge: Any,
) -> None:
    fam: Family = request.getfixturevalue(family_name)
    paths = [getattr(fam, m) for m in models]
    result = run_merge(
        {
            "method": "task_arithmetic",
            "base": fam.base,
            "models": paths,
            "params": {"weights": weights, "lambda": lambda_},
        }
    )
    w = [1.0] * len(paths) if weights == "uniform" else weights
    base = load(fam.base)
    inputs = [load(p) for p in paths]
    out = load(result.out_dir)
    assert set(out) == set(base)
    moved = 0
    for name, b in base.items():
        tensors = [m[name] for m in inputs]
        expected = task_arithmetic_reference(b, tensors, w, lambda_)
        assert out[name].dtype == b.dtype
        # The engine may expand the formula into one linear combination; allow float32
        # rounding of that (tight for float32 inputs) plus one ulp of the output dtype.
        coefficients = [1.0, lambda_ * sum(w), *(lambda_ * x for x in w)]
        slack = accumulation_slack(coefficients, [b, b, *tensors])
        assert_within_ulps(out[name], expected, 1, name, slack)
        moved += int(not torch.equal(out[name], b))
    assert moved > 0, "task arithmetic should change the base"


def test_task_arithmetic_float32_is_tight(llama32: Family, run_merge: Any) -> None:
    result = run_merge(
        {
            "method": "task_arithmetic",
            "base": llama32.base,
            "models": [llama32.task, llama32.language],
            "params": {"lambda": 0.8},
        }
    )
    base, task, language = load(llama32.base), load(llama32.task), load(llama32.language)
    out = load(result.out_dir)
    for name, b in base.items():
        expected = task_arithmetic_reference(b, [task[name], language[name]], [1.0, 1.0], 0.8)
        scale = float(b.abs().max()) or 1.0
        torch.testing.assert_close(
            out[name].double(), expected, rtol=1e-6, atol=1e-6 * scale, msg=name
        )


@pytest.mark.parametrize("normalize", [False, True])
def test_task_arithmetic_rounds_each_step_of_the_delta_order(
    normalize: bool, llama32: Family, run_merge: Any
) -> None:
    """base + λ·Σ w_i·(T_i − base) in float32 step by step (the order mergekit rounds in):
    equal bits, where the expanded (1 − λΣw)·base + Σ λw_i·T_i cancels and differs."""
    weights, lambda_ = [0.7, -0.3, 0.45], 1.3
    names = ["task", "language", "task2"]
    result = run_merge({
        "method": "task_arithmetic", "base": llama32.base,
        "models": [getattr(llama32, m) for m in names],
        "params": {"weights": weights, "lambda": lambda_, "normalize": normalize},
    })  # fmt: skip
    base, experts = load(llama32.base), [load(getattr(llama32, m)) for m in names]
    out = load(result.out_dir)
    divisor = torch.tensor(weights, dtype=torch.float32).sum()
    for name, b in base.items():
        mixed = torch.zeros_like(b)
        for w, expert in zip(weights, experts, strict=True):
            mixed = mixed + (expert[name] - b) * torch.tensor(w, dtype=torch.float32)
        if normalize:
            mixed = mixed / divisor
        assert_equal(out[name], b + mixed * torch.tensor(lambda_, dtype=torch.float32), name)


# -- output dtype ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("family_name", "dtype", "torch_dtype", "header"),
    [
        ("llama", "float32", torch.float32, "F32"),
        ("llama", "float16", torch.float16, "F16"),
        ("llama32", "bfloat16", torch.bfloat16, "BF16"),
        ("llama32", "float16", torch.float16, "F16"),
    ],
)
def test_soup_output_dtype(
    family_name: str,
    dtype: str,
    torch_dtype: torch.dtype,
    header: str,
    request: pytest.FixtureRequest,
    run_merge: Any,
) -> None:
    fam: Family = request.getfixturevalue(family_name)
    result = run_merge(
        {"method": "soup", "models": [fam.task, fam.language], "output": {"dtype": dtype}}
    )
    assert set(header_dtypes(result.out_dir).values()) == {header}
    task, language = load(fam.task), load(fam.language)
    out = load(result.out_dir)
    for name in task:
        expected = (0.5 * task[name].float() + 0.5 * language[name].float()).to(torch_dtype)
        assert_equal(out[name], expected, name)


def test_layer_swap_output_float32_converts_copies(llama: Family, run_merge: Any) -> None:
    params = {"bottom": 2, "top": 1, "non_layer": "task"}
    experts = {"task": [llama.task], "language": [llama.language]}
    result = run_merge(
        {
            "method": "layer_swap",
            "experts": experts,
            "params": params,
            "output": {"dtype": "float32"},
        }
    )
    assert set(header_dtypes(result.out_dir).values()) == {"F32"}
    task, language = load(llama.task), load(llama.language)
    out = load(result.out_dir)
    assert_equal(
        out["model.layers.0.self_attn.q_proj.weight"],
        language["model.layers.0.self_attn.q_proj.weight"].float(),
    )
    assert_equal(
        out["model.layers.3.self_attn.q_proj.weight"],
        task["model.layers.3.self_attn.q_proj.weight"].float(),
    )
    assert_equal(out["model.embed_tokens.weight"], task["model.embed_tokens.weight"].float())
    # ... and config.json declares it, so transformers loads float32 rather than the source's
    config = json.loads((result.out_dir / "config.json").read_text())
    assert config["dtype"] == "float32"
    assert json.loads((llama.task / "config.json").read_text())["dtype"] == "bfloat16"


def test_same_dtype_request_still_copies_bytes(llama: Family, run_merge: Any) -> None:
    result = run_merge(
        {
            "method": "layer_swap",
            "experts": {"task": [llama.task], "language": [llama.language]},
            "params": {"bottom": 2, "top": 2, "non_layer": "language"},
            "output": {"dtype": "bfloat16"},
        }
    )
    raw_out, raw_language = raw_tensors(result.out_dir), raw_tensors(llama.language)
    assert (
        raw_out["model.layers.5.mlp.up_proj.weight"]
        == (raw_language["model.layers.5.mlp.up_proj.weight"])
    )
    assert raw_out["lm_head.weight"] == raw_language["lm_head.weight"]
