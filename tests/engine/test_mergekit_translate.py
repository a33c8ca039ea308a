"""mergekit 0.1.5 configs translated into Layerswap recipes: every method and field, the
parameters' precedence (a model's own, its slice's, the config's, the default), and each
refusal named by the mergekit field. Pure: no checkpoints (test_mergekit_configs.py runs them)."""

from __future__ import annotations

from array import array
from types import SimpleNamespace
from typing import Any

import pytest

from engine.errors import RecipeError
from engine.mergekit import MergekitOrigin, is_mergekit_config, translate
from engine.plan.model import InputRef
from engine.recipe import parse_recipe, recipe_to_dict, slice_recipes
from engine.schema.settings import position, resolve
from engine.vocabulary.alignment import EVERY, MEAN


def local(path: str) -> bool:
    return path.startswith(("./", "/"))


def recipe(config: dict[str, Any], **options: Any) -> dict[str, Any]:
    return recipe_to_dict(translate(config, is_local=local, **options).recipe)


def warnings(config: dict[str, Any]) -> tuple[str, ...]:
    return translate(config, is_local=local).origin.warnings


def refused(config: dict[str, Any], field: str, words: str = "", **options: Any) -> str:
    with pytest.raises(RecipeError) as caught:
        translate(config, is_local=local, **options)
    assert caught.value.details["field"] == field, caught.value.message
    assert caught.value.message.startswith(f"{field}: ")
    assert words in caught.value.message
    return caught.value.message


def models(*entries: tuple[str, dict[str, Any] | None]) -> list[dict[str, Any]]:
    return [{"model": m, **({"parameters": p} if p is not None else {})} for m, p in entries]


# -- mergekit's precedence, written out independently of the translator ----------------------
def mergekit_value(places: list[Any], name: str, at: float, default: Any = None) -> Any:
    """mergekit's resolve_parameter: the first place whose setting gives a value wins; a
    setting of conditions gives none when no filter is part of the name."""
    for setting in places:
        if setting is None:
            continue
        if isinstance(setting, dict):
            setting = [setting]
        if not isinstance(setting, list):
            return float(setting)
        if setting and all(not isinstance(s, dict) for s in setting):
            return gradient(setting, at)
        for condition in setting:
            f = condition.get("filter")
            if f in (None, "*") or f in name:
                value = condition["value"]
                return gradient(value, at) if isinstance(value, list) else float(value)
    return default


def gradient(anchors: list[float], at: float) -> float:
    scaled = at * (len(anchors) - 1)
    low = int(scaled)
    high = min(len(anchors) - 1, low + 1)
    return (1 - (scaled - low)) * anchors[low] + (scaled - low) * anchors[high]


NAMES = [
    "model.embed_tokens.weight",
    "model.layers.{}.self_attn.q_proj.weight",
    "model.layers.{}.mlp.down_proj.weight",
    "model.layers.{}.input_layernorm.weight",
    "lm_head.weight",
]
LAYERS = 6


def tensors() -> list[tuple[str, int | None]]:
    found: list[tuple[str, int | None]] = []
    for name in NAMES:
        if "{}" in name:
            found += [(name.format(i), i) for i in range(LAYERS)]
        else:
            found.append((name, None))
    return found


@pytest.mark.parametrize(
    ("own", "shared"),
    [
        ([{"filter": "self_attn", "value": [0.2, 0.9]}], 0.5),
        ([{"filter": "mlp", "value": 2}], [1, 0, 3]),
        ([], [{"filter": "q_proj", "value": 0.1}, {"value": [1, 2]}]),
        ([0.25, 0.5, 1.0], 7),
        ({"filter": "norm", "value": "1e-1"}, [{"filter": "*", "value": 4}]),
    ],
    ids=["filters-then-scalar", "filters-then-gradient", "shared-filters", "gradient", "one-cond"],
)
def test_a_models_weight_resolves_as_mergekit_resolves_it(own: Any, shared: Any) -> None:
    config = {
        "merge_method": "linear",
        "models": models(("./a", {"weight": own} if own != [] else {}), ("./b", {"weight": 1})),
        "parameters": {"weight": shared},
    }
    parsed = translate(config, is_local=local).recipe
    setting = parsed.params.weights[0]  # type: ignore[union-attr]
    expected_own = own if own != [] else None
    for name, layer in tensors():
        at = position(layer, LAYERS)
        expected = mergekit_value([expected_own, shared], name, at)
        assert resolve(setting, name=name, at=at) == pytest.approx(expected, abs=0), name


def test_slice_parameters_come_between_the_models_and_the_configs() -> None:
    config = {
        "merge_method": "slerp",
        "base_model": "./a",
        "slices": [{
            "sources": [{"model": "./a", "layer_range": [0, 6]},
                        {"model": "./b", "layer_range": [0, 6]}],
            "parameters": {"t": [{"filter": "mlp", "value": [0, 1]}]},
        }],
        "parameters": {"t": 0.3},
    }  # fmt: skip
    t = recipe(config)["params"]["t"]
    assert t == [{"filter": "mlp", "value": [0.0, 1.0]}, {"filter": None, "value": 0.3}]


def test_a_default_closes_filters_that_may_miss() -> None:
    config = {
        "merge_method": "linear",
        "models": models(("./a", {"weight": 1}), ("./b", {"weight": 1})),
        "parameters": {"normalize": [{"filter": "mlp", "value": True}]},  # default: true
    }
    assert recipe(config)["params"]["normalize"] is True
    config["parameters"] = {"normalize": [{"filter": "mlp", "value": False}]}
    refused(config, "parameters.normalize.0", "varies by layer or tensor")


