"""Layer swapping (docs/concepts/layer-swap.md) against an independent in-memory reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.conftest import Family
from tests.reference import (
    accumulation_slack,
    assert_equal,
    assert_within_ulps,
    combine,
    inverse_weights,
    layer_of,
    load,
    magnitude,
    raw_tensors,
    swap_region,
)

# Layer-swap params over the 6-layer fixtures; unspecified ones take DEFAULTS.
CASES: dict[str, dict[str, Any]] = {
    "copies-nonlayer-task": {"bottom": 2, "top": 1, "non_layer": "task"},
    "copies-nonlayer-language": {"bottom": 1, "top": 2, "non_layer": "language"},
    "nonlayer-average": {"bottom": 2, "top": 2, "non_layer": "average"},
    "bottom-transition": {"bottom": 1, "top": 1, "bottom_transition": 2, "non_layer": "task"},
    "top-transition": {"bottom": 2, "top": 0, "top_transition": 1},
    "both-transitions": {"bottom": 1, "top": 1, "bottom_transition": 1, "top_transition": 1},
    "explicit-weights": {
        "bottom": 1,
        "top": 1,
        "bottom_transition": 1,
        "top_transition": 2,
        "transition_weights": {"task": 0.7, "language": 0.2},
    },
    "explicit-weights-zero-language": {
        "bottom": 0,
        "top": 1,
        "bottom_transition": 2,
        "transition_weights": {"task": 3, "language": 0},
        "non_layer": "language",
    },
    "all-task": {"bottom": 0, "top": 0, "non_layer": "task"},
    "all-language": {"bottom": 6, "top": 0, "non_layer": "language"},
    "no-task-layers": {"bottom": 2, "bottom_transition": 1, "top_transition": 1, "top": 2},
}
DEFAULTS = {
    "bottom": 5,
    "top": 2,
    "bottom_transition": 0,
    "top_transition": 0,
    "transition_weights": "uniform",
    "non_layer": "average",
}


def transition_weights(spec: Any) -> tuple[float, float]:
    if spec == "uniform":
        return 0.5, 0.5
    total = spec["task"] + spec["language"]
    return spec["task"] / total, spec["language"] / total


def expected_origin(name: str, num_layers: int, p: dict[str, Any]) -> str:
    layer = layer_of(name)
    if layer is None:
        return str(p["non_layer"])
    b, u = p["bottom"], p["top"]
    return swap_region(layer, num_layers, b, u, p["bottom_transition"], p["top_transition"])


def reference_swap(
    task: dict[str, torch.Tensor],
    language: dict[str, torch.Tensor],
    num_layers: int,
    p: dict[str, Any],
    weights: tuple[float, float],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(expected tensors, origin of each tensor) for one expert per role."""
    out, origins = {}, {}
    for name, t in task.items():
        origin = expected_origin(name, num_layers, p)
        origins[name] = origin
        if origin == "task":
            out[name] = t
        elif origin == "language":
            out[name] = language[name]
        elif origin == "transition":
            out[name] = combine(weights, [t, language[name]]).to(t.dtype)
        else:
            out[name] = (0.5 * t.float() + 0.5 * language[name].float()).to(t.dtype)
    return out, origins


