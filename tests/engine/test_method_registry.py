"""A merge method is one module: each registered method declares its summary, formula and
params (described per param), and a method registered from anywhere shows in everything derived
from the registry: the recipe schema, a merge, the API's request schema and GET /v1/methods,
the docs' table, sweep baselines and the mergekit front end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.methods import METHODS, mergekit_methods, register
from engine.methods.base import Method
from engine.schema.params import Range
from tests.docs.reference_hook import ROOT


def test_every_method_says_what_it_computes_and_describes_its_params() -> None:
    for name, method in METHODS.items():
        assert method.name == name
        assert method.summary.strip() and method.formula.strip(), name
        schema = method.params.model_json_schema(by_alias=True)["properties"]
        described = method.parameters()
        assert [p.name for p in described] == list(schema), name
        for param in described:
            assert param.type, (name, param.name)
            assert param.required or param.default == schema[param.name]["default"]


def test_params_metadata_comes_from_the_types() -> None:
    def param(method: str, name: str) -> Any:
        return next(p for p in METHODS[method].parameters() if p.name == name)

    weights = param("linear", "weights")
    assert (weights.per_model, weights.varies_by_layer, weights.default) == (True, True, "uniform")
    t = param("slerp", "t")
    assert (t.type, t.per_model, t.varies_by_layer) == ("setting", False, True)
    assert param("model_stock", "filter_wise").type == "switch"
    assert param("ties", "weights").per_model and param("ties", "weights").varies_by_layer
    assert param("ties", "density").per_model and param("ties", "lambda").varies_by_layer
    assert not param("ties", "lambda").per_model and not param("ties", "normalize").varies_by_layer
    assert param("ties", "density").bounds == Range(0, 1, low_open=True)
    assert str(param("dare_ties", "density").bounds) == "(0, 1]"
    assert str(param("della", "epsilon").bounds) == "[0, 0.5)"
    assert str(param("layer_swap", "bottom").bounds) == "≥ 0"
    assert param("passthrough", "slices").required is False  # absent: one model, whole
    assert not param("soup", "weights").varies_by_layer and param("soup", "weights").per_model


def test_each_mergekit_translation_sits_with_its_method() -> None:
    translated = mergekit_methods()
    assert set(translated) == {
        "linear", "slerp", "nuslerp", "model_stock", "passthrough", "task_arithmetic", "ties",
        "dare_ties", "dare_linear", "breadcrumbs", "breadcrumbs_ties", "della", "della_linear",
        "multislerp", "karcher", "nearswap", "sce", "arcee_fusion", "ram", "ramplus_tl",
    }  # fmt: skip
    for method in translated.values():
        assert method.mergekit is not None
        params = {p.name for p in method.parameters()}
        for parameter in method.mergekit.parameters:
            assert parameter.into is None or parameter.into in params, (method.name, parameter)
    sparsifying = {m: translated[m].mergekit for m in ("dare_ties", "breadcrumbs", "della")}
    assert [t.parameter("rescale").default for t in sparsifying.values() if t] == [
        True, False, True,
    ]  # fmt: skip


def test_a_name_is_registered_once() -> None:
    with pytest.raises(ValueError, match="registered already"):
        register(METHODS["soup"])
    clash: Method = METHODS["linear"]
    renamed = Method(**{**clash.__dict__, "name": "another_linear"})
    with pytest.raises(ValueError, match="mergekit's linear is translated by another method"):
        register(renamed)
    assert "another_linear" not in METHODS


def test_a_method_registered_from_anywhere_shows_everywhere(examples: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tests.engine.throwaway_method", str(examples), str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["parsed"]["method"] == "halfway"
    assert report["parsed"]["params"] == {"share": 0.25}
    assert report["parse_refused"] == "params.share"
    assert report["merged"]["tensors"] > 0 and report["merged"]["equal"]
    # the API made after it was registered: its request schema, GET /v1/methods, a submit
    assert report["component"]
    assert "#/components/schemas/HalfwayMerge" in report["request_schemas"]
    assert report["submitted"] == [202, "halfway"]
    assert report["refused"] == [422, "params.share"]
    listed = report["listed"]
    assert listed["formula"] == "(1 − share)·T₀ + share·T₁"
    assert listed["summary"] == "two models mixed by one share"
    share = listed["params"]["share"]
    assert share["default"] == 0.5 and share["bounds"]["text"] == "[0, 1]"
    assert share["varies_by_layer"] is False and share["per_model"] is False
    assert listed["mergekit"]["methods"] == ["halfway_mix"]
    assert "(1 − share)·T₀ + share·T₁" in report["docs_row"]
    assert "`share: 0.5`" in report["docs_row"] and "∈ [0, 1]" in report["docs_row"]
    assert report["mergekit"]["method"] == "halfway"
    assert report["mergekit"]["params"] == {"share": 0.75}
    assert report["baseline"] == "halfway"
    assert "halfway" not in METHODS  # this process's registry is as shipped