# -- linear ----------------------------------------------------------------------------------
def test_linear() -> None:
    config = {
        "merge_method": "linear",
        "models": models(("org/a", {"weight": 0.3}), ("./b", {"weight": [1, 0, 2]})),
        "parameters": {"normalize": False},
    }
    assert recipe(config) | {"output": None} == {
        "method": "linear", "base": None, "models": ["hf://org/a", "./b"],
        "params": {"weights": [0.3, [1.0, 0.0, 2.0]], "normalize": False},
        "output": None, "credential": None, "tokenizer_source": None, "arithmetic": "source",
    }  # fmt: skip


def test_linear_merges_a_base_given_beside_its_models_last() -> None:
    config = {
        "merge_method": "linear",
        "base_model": "./base",
        "models": models(("./a", {"weight": 2})),
        "parameters": {"weight": 0.5},
    }
    made = recipe(config)
    assert made["models"] == ["./a", "./base"]
    assert made["params"]["weights"] == [2.0, 0.5]


def test_linear_refusals() -> None:
    refused({"merge_method": "linear", "models": models(("./a", {"weight": 1}))}, "models")
    refused(
        {"merge_method": "linear", "models": models(("./a", {"weight": 1}), ("./b", None))},
        "models.1.parameters.weight",
        "required",
    )


# -- slerp -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("listed", "base", "expected"),
    [(["./a", "./b"], "./a", ["./a", "./b"]), (["./a", "./b"], "./b", ["./b", "./a"]),
     (["./b"], "./a", ["./a", "./b"])],
    ids=["base-first", "base-second", "base-beside"],
)  # fmt: skip
def test_slerp_puts_its_base_first(listed: list[str], base: str, expected: list[str]) -> None:
    config = {
        "merge_method": "slerp",
        "base_model": base,
        "models": [{"model": m} for m in listed],
        "parameters": {"t": [0, 0.5, 1]},
    }
    assert recipe(config)["models"] == expected
    assert recipe(config)["params"]["t"] == [0.0, 0.5, 1.0]


def test_slerp_over_one_slice_takes_its_layers() -> None:
    """One slice of every layer merges whole models; one of fewer makes a shallower model:
    either way the recipe takes the slice, checked against the checkpoints' layers."""
    config = {
        "merge_method": "slerp",
        "base_model": "./a",
        "slices": [{"sources": [{"model": "./a", "layer_range": [0, 32]},
                                {"model": "./b", "layer_range": [0, 32]}]}],
        "parameters": {"t": 0.5},
    }  # fmt: skip
    translated = translate(config, is_local=local)
    written = recipe_to_dict(translated.recipe)
    assert written["models"] == ["./a", "./b"]
    assert written["slices"] == config["slices"]
    fields = translated.origin.source_fields
    assert fields["models.0"] == "slices.0.sources.0.model"
    assert fields["models.1"] == "slices.0.sources.1.model"
    assert fields["slices.0.sources.1.layer_range"] == "slices.0.sources.1.layer_range"


def test_slerp_refusals() -> None:
    two = [{"model": "./a"}, {"model": "./b"}]
    refused({"merge_method": "slerp", "models": two, "parameters": {"t": 0.5}}, "base_model")
    refused({"merge_method": "slerp", "models": two, "base_model": "./a"}, "parameters.t")
    three = {"merge_method": "slerp", "models": [*two, {"model": "./c"}], "base_model": "./a",
             "parameters": {"t": 0.5}}  # fmt: skip
    refused(three, "models", "one other model")


def test_slerp_per_model_t_is_ignored_as_mergekit_ignores_it() -> None:
    config = {
        "merge_method": "slerp",
        "base_model": "./a",
        "models": models(("./a", None), ("./b", {"t": 0.9})),
        "parameters": {"t": 0.2},
    }
    assert recipe(config)["params"]["t"] == 0.2
    assert warnings(config) == (
        "models.1.parameters.t: slerp takes one t for all the models, not one per model; "
        "ignored, as mergekit does",
    )


# -- slices of other layers, several slices ---------------------------------------------------
def sliced(*ranges: list[list[int]]) -> dict[str, Any]:
    return {
        "merge_method": "slerp",
        "base_model": "./a",
        "slices": [{"sources": [{"model": "./a", "layer_range": a},
                                {"model": "./b", "layer_range": b}]} for a, b in ranges],
        "parameters": {"t": 0.5},
    }  # fmt: skip


def test_slices_of_other_layers_become_the_recipes_slices() -> None:
    config = sliced([[0, 3], [3, 6]], [[5, 6], [0, 1]])
    translated = translate(config, is_local=local)
    written = recipe_to_dict(translated.recipe)
    assert (written["models"], written["params"]) == (["./a", "./b"], {"t": 0.5})
    assert written["slices"] == [
        {"sources": [{"model": "./a", "layer_range": [0, 3]},
                     {"model": "./b", "layer_range": [3, 6]}]},
        {"sources": [{"model": "./a", "layer_range": [5, 6]},
                     {"model": "./b", "layer_range": [0, 1]}]},
    ]  # fmt: skip
    fields = translated.origin.source_fields
    assert fields["slices.1.sources.1.layer_range"] == "slices.1.sources.1.layer_range"
    assert recipe(sliced([[0, 6], [0, 6]]))["slices"][0]["sources"][1]["layer_range"] == [0, 6]
    assert recipe(sliced([[2, 6], [2, 6]]))["slices"][0]["sources"][0]["layer_range"] == [2, 6]