@pytest.mark.parametrize("case", list(CASES))
def test_layer_swap_matches_reference(case: str, llama: Family, run_merge: Any) -> None:
    p = {**DEFAULTS, **CASES[case]}
    result = run_merge(
        {
            "method": "layer_swap",
            "experts": {"task": [llama.task], "language": [llama.language]},
            "params": CASES[case],
        }
    )
    task, language = load(llama.task), load(llama.language)
    expected, origins = reference_swap(
        task, language, llama.num_layers, p, transition_weights(p["transition_weights"])
    )
    out = load(result.out_dir)
    assert set(out) == set(expected)
    for name, tensor in expected.items():
        assert_equal(out[name], tensor, name)

    # Copies are byte-for-byte the input's stored bytes.
    raw_out = raw_tensors(result.out_dir)
    raw_in = {"task": raw_tensors(llama.task), "language": raw_tensors(llama.language)}
    copies = [n for n, o in origins.items() if o in raw_in]
    for name in copies:
        assert raw_out[name] == raw_in[origins[name]][name], name
    if CASES[case].get("non_layer") in ("task", "language"):
        assert len(copies) >= sum(layer_of(n) is None for n in origins)

    # Provenance in layerswap.json agrees with the region table.
    rows = {row["layer"]: row["origin"] for row in result.manifest["layers"]}
    for layer in range(llama.num_layers):
        region = swap_region(
            layer,
            llama.num_layers,
            p["bottom"],
            p["top"],
            p["bottom_transition"],
            p["top_transition"],
        )
        assert rows[str(layer)] == region
    assert rows["non-layer"] == p["non_layer"]


def test_transitions_really_mix(llama: Family, run_merge: Any) -> None:
    """Guard against a vacuous reference: transition layers differ from both experts."""
    result = run_merge(
        {
            "method": "layer_swap",
            "experts": {"task": [llama.task], "language": [llama.language]},
            "params": {"bottom": 1, "top": 1, "bottom_transition": 1, "top_transition": 1},
        }
    )
    out, task, language = load(result.out_dir), load(llama.task), load(llama.language)
    name = "model.layers.1.mlp.down_proj.weight"
    assert not torch.equal(out[name], task[name])
    assert not torch.equal(out[name], language[name])
    assert torch.equal(
        out["model.layers.0.mlp.down_proj.weight"], language["model.layers.0.mlp.down_proj.weight"]
    )
    assert torch.equal(
        out["model.layers.2.mlp.down_proj.weight"], task["model.layers.2.mlp.down_proj.weight"]
    )


def test_magnitude_transition_weights(llama: Family, run_merge: Any) -> None:
    params = {
        "bottom": 1,
        "top": 1,
        "bottom_transition": 1,
        "top_transition": 1,
        "transition_weights": "magnitude",
        "non_layer": "average",
    }
    result = run_merge(
        {
            "method": "layer_swap",
            "base": llama.base,
            "experts": {"task": [llama.task], "language": [llama.language]},
            "params": params,
        }
    )
    base, task, language = load(llama.base), load(llama.task), load(llama.language)
    w_task, w_language = inverse_weights([magnitude(task, base), magnitude(language, base)])
    assert abs(w_task - 0.5) > 0.01, "fixture experts should differ in magnitude"
    resolved = result.manifest["resolved_weights"]["transition"]
    assert resolved["task"] == pytest.approx(w_task, rel=1e-5)
    assert resolved["language"] == pytest.approx(w_language, rel=1e-5)

    expected, origins = reference_swap(
        task, language, llama.num_layers, {**DEFAULTS, **params}, (w_task, w_language)
    )
    out = load(result.out_dir)
    for name, tensor in expected.items():
        if origins[name] == "transition":
            # Magnitudes are summed in a different order than here: allow 1 ulp.
            expected_f32 = combine((w_task, w_language), [task[name], language[name]])
            assert_within_ulps(out[name], expected_f32, 1, name)
        else:
            assert_equal(out[name], tensor, name)


