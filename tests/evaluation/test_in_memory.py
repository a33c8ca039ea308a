"""A layer swap assembled in memory is the checkpoint the streaming engine writes: every tensor
equal, the same logits from transformers, the same lm-eval scores — for several
configurations, transitions (uniform and magnitude) and non-layer modes, and a tied-embedding
family. Copied tensors share the experts' storage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from core.evaluation import in_memory
from core.evaluation.in_memory import assemble
from core.evaluation.runner import evaluate
from core.evaluation.spec import EvaluationSpec
from engine.merge import MergeOptions, merge
from engine.recipe import parse_recipe
from tests.evaluation.conftest import MAX_GEN_TOKS, TASK, Model

CONFIGS = [
    {"bottom": 1, "top": 1},
    {"bottom": 1, "top": 1, "bottom_transition": 1, "top_transition": 1},
    {"bottom": 2, "top": 1, "non_layer": "task"},
    {"bottom": 1, "top": 2, "bottom_transition": 1, "transition_weights": "magnitude"},
    {"bottom": 1, "top": 1, "top_transition": 2, "non_layer": "language"},
]
SPEC = EvaluationSpec(tasks=[TASK], num_fewshot=0, batch_size=2, max_gen_toks=MAX_GEN_TOKS)


def recipe(params: dict[str, Any], root: Path) -> Any:
    return parse_recipe(
        {
            "method": "layer_swap",
            "base": str(root / "base"),
            "experts": {"task": [str(root / "math")], "language": [str(root / "swh")]},
            "params": params,
        }
    )


def logits(model: Any) -> torch.Tensor:
    ids = torch.tensor([[1, 17, 42, 99, 7, 3, 120]])
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("params", CONFIGS, ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_the_assembled_model_is_the_written_one(
    params: dict[str, Any], examples: Path, math_expert: Model, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    swap = recipe(params, examples)
    built = assemble(swap, resolve=Path)
    written = merge(swap, tmp_path / "out", resolve=Path, options=MergeOptions(durable=False))
    assert built.plan_digest == written.plan_digest
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    mine, theirs = built.model.state_dict(), loaded.state_dict()
    assert set(mine) == set(theirs)
    for name, tensor in theirs.items():
        assert mine[name].dtype == tensor.dtype, name
        assert torch.equal(mine[name], tensor), name
    assert torch.equal(logits(built.model), logits(loaded))
    assert built.referenced > built.computed
    if params.get("bottom_transition") or params.get("top_transition"):
        assert built.computed > 0  # the transition layers' tensors are averaged

    # lm-eval scores the same, document by document.
    on_disk = evaluate(tmp_path / "out", SPEC, tasks_dir=None, data_dir=math_expert.data_dir)
    in_ram = evaluate(None, SPEC, prebuilt=built, tasks_dir=None, data_dir=math_expert.data_dir)
    assert [(s.filter, s.metric, s.value) for s in in_ram.scores] == [
        (s.filter, s.metric, s.value) for s in on_disk.scores
    ]
    assert [r["response"] for r in in_ram.samples] == [r["response"] for r in on_disk.samples]


def test_copied_tensors_are_the_experts_loaded_once(examples: Path) -> None:
    first = assemble(recipe(CONFIGS[0], examples), resolve=Path)
    second = assemble(recipe(CONFIGS[2], examples), resolve=Path)
    name = "model.layers.3.mlp.up_proj.weight"  # a middle layer: the task expert's in both
    assert first.model.state_dict()[name].data_ptr() == second.model.state_dict()[name].data_ptr()
    assert in_memory.held() <= in_memory.MAX_HELD
    assert first.digest != second.digest


def test_a_tied_embedding_family(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from worker.examples import make_checkpoint

    base = make_checkpoint(tmp_path / "base", arch="gemma", tie_embeddings=True, layers=4)
    make_checkpoint(tmp_path / "math", base=base, seed=1, layer_scale=[0.01, 0.05, 0.05, 0.01])
    make_checkpoint(tmp_path / "swh", base=base, seed=2, layer_scale=[0.05, 0.01, 0.01, 0.05])
    swap = recipe({"bottom": 1, "top": 1, "bottom_transition": 1}, tmp_path)
    built = assemble(swap, resolve=Path)
    merge(swap, tmp_path / "out", resolve=Path, options=MergeOptions(durable=False))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert torch.equal(logits(built.model), logits(loaded))
    head = built.model.get_output_embeddings().weight
    assert head.data_ptr() == built.model.get_input_embeddings().weight.data_ptr()