def test_a_slice_with_its_own_parameters_gets_its_own_params() -> None:
    config = sliced([[0, 3], [3, 6]], [[3, 6], [0, 3]], [[1, 2], [2, 3]])
    config["slices"][1]["parameters"] = {"t": [0, 1]}
    config["slices"][2]["sources"][0]["parameters"] = {"t": 0.9}  # no slerp parameter per model
    config["slices"][2]["parameters"] = {"t": [{"filter": "mlp", "value": 0.2}]}
    translated = translate(config, is_local=local)
    written = recipe_to_dict(translated.recipe)
    assert written["params"] == {"t": 0.5}
    assert [piece.get("params") for piece in written["slices"]] == [
        None,
        {"t": [0.0, 1.0]},
        {"t": [{"filter": "mlp", "value": 0.2}, {"value": 0.5}]},
    ]
    assert translated.origin.warnings == (
        "slices.2.sources.0.parameters.t: slerp takes one t for all the models, not one per "
        "model; ignored, as mergekit does",
    )
    bad = sliced([[0, 3], [3, 6]], [[3, 6], [0, 3]])
    bad["slices"][1]["parameters"] = {"t": "half"}
    refused(bad, "slices.1.parameters.t", "not a number")


def test_slices_over_other_models_get_the_models_of_all_and_their_own() -> None:
    config = sliced([[0, 3], [3, 6]], [[3, 6], [0, 3]])
    config |= {"merge_method": "linear", "base_model": None, "parameters": {"weight": 1.0}}
    config["slices"][1]["sources"][0]["model"] = "./c"  # then ./b: another order too
    written = recipe_to_dict(translate(config, is_local=local).recipe)
    assert (written["models"], written["params"]["weights"]) == (["./a", "./b", "./c"], [1.0] * 3)
    assert [[s["model"] for s in piece["sources"]] for piece in written["slices"]] == [
        ["./a", "./b"],
        ["./c", "./b"],
    ]
    assert [piece["params"]["weights"] for piece in written["slices"]] == [[1.0, 1.0]] * 2


def test_slices_pairing_the_base_with_other_models_each_interpolate_their_own_pair() -> None:
    config = sliced([[0, 3], [3, 6]], [[3, 6], [0, 3]])
    config["slices"][1]["sources"] = config["slices"][1]["sources"][::-1]  # the base second
    config["slices"][1]["sources"][0]["model"] = "./c"
    written = recipe_to_dict(translate(config, is_local=local).recipe)
    assert written["models"] == ["./a", "./b", "./c"]
    assert [[s["model"] for s in piece["sources"]] for piece in written["slices"]] == [
        ["./a", "./b"], ["./c", "./a"]
    ]  # fmt: skip
    assert "params" in written["slices"][1]  # its own pair: its own recipe
    first, own = slice_recipes(parse_recipe(written))
    assert [first.models, own.models] == [["./a", "./b"], ["./a", "./c"]]  # t = 0: the base


def test_slices_layerswap_cannot_merge_as_mergekit_does_are_refused() -> None:
    refused(sliced([[0, 6], [0, 5]]), "slices.0.sources.1.layer_range", "as many layers")
    three = sliced([[0, 3], [3, 6]], [[3, 6], [0, 3]])
    three["slices"][1]["sources"].append({"model": "./c", "layer_range": [0, 3]})
    refused(three, "slices.1.sources", "names 3 models besides any base: slerp merges 2")
    based = sliced([[0, 3], [3, 6]], [[3, 6], [0, 3]])
    based["slices"][1]["base_model"] = "./b"
    refused(based, "slices.1.base_model", "differs from slices.0.base_model")


# -- task arithmetic -------------------------------------------------------------------------
def test_task_arithmetic() -> None:
    config = {
        "merge_method": "task_arithmetic",
        "base_model": "org/base@v1",
        "models": models(
            ("org/base@v1", None), ("./a", {"weight": 0.7}), ("./b", {"weight": -0.2})
        ),
        "parameters": {"lambda": "0.9", "normalize": True, "density": 0.5},
    }
    made = recipe(config)
    assert (made["base"], made["models"]) == ("hf://org/base@v1", ["./a", "./b"])
    assert made["params"] == {"weights": [0.7, -0.2], "lambda": 0.9, "normalize": True}
    assert warnings(config) == (
        "parameters.density: mergekit's task_arithmetic does not sparsify, so ignores it; ignored",
    )


def test_task_arithmetic_weights_vary_by_layer_and_tensor() -> None:
    config = {
        "merge_method": "task_arithmetic",
        "base_model": "./base",
        "models": models(("./a", {"weight": [0.5, 1]}),
                         ("./b", {"weight": [{"filter": "mlp", "value": -0.5}, {"value": 1}]})),
    }  # fmt: skip
    assert recipe(config)["params"]["weights"] == [
        [0.5, 1.0],
        [{"filter": "mlp", "value": -0.5}, {"filter": None, "value": 1.0}],
    ]


def test_task_arithmetic_refusals() -> None:
    config = {
        "merge_method": "task_arithmetic",
        "base_model": "./base",
        "models": models(("./a", {"weight": 0.5})),
    }
    refused({**config, "base_model": None}, "base_model", "required")
    refused({**config, "models": models(("./base", None))}, "models", "besides the base")


# -- TIES ------------------------------------------------------------------------------------
def ties_config(**parameters: Any) -> dict[str, Any]:
    return {
        "merge_method": "ties",
        "base_model": "./base",
        "models": models(("./base", None), ("./a", {"weight": 0.7, "density": 0.5}),
                         ("./b", {"weight": 0.3, "density": 0.5})),
        "parameters": parameters,
    }  # fmt: skip


def test_ties() -> None:
    made = recipe(ties_config(normalize=False, **{"lambda": 1.2}))
    assert (made["base"], made["models"]) == ("./base", ["./a", "./b"])
    assert made["params"] == {"weights": [0.7, 0.3], "density": 0.5, "lambda": 1.2,
                              "normalize": False}  # fmt: skip
    assert not any("density·n" in w for w in warnings(ties_config()))  # mergekit's ⌊density·n⌋


def test_ties_density_defaults_to_mergekits_one_and_is_capped_there() -> None:
    config = ties_config()
    for entry in config["models"][1:]:
        del entry["parameters"]["density"]
    assert recipe(config)["params"]["density"] == 1.0
    assert recipe({**config, "parameters": {"density": 1.5}})["params"]["density"] == 1.0
    assert not any("density" in w for w in warnings(config))