@pytest.mark.parametrize("family_name", ["llama", "llama32"])
@pytest.mark.parametrize("expert_soup", ["uniform", "magnitude"])
def test_several_experts_per_role(
    family_name: str, expert_soup: str, request: pytest.FixtureRequest, run_merge: Any
) -> None:
    fam: Family = request.getfixturevalue(family_name)
    tasks = [fam.task, fam.task2]
    languages = [fam.language, fam.language2, fam.language3]
    params = {
        "bottom": 1,
        "top": 1,
        "bottom_transition": 1,
        "top_transition": 1,
        "transition_weights": {"task": 2, "language": 1},
        "non_layer": "average",
        "expert_soup": expert_soup,
    }
    recipe: dict[str, Any] = {
        "method": "layer_swap",
        "experts": {"task": tasks, "language": languages},
        "params": params,
    }
    if expert_soup == "magnitude":
        recipe["base"] = fam.base
    result = run_merge(recipe)

    task_models = [load(p) for p in tasks]
    language_models = [load(p) for p in languages]
    if expert_soup == "uniform":
        task_soup, language_soup = [1 / 2] * 2, [1 / 3] * 3
    else:
        base = load(fam.base)
        task_soup = inverse_weights([magnitude(m, base) for m in task_models])
        language_soup = inverse_weights([magnitude(m, base) for m in language_models])
        assert max(language_soup) - min(language_soup) > 0.01
    resolved = result.manifest["resolved_weights"]
    assert resolved["task_soup"] == pytest.approx(task_soup, rel=1e-5)
    assert resolved["language_soup"] == pytest.approx(language_soup, rel=1e-5)

    out = load(result.out_dir)
    assert set(out) == set(task_models[0])
    for name in task_models[0]:
        # Soup each role first, then mix: the straightforward reading of the documented rule.
        t_soup = combine(task_soup, [m[name] for m in task_models])
        l_soup = combine(language_soup, [m[name] for m in language_models])
        origin = expected_origin(name, fam.num_layers, {**DEFAULTS, **params})
        mix = {
            "task": (1.0, 0.0),
            "language": (0.0, 1.0),
            "transition": (2 / 3, 1 / 3),
            "average": (0.5, 0.5),
        }[origin]
        expected = mix[0] * t_soup + mix[1] * l_soup
        coefficients = [mix[0] * c for c in task_soup] + [mix[1] * c for c in language_soup]
        inputs = [m[name] for m in task_models + language_models]
        slack = accumulation_slack(coefficients, inputs)
        assert_within_ulps(out[name], expected, 1, name, slack)


def test_default_params_need_enough_layers(llama: Family, run_merge: Any) -> None:
    """Paper defaults (b=5, u=2) do not fit a 6-layer model: a params error, no output."""
    from engine.errors import RecipeError

    with pytest.raises(RecipeError) as info:
        run_merge(
            {
                "method": "layer_swap",
                "experts": {"task": [llama.task], "language": [llama.language]},
            }
        )
    assert info.value.details["field"] == "params"
    assert "7" in info.value.message and "6" in info.value.message


def test_qwen2_layer_swap(qwen2: Family, run_merge: Any) -> None:
    params = {"bottom": 1, "top": 1, "bottom_transition": 1, "non_layer": "average"}
    result = run_merge(
        {
            "method": "layer_swap",
            "experts": {"task": [qwen2.task], "language": [qwen2.language]},
            "params": params,
        }
    )
    task, language = load(qwen2.task), load(qwen2.language)
    assert any(n.endswith("q_proj.bias") for n in task), "Qwen2 has attention biases"
    expected, _ = reference_swap(
        task, language, qwen2.num_layers, {**DEFAULTS, **params}, (0.5, 0.5)
    )
    out = load(result.out_dir)
    assert set(out) == set(expected)
    for name, tensor in expected.items():
        assert_equal(out[name], tensor, name)


def test_tied_embeddings_layer_swap(gemma_tied: Family, run_merge: Any) -> None:
    params = {"bottom": 1, "top": 1, "top_transition": 1, "non_layer": "language"}
    result = run_merge(
        {
            "method": "layer_swap",
            "experts": {"task": [gemma_tied.task], "language": [gemma_tied.language]},
            "params": params,
        }
    )
    task, language = load(gemma_tied.task), load(gemma_tied.language)
    assert "lm_head.weight" not in task
    expected, _ = reference_swap(
        task, language, gemma_tied.num_layers, {**DEFAULTS, **params}, (0.5, 0.5)
    )
    out = load(result.out_dir)
    assert set(out) == set(expected)
    assert "lm_head.weight" not in out
    for name, tensor in expected.items():
        assert_equal(out[name], tensor, name)
