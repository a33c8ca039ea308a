"""passthrough against a plain reference (renumbered copies), forward passes of stacked llama and
GPT-2 outputs, and the recipe errors that name their field."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.errors import RecipeError
from engine.planner import make_plan
from engine.recipe import parse_recipe
from tests.conftest import Family
from tests.engine.test_output import assert_forward_pass
from tests.reference import load, read_header


def passthrough(*slices: tuple[Path, int, int], models: list[Path] | None = None) -> Any:
    """A recipe stacking (model, start, end) slices; models = the distinct ones, in order."""
    listed = models or list(dict.fromkeys(m for m, _, _ in slices))
    return {
        "method": "passthrough",
        "models": [str(m) for m in listed],
        "params": {"slices": [{"sources": [{"model": str(m), "layer_range": [a, b]}]}
                              for m, a, b in slices]},
    }  # fmt: skip


def expected_stack(
    slices: list[tuple[Path, int, int]], prefix: str, head: re.Pattern[str]
) -> dict[str, torch.Tensor]:
    """Written from the definition: output layer k = the k-th listed input layer; tensors before
    the stack from the first slice's model, the final norm and head from the last's."""
    first, last = load(slices[0][0]), load(slices[-1][0])
    numbered = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.(.*)$")
    out = {n: (last if head.search(n) else first)[n] for n in first if not numbered.match(n)}
    k = 0
    for model, start, end in slices:
        tensors = load(model)
        for j in range(start, end):
            for name, tensor in tensors.items():
                if (m := numbered.match(name)) and int(m.group(1)) == j:
                    out[f"{prefix}.{k}.{m.group(2)}"] = tensor
            k += 1
    return out


def assert_same(out_dir: Path, expected: dict[str, torch.Tensor]) -> None:
    actual = load(out_dir)
    assert set(actual) == set(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype and torch.equal(actual[name], tensor), name


LLAMA_HEAD = re.compile(r"^(model\.norm|lm_head)\.")
GPT2_HEAD = re.compile(r"^(transformer\.ln_f|lm_head)\.")


def test_llama_stack_is_renumbered_copies_and_runs(llama: Family, run_merge: Any) -> None:
    slices = [(llama.task, 0, 4), (llama.language, 2, 6), (llama.task, 5, 6)]
    result = run_merge(passthrough(*slices))
    assert_same(result.out_dir, expected_stack(slices, "model.layers", LLAMA_HEAD))
    config = json.loads((result.out_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 9
    assert_forward_pass(result.out_dir)


def test_gpt2_stack_runs(gpt2_pair: tuple[Path, Path], run_merge: Any) -> None:
    from transformers import AutoModelForCausalLM

    a, b = gpt2_pair
    slices = [(b, 1, 4), (a, 0, 3)]
    result = run_merge(passthrough(*slices, models=[a, b]))
    assert_same(result.out_dir, expected_stack(slices, "transformer.h", GPT2_HEAD))
    assert json.loads((result.out_dir / "config.json").read_text())["n_layer"] == 6
    model = AutoModelForCausalLM.from_pretrained(str(result.out_dir))
    assert len(model.transformer.h) == 6
    state, weights = model.state_dict(), load(result.out_dir)
    assert all(torch.equal(state[n], t) for n, t in weights.items())
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[5, 9, 17, 33]])).logits
    assert logits.shape == (1, 4, 256) and bool(torch.isfinite(logits).all())


def test_every_tensor_is_a_copy_and_dtype_conversion_reads_renamed(
    llama: Family, run_merge: Any
) -> None:
    recipe = passthrough((llama.language, 3, 5))
    plan = make_plan(parse_recipe(recipe), resolve=Path, headers_only=True)
    plan.close()
    assert {t.op for t in plan.tensors} == {"copy"} and plan.num_layers == 2
    assert plan.config_changes == {"num_hidden_layers": 2}
    recipe["output"] = {"dtype": "float32"}
    result = run_merge(recipe)
    expected = expected_stack([(llama.language, 3, 5)], "model.layers", LLAMA_HEAD)
    assert_same(result.out_dir, {n: t.float() for n, t in expected.items()})
    assert json.loads((result.out_dir / "config.json").read_text())["num_hidden_layers"] == 2


def test_a_reordered_stack_is_laid_out_as_save_file_writes_it(
    llama: Family, run_merge: Any, tmp_path: Path
) -> None:
    """A stack of 12 layers taken out of order: the file holds its tensors sorted by name (after
    dtype), as the safetensors library's save_file lays them out (mergekit writes with it), not
    in layer order; byte for byte the file save_file writes of the same tensors."""
    from safetensors.torch import save_file

    slices = [(llama.language, 3, 6), (llama.task, 0, 6), (llama.language, 0, 3)]
    result = run_merge(passthrough(*slices))
    out = result.out_dir / "model.safetensors"
    header, _ = read_header(out)
    names = list(header)
    assert names == sorted(names)
    assert names.index("model.layers.10.mlp.up_proj.weight") < names.index(
        "model.layers.2.mlp.up_proj.weight"
    )
    starts = [header[n]["data_offsets"][0] for n in names]
    assert starts == sorted(starts)  # the data in the header's order
    saved = tmp_path / "save_file.safetensors"
    save_file(load(result.out_dir), str(saved), metadata={"format": "pt"})
    assert out.read_bytes() == saved.read_bytes()


def test_layer_range_outside_the_model_names_its_field(llama: Family, run_merge: Any) -> None:
    with pytest.raises(RecipeError) as error:
        run_merge(passthrough((llama.task, 0, 2), (llama.language, 4, 7)))
    assert error.value.details["field"] == "params.slices.1.sources.0.layer_range"
    assert "6 layers" in str(error.value)


@pytest.mark.parametrize(
    ("recipe", "field"),
    [
        (passthrough((Path("a"), 0, 2), models=[Path("b")]), "params.slices.0.sources.0.model"),
        (passthrough((Path("a"), 0, 2), models=[Path("a"), Path("b")]), "models.1"),
        (passthrough((Path("a"), 2, 2)), "params.slices.0.sources.0.layer_range"),
        (passthrough((Path("a"), -1, 2)), "params.slices.0.sources.0.layer_range"),
        ({"method": "passthrough", "models": ["a"], "params": {"slices": []}}, "params.slices"),
        ({"method": "passthrough", "models": ["a"]}, "params"),
        (
            {"method": "passthrough", "models": ["a"], "params": {"slices": [{"sources": [
                {"model": "a", "layer_range": [0, 1]}, {"model": "a", "layer_range": [0, 1]}
            ]}]}},
            "params.slices.0.sources",
        ),
    ],
    ids=["model-not-input", "unused-model", "empty-range", "negative", "no-slices", "no-params",
         "two-sources"],
)  # fmt: skip
def test_invalid_recipes_name_their_field(recipe: dict[str, Any], field: str) -> None:
    with pytest.raises(RecipeError) as error:
        parse_recipe(recipe)
    assert error.value.details["field"] == field, error.value