def test_ties_weights_and_densities_per_model_vary_by_layer_and_tensor() -> None:
    config = ties_config()
    config["models"][1]["parameters"] = {"weight": [0, 0.3, 1], "density": [1, 0.7, 0.1]}
    config["models"][2]["parameters"] = {
        "weight": [{"filter": "mlp", "value": -0.5}, {"value": 0}],
        "density": 0.33,
    }
    made = recipe(config)
    assert made["params"]["weights"] == [
        [0.0, 0.3, 1.0],
        [{"filter": "mlp", "value": -0.5}, {"filter": None, "value": 0.0}],
    ]
    assert made["params"]["density"] == [[1.0, 0.7, 0.1], 0.33]  # per model, as written
    config["models"][2]["parameters"]["density"] = 0.5
    config["models"][1]["parameters"]["density"] = 0.5
    assert recipe(config)["params"]["density"] == 0.5  # one for all where every model's agrees


def test_ties_refusals_and_what_mergekit_ignores() -> None:
    assert recipe(ties_config(rescale=True))["params"]["rescale"] is True  # taken, not refused
    assert "rescale" not in recipe(ties_config(rescale=False))["params"]  # the default
    zero = ties_config()
    zero["models"][1]["parameters"]["density"] = 0
    refused(zero, "models.1.parameters.density", "above 0")
    ignored = ties_config(int8_mask=True)
    ignored["models"][0]["parameters"] = {"weight": 1.0}  # the base's
    found = warnings(ignored)
    assert "models.0.parameters.weight: ties takes no weight for its base; ignored, as " \
        "mergekit does" in found  # fmt: skip
    assert any(w.startswith("parameters.int8_mask: it changes only") for w in found)


# -- passthrough -----------------------------------------------------------------------------
def frankenmerge(**slice_parameters: Any) -> dict[str, Any]:
    return {
        "merge_method": "passthrough",
        "slices": [
            {"sources": [{"model": "./a", "layer_range": [0, 4], **slice_parameters}]},
            {"sources": [{"model": "org/b", "layer_range": [2, 6]}]},
            {"sources": [{"model": "./a", "layer_range": [4, 6]}]},
        ],
    }


def test_nuslerp() -> None:
    config = {
        "merge_method": "nuslerp",
        "base_model": "./base",
        "models": models(("./base", {"weight": 9.0}), ("./a", {"weight": [0.2, 1.0]}),
                         ("./b", None)),
        "parameters": {"weight": 0.5, "nuslerp_flatten": [{"filter": "mlp", "value": False}],
                       "nuslerp_row_wise": [True, False]},
    }  # fmt: skip
    made = recipe(config)
    assert (made["method"], made["base"], made["models"]) == ("nuslerp", "./base", ["./a", "./b"])
    assert made["params"] == {
        "weights": [[0.2, 1.0], 0.5],  # the base's own weight: not mergekit's (PerNonBase)
        "nuslerp_flatten": [{"filter": "mlp", "value": False}, {"filter": None, "value": True}],
        "nuslerp_row_wise": [True, False],
    }
    assert any("./base" in w or "models.0" in w for w in warnings(config))
    plain = recipe({"merge_method": "nuslerp",
                    "models": models(("./a", {"weight": 1}), ("./b", {"weight": 3}))})  # fmt: skip
    assert plain["base"] is None
    assert plain["params"] == {"weights": [1.0, 3.0], "nuslerp_flatten": True,
                               "nuslerp_row_wise": False}  # fmt: skip


def test_nuslerp_refusals() -> None:
    three = models(("./a", {"weight": 1}), ("./b", {"weight": 1}), ("./c", {"weight": 1}))
    refused({"merge_method": "nuslerp", "models": three}, "models", "two models")
    unweighted = {"merge_method": "nuslerp", "models": models(("./a", {"weight": 1}), ("./b", {}))}
    refused(unweighted, "models.1.parameters.weight", "required")
    switch = {"merge_method": "nuslerp", "models": three[:2],
              "parameters": {"nuslerp_flatten": "sometimes"}}  # fmt: skip
    refused(switch, "parameters.nuslerp_flatten", "not true or false")
    outside = {"merge_method": "nuslerp", "base_model": "./c",  # mergekit: not among the inputs
               "slices": [{"sources": [{"model": m, "layer_range": [0, 6], "parameters":
                                        {"weight": 1}} for m in ("./a", "./b")]}]}  # fmt: skip
    refused(outside, "base_model", "not one of the slice's sources")


def test_model_stock() -> None:
    config = {
        "merge_method": "model_stock",
        "base_model": "./base",
        "models": models(("./base", None), ("./a", None), ("./b", None), ("./c", None)),
        "parameters": {"filter_wise": [{"filter": "self_attn", "value": True}]},
    }
    made = recipe(config)
    assert (made["base"], made["models"]) == ("./base", ["./a", "./b", "./c"])
    assert made["params"] == {
        "filter_wise": [{"filter": "self_attn", "value": True}, {"filter": None, "value": False}]
    }
    assert recipe({**config, "parameters": None})["params"] == {"filter_wise": False}


def test_model_stock_refusals() -> None:
    config = {"merge_method": "model_stock", "models": models(("./a", None), ("./b", None))}
    refused(config, "base_model", "required")
    one = {**config, "base_model": "./base", "models": models(("./a", None))}
    refused(one, "models", "at least two models")


def test_passthrough() -> None:
    made = recipe(frankenmerge())
    assert made["models"] == ["./a", "hf://org/b"]
    assert made["params"]["slices"] == [
        {"sources": [{"model": "./a", "layer_range": [0, 4]}]},
        {"sources": [{"model": "hf://org/b", "layer_range": [2, 6]}]},
        {"sources": [{"model": "./a", "layer_range": [4, 6]}]},
    ]
    assert recipe(frankenmerge(parameters={"scale": 1}))["method"] == "passthrough"


def test_passthrough_scale_is_chained_onto_each_source() -> None:
    """The source's scale, then its slice's, then the config's; 1 (none) leaves it out."""
    zeroed = [{"filter": "o_proj", "value": 0}, {"value": 1}]
    config = frankenmerge(parameters={"scale": zeroed})
    config["slices"][1]["parameters"] = {"scale": [0.5, 1]}
    config["parameters"] = {"scale": [{"filter": "mlp", "value": 0.3}]}
    sources = [s["sources"][0] for s in recipe(config)["params"]["slices"]]
    assert sources[0]["scale"] == [
        {"filter": "o_proj", "value": 0.0},
        {"filter": None, "value": 1.0},
    ]
    assert sources[1]["scale"] == [0.5, 1.0]
    assert sources[2]["scale"] == [{"filter": "mlp", "value": 0.3}]
    unscaled = recipe(frankenmerge(parameters={"scale": 1}))["params"]["slices"][0]["sources"][0]
    assert "scale" not in unscaled


def test_passthrough_over_models() -> None:
    one = {
        "merge_method": "passthrough",
        "models": [{"model": "./a", "parameters": {"scale": 0.5}}],
    }
    assert recipe(one)["models"] == ["./a"] and recipe(one)["params"] == {"scale": 0.5}


def test_passthrough_refusals() -> None:
    two = frankenmerge()
    two["slices"][1]["sources"].append({"model": "./c", "layer_range": [2, 6]})
    refused(two, "slices.1.sources", "one source per slice")
    models_two = {"merge_method": "passthrough", "models": [{"model": "./a"}, {"model": "./b"}]}
    refused(models_two, "models", "exactly one")
    other_base = {"merge_method": "passthrough", "models": [{"model": "./a"}], "base_model": "./b"}
    refused(other_base, "base_model", "second input")


# -- the sparsifying methods -----------------------------------------------------------------
def sparse_config(method: str, **parameters: Any) -> dict[str, Any]:
    return {
        "merge_method": method,
        "base_model": "./base",
        "models": models(("./a", {"weight": [0.2, 1.0], "density": 0.3}),
                         ("./b", {"weight": 0.5})),
        "parameters": parameters,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("method", "switches", "amounts"),
    [
        ("dare_ties", {"normalize": False, "rescale": True}, {}),
        ("dare_linear", {"normalize": False, "rescale": True}, {}),
        ("breadcrumbs", {"normalize": False, "rescale": False}, {"gamma": [0.01, 0.01]}),
        ("breadcrumbs_ties", {"normalize": False, "rescale": False}, {"gamma": [0.01, 0.01]}),
        ("della", {"normalize": True, "rescale": True}, {"epsilon": [0.15, 0.15]}),
        ("della_linear", {"normalize": False, "rescale": True}, {"epsilon": [0.15, 0.15]}),
    ],
)
def test_sparsifying_methods_take_mergekits_defaults(
    method: str, switches: dict[str, bool], amounts: dict[str, list[float]]
) -> None:
    """Per-model weights and amounts as written (a gradient stays one), mergekit's density of
    1.0 where a model has none, and the method's own normalize and rescale."""
    made = recipe(sparse_config(method))
    assert (made["method"], made["base"], made["models"]) == (method, "./base", ["./a", "./b"])
    params = made["params"]
    assert params["weights"] == [[0.2, 1.0], 0.5]
    assert params["density"] == [0.3, 1.0]
    assert params["lambda"] == 1.0 and params["int8_mask"] is False
    assert {k: params[k] for k in switches} == switches
    assert {k: params[k] for k in amounts} == amounts
    random = not method.startswith("breadcrumbs")
    assert any("drops are random" in w for w in warnings(sparse_config(method))) == random


def test_sparsifying_parameters_from_every_place() -> None:
    config = sparse_config("della", normalize=False, rescale=False, epsilon=0.1,
                           **{"lambda": [1.0, 2.0], "density": 0.6})  # fmt: skip
    config["models"][1]["parameters"]["epsilon"] = [{"filter": "mlp", "value": 0.2}]
    params = recipe(config)["params"]
    assert params["density"] == [0.3, 0.6]  # the model's own, else the config's
    assert params["epsilon"] == [
        0.1,
        [{"filter": "mlp", "value": 0.2}, {"filter": None, "value": 0.1}],
    ]
    assert params["lambda"] == [1.0, 2.0]
    assert (params["normalize"], params["rescale"]) == (False, False)


def test_sparsifying_refusals() -> None:
    zero = sparse_config("dare_ties")
    zero["models"][1]["parameters"]["density"] = 0
    refused(zero, "models.1.parameters.density", "above 0")
    big = sparse_config("breadcrumbs")
    big["models"][1]["parameters"]["density"] = 3
    assert recipe(big)["params"]["density"] == [0.3, 1.0]  # mergekit keeps every entry
    unweighted = sparse_config("della_linear")
    del unweighted["models"][1]["parameters"]["weight"]
    refused(unweighted, "models.1.parameters.weight", "required")
    refused({**sparse_config("dare_linear"), "base_model": None}, "base_model", "required")
    spread = sparse_config("della", epsilon=0.4)
    refused(spread, "parameters.epsilon", "density ± epsilon")  # 0.3 ± 0.4 leaves (0, 1)


# -- methods ---------------------------------------------------------------------------------
def test_methods_mergekit_lacks_are_refused_by_name() -> None:
    config = {"merge_method": "magic", "models": [{"model": "./a"}]}
    refused(config, "merge_method", "not a mergekit 0.1.5 method")
    refused({"models": [{"model": "./a"}]}, "merge_method", "required")


# -- model references ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("written", "source"),
    [("org/name", "hf://org/name"), ("org/name@v1.0", "hf://org/name@v1.0"),
     ("./local/dir", "./local/dir"), ("/abs/dir", "/abs/dir"),
     ({"model": {"path": "org/name", "revision": "main"}}, "hf://org/name@main"),
     ({"model": "org/name"}, "hf://org/name"), ("hf://org/name@abc", "hf://org/name@abc"),
     ("org/name+org/lora@v2", "hf://org/name+hf://org/lora@v2"), ("./dir+./lora", "./dir+./lora"),
     ({"model": "org/name", "lora": {"path": "org/lora", "revision": "r1"}},
      "hf://org/name+hf://org/lora@r1")],
)  # fmt: skip
def test_model_references(written: Any, source: str) -> None:
    config = {"merge_method": "linear", "models": models((written, {"weight": 1}),
                                                         ("./b", {"weight": 1}))}  # fmt: skip
    assert recipe(config)["models"][0] == source


@pytest.mark.parametrize(
    ("written", "field", "words"),
    [("org/a+org/b+org/c", "models.0.model", "a LoRA reference is model+adapter"),
     ({"model": "org/name", "lora": "org/a+org/b"}, "models.0.model.lora", "names one model"),
     ({"model": "org/name", "override_architecture": "X"}, "models.0.model.override_architecture",
      "not supported"),
     ("not a repo", "models.0.model", "neither a local directory nor a Hub repository"),
     ("org/name@a@b", "models.0.model", "more than one @"),
     ("./dir@v1", "models.0.model", "has no @revision"), (None, "models.0.model", "name a model")],
)  # fmt: skip
def test_model_reference_refusals(written: Any, field: str, words: str) -> None:
    config = {"merge_method": "linear", "models": models((written, {"weight": 1}),
                                                         ("./b", {"weight": 1}))}  # fmt: skip
    refused(config, field, words)


def test_a_model_listed_twice_is_refused() -> None:
    config = {"merge_method": "linear",
              "models": models(("org/a", {"weight": 1}), ("org/a", {"weight": 2}))}  # fmt: skip
    refused(config, "models.1.model", "listed twice")


# -- the other fields ------------------------------------------------------------------------
def linear_config(**fields: Any) -> dict[str, Any]:
    return {"merge_method": "linear",
            "models": models(("./a", {"weight": 1}), ("./b", {"weight": 1})), **fields}  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "dtype"),
    [({}, "source"), ({"dtype": "float32"}, "float32"), ({"dtype": "bfloat16"}, "bfloat16"),
     ({"dtype": "float32", "out_dtype": "bfloat16"}, "bfloat16"),
     ({"out_dtype": "torch.float16"}, "float16")],
)  # fmt: skip
def test_the_output_dtype_is_out_dtype_else_dtype(fields: dict[str, str], dtype: str) -> None:
    assert recipe(linear_config(**fields))["output"]["dtype"] == dtype


@pytest.mark.parametrize(
    ("fields", "arithmetic"),
    [({}, "source"), ({"dtype": "bfloat16", "out_dtype": "float32"}, "bfloat16"),
     ({"dtype": "torch.float16"}, "float16"), ({"dtype": "float64"}, "float64")],
)  # fmt: skip
def test_the_arithmetic_is_mergekits_dtype(fields: dict[str, str], arithmetic: str) -> None:
    """mergekit computes in its `dtype`, without one in the checkpoints' own: so does the
    translated recipe, and says nothing of it."""
    assert recipe(linear_config(**fields))["arithmetic"] == arithmetic
    assert warnings(linear_config(**fields)) == ()


def test_another_arithmetic_asked_for_is_said() -> None:
    config = linear_config(dtype="bfloat16")
    made = translate(config, is_local=local, arithmetic="float32")
    assert made.recipe.arithmetic == "float32"
    assert made.origin.warnings == (
        "arithmetic float32: mergekit computes in bfloat16; the output is computed in float32 "
        "as asked, so it is not mergekit's bit for bit",
    )
    same = translate(config, is_local=local, arithmetic="bfloat16")
    assert (same.recipe.arithmetic, same.origin.warnings) == ("bfloat16", ())
    (said,) = translate(linear_config(), is_local=local, arithmetic="float32").origin.warnings
    assert "mergekit computes in the checkpoints' own dtype" in said


@pytest.mark.parametrize(
    "template",
    ["auto", "chatml", "llama3", "alpaca", "mistral", "exaone", "{{ messages }} as text"],
)
def test_a_chat_template_is_taken_as_mergekit_takes_it(template: str) -> None:
    """auto, a template mergekit ships by name, or Jinja text: kept with the config, written by
    the merge (tests/engine/test_mergekit_outputs.py); the donor of the side files is the
    config's base_model."""
    made = translate(linear_config(chat_template=template, base_model="./b"), is_local=local)
    assert made.origin.config["chat_template"] == template
    assert made.origin.donor == "./b"
    assert translate(linear_config(), is_local=local).origin.donor is None


def test_field_refusals() -> None:
    refused(linear_config(dtype="int64"), "dtype", "computes in and writes bfloat16, float16")
    refused(linear_config(out_dtype="int8"), "out_dtype")
    refused(linear_config(chat_template="zephyr"), "chat_template", "neither auto")
    refused(linear_config(chat_template="{{ too short }}"), "chat_template", "neither auto")
    refused(linear_config(modules={"text": {}}), "modules")
    refused(linear_config(name="has space"), "name")
    refused({"merge_method": "linear"}, "models", "exactly one of models and slices")
    refused(linear_config(parameters=[1]), "parameters", "mapping")


# -- tokenizer_source ------------------------------------------------------------------------
def vocabulary_of(config: dict[str, Any]) -> tuple[str | None, str | None, list[str]]:
    """The translated recipe's tokenizer_source, base and models."""
    made = recipe(config)
    return made["tokenizer_source"], made["base"], made["models"]


@pytest.mark.parametrize("source", ["base", "union"])
def test_base_and_union_are_built_on_mergekits_base_model(source: str) -> None:
    # linear: mergekit merges its base_model as one of the models and fills rows from it
    beside = linear_config(base_model="./base", parameters={"weight": 1}, tokenizer_source=source)
    assert vocabulary_of(beside) == (source, "./base", ["./a", "./b", "./base"])
    listed = linear_config(base_model="./b", tokenizer_source=source)
    assert vocabulary_of(listed) == (source, "./b", ["./a", "./b"])
    assert vocabulary_of({**ties_config(), "tokenizer_source": source}) == (
        source, "./base", ["./a", "./b"],
    )  # fmt: skip
    slerp = {"merge_method": "slerp", "base_model": "./b", "models": models(("./a", None),
             ("./b", None)), "parameters": {"t": 0.5}, "tokenizer_source": source}  # fmt: skip
    assert vocabulary_of(slerp) == (source, None, ["./b", "./a"])  # slerp's base: models.0
    stacked = {**frankenmerge(), "base_model": "org/b", "tokenizer_source": source}
    assert vocabulary_of(stacked) == (source, None, ["hf://org/b", "./a"])  # passthrough: first
    assert recipe(stacked)["params"]["slices"][0]["sources"][0]["model"] == "./a"


def test_a_model_as_tokenizer_source_names_the_input() -> None:
    for written in ("./b", "model:./b", {"model": "./b"}):
        assert vocabulary_of(linear_config(tokenizer_source=written))[0] == "model:./b"
    hub = {"merge_method": "linear", "models": models(("org/a@v1", {"weight": 1}),
           ("./b", {"weight": 1})), "tokenizer": {"source": "org/a@v1"}}  # fmt: skip
    assert vocabulary_of(hub) == ("model:hf://org/a@v1", None, ["hf://org/a@v1", "./b"])
    linear = linear_config(base_model="./b", tokenizer_source="./a")  # fills from the base
    assert vocabulary_of(linear) == ("model:./a", "./b", ["./a", "./b"])
    assert vocabulary_of(linear_config()) == (None, None, ["./a", "./b"])
    assert vocabulary_of(linear_config(base_model="./b"))[1] is None  # unused without one


def test_tokenizer_block_defaults_to_union_as_mergekits() -> None:
    assert vocabulary_of(ties_config() | {"tokenizer": {}})[0] == "union"
    empty: dict[str, Any] = {
        "source": "base",
        "tokens": {},
        "pad_to_multiple_of": None,
    }  # none, to mergekit
    assert vocabulary_of(ties_config() | {"tokenizer": empty})[0] == "base"


def test_base_or_union_without_a_base_model_is_said() -> None:
    (said,) = warnings(linear_config(tokenizer_source="union"))
    assert said.startswith("tokenizer_source union without base_model: mergekit builds the ")
    assert said.endswith("Layerswap on ./a")
    assert vocabulary_of(linear_config(tokenizer_source="base")) == ("base", None, ["./a", "./b"])


def test_passthrough_rows_differ_from_mergekits_for_tokens_a_model_lacks() -> None:
    found = warnings({**frankenmerge(), "tokenizer": {"source": "./a"}})
    assert found == (
        "tokenizer.source: for a token the model a tensor is copied from lacks, mergekit's "
        "passthrough writes a zero row; Layerswap writes the row another input has (or their "
        "mean)",
    )


def test_tokenizer_refusals() -> None:
    refused(
        linear_config(tokenizer={"source": "./a", "tokens": {"<x>": {}}}),
        "tokenizer.tokens.<x>.source", "required",
    )  # fmt: skip
    refused(linear_config(tokenizer={"pad_to_multiple_of": -64}), "tokenizer.pad_to_multiple_of")
    refused(linear_config(tokenizer={"source": "./a", "extra": 1}), "tokenizer.extra", "unknown")
    refused(linear_config(tokenizer="./a"), "tokenizer", "mapping")
    refused(linear_config(tokenizer_source="./a", tokenizer={}), "tokenizer", "not both")
    refused(linear_config(tokenizer_source="./c"), "tokenizer_source", "not one of the merged")
    refused(linear_config(tokenizer_source="a b"), "tokenizer_source", "neither a local")
    refused(linear_config(chat_template=["chatml"]), "chat_template", "must be text")
    stacked = {**frankenmerge(), "base_model": "./c", "tokenizer_source": "base"}
    refused(stacked, "tokenizer_source", "base_model ./c, which Layerswap's passthrough does not")
    sliced = {
        "merge_method": "slerp", "base_model": "./a", "parameters": {"t": 0.5},
        "slices": [{"base_model": "./b", "sources": [{"model": "./a", "layer_range": [0, 6]},
                                                     {"model": "./b", "layer_range": [0, 6]}]}],
    }  # fmt: skip
    assert vocabulary_of({**sliced, "tokenizer_source": "./a"})[0] == "model:./a"
    refused({**sliced, "tokenizer_source": "union"}, "tokenizer_source", "one base for both")


def test_a_tokenizer_source_error_from_the_engine_names_the_mergekit_field() -> None:
    translated = translate(ties_config() | {"tokenizer": {"source": "./a"}}, is_local=local)
    error = RecipeError.for_field("tokenizer_source", "./a has no tokenizer.json")
    assert translated.origin.renamed(error, prefix="mergekit.").message == (
        "mergekit.tokenizer.source: ./a has no tokenizer.json"
    )


def test_name_and_unknown_fields() -> None:
    assert recipe(linear_config(name="my-merge"))["output"]["name"] == "my-merge"
    assert warnings(linear_config(merge_notes="x")) == (
        "merge_notes: not a field of mergekit's config; ignored, as mergekit does",
    )


def test_options_the_config_has_no_word_for() -> None:
    output = {"hub": {"repo": "org/merged"}, "shard_size": "1GB"}
    made = recipe(linear_config(out_dtype="bfloat16"), output=output, credential="team")
    assert made["output"]["hub"]["repo"] == "org/merged"
    assert (made["output"]["dtype"], made["credential"]) == ("bfloat16", "team")
    refused(linear_config(), "output.dtype", "out_dtype", output={"dtype": "float16"})
    refused(linear_config(name="x"), "output.name", output={"name": "y"})
    refused(linear_config(), "output.shard_size", output={"shard_size": "1B"})


def test_is_mergekit_config() -> None:
    assert is_mergekit_config(linear_config())
    assert not is_mergekit_config({"method": "linear"})
    assert not is_mergekit_config(["merge_method"])


# -- what travels beside the recipe ----------------------------------------------------------
# The one input the fake plans read, named as the configs name their base; a directory that
# does not exist has no files for the side files' rules (engine/mergekit/side_files.py).
INPUTS = (InputRef("base", "base", "./base", "/nonexistent/base"),)


def plan(num_layers: int | None) -> Any:
    return SimpleNamespace(num_layers=num_layers, warnings=["a plan's own"], vocabulary=None,
                           inputs=INPUTS, config_input=0, tokenizer_input=0)  # fmt: skip


def test_the_origin_adds_its_warnings_before_the_plans() -> None:
    origin = MergekitOrigin({}, ("said",))
    fits = plan(6)
    origin.apply(fits)
    assert fits.warnings == ["said", "a plan's own"]


def test_the_origin_survives_a_job_record_and_names_sources_mergekits_way() -> None:
    translated = translate({**ties_config(), "tokenizer_source": "base"}, is_local=local)
    origin = MergekitOrigin.from_record(translated.origin.record())
    assert origin == translated.origin
    error = RecipeError.for_field("base", "not found")
    renamed = origin.renamed(error, prefix="mergekit.")
    assert (renamed.message, renamed.details["field"]) == (
        "mergekit.base_model: not found",
        "mergekit.base_model",
    )
    other = RecipeError.for_field("params.density", "bad")
    assert origin.renamed(other).message == "params.density: bad"


def vocabulary_plan(fill: list[int], dtype: str) -> Any:
    """The parts of a plan with aligned vocabularies that the origin reads."""
    head = SimpleNamespace(dtype=dtype)
    return SimpleNamespace(
        num_layers=6, warnings=[], vocabulary=SimpleNamespace(
            fill=array("q", fill), tensors=frozenset({"lm_head.weight"})),
        checkpoints=[SimpleNamespace(tensors={"lm_head.weight": head})],
        inputs=INPUTS, config_input=0, tokenizer_input=0,
    )  # fmt: skip


def test_rows_averaged_in_another_dtype_than_mergekits_are_said() -> None:
    config = {**ties_config(), "tokenizer": {"source": "union"}, "dtype": "float32"}
    origin = translate(config, is_local=local).origin
    averaged = vocabulary_plan([EVERY, MEAN, 0], "BF16")
    origin.apply(averaged)
    assert averaged.warnings[-1] == (
        "tokenizer.source: rows averaged for tokens the base lacks are computed in BF16, the "
        "checkpoints' dtype; mergekit computes them in float32, so they may differ from "
        "mergekit's in the last bit"
    )
    for plan in (vocabulary_plan([EVERY, 0], "BF16"), vocabulary_plan([MEAN], "F32")):
        origin.apply(plan)
        assert not any("averaged" in w for w in plan.warnings)


# -- modules, and keys mergekit ignores ------------------------------------------------------
def test_a_decoders_one_module_is_the_same_as_its_models_at_the_top() -> None:
    top = linear_config(parameters={"normalize": False})
    module = {"merge_method": "linear", "parameters": {"normalize": False},
              "modules": {"default": {"models": top["models"]}}}  # fmt: skip
    assert recipe(module) == recipe(top)
    # the module's parameters come between a model's (or slice's) and the config's
    layered = {**module, "modules": {"default": {"models": top["models"],
               "parameters": {"normalize": True}}}}  # fmt: skip
    assert recipe(layered)["params"]["normalize"] is True
    assert (
        recipe(linear_config(parameters={"normalize": True}))["params"]
        == (recipe(layered)["params"])
    )


def test_several_modules_are_refused_by_name() -> None:
    config = {"merge_method": "slerp", "base_model": "./a", "parameters": {"t": 0.5},
              "modules": {"text_decoder": {"models": models(("./a", None), ("./b", None))},
                          "vision_tower": {"models": models(("./a", None))}}}  # fmt: skip
    said = refused(config, "modules", "names text_decoder, vision_tower")
    assert "one stack of layers" in said
    refused({**config, "modules": {"default": {"models": [], "extra": 1}}}, "modules.default.extra")
    refused({**config, "modules": {"default": {"parameters": {}}}}, "modules.default.models")


def test_keys_mergekit_ignores_in_a_source_are_ignored_with_a_warning() -> None:
    """A `revision:` beside `model:` (a model card's habit) selects nothing in mergekit, which
    reads a revision only from `model: org/name@revision`: ignored, and said."""
    stacked = {"merge_method": "passthrough", "slices": [
        {"sources": [{"model": "./a", "revision": "dpo-v0", "layer_range": [0, 2]}]},
        {"sources": [{"model": "./a", "layer_range": [1, 3]}], "note": "x"}]}  # fmt: skip
    said = warnings(stacked)
    assert "slices.0.sources.0.revision: not a field of mergekit's config; ignored" in said[0]
    assert "slices.1.note: not a field" in said[1]
    assert recipe(stacked)["params"]["slices"][0]["sources"][0]["model"] == "./a"
