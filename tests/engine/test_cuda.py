"""The CUDA path, run on a GPU host with `pytest -m gpu` (deselected by default: CI has no GPU;
there the CPU-only behaviour is tested by test_output_safety.py::test_cuda_device). Every method
merged on the GPU must give what the CPU gives: the arithmetic is the same float32 elementwise
work, so linear methods are byte-identical, and so are the sparsifying ones (Philox bits,
exact selections and sums); TIES's top-k selection, slerp, nuslerp and model_stock are compared
numerically (ties between equal magnitudes may be broken differently by the two devices' sort;
the angles' norms and dots are sums, which the GPU adds up in another order)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import Family
from tests.reference import load

pytestmark = pytest.mark.gpu
# Compared numerically: TIES's top-k ties, and the angles' norms and dots (sums in another order)
NUMERIC = ("ties", "slerp", "nuslerp", "model_stock")


def recipes(fam: Family) -> dict[str, dict[str, Any]]:
    experts = {"task": [fam.task], "language": [fam.language]}
    return {
        "layer_swap": {"method": "layer_swap", "experts": experts,
                       "params": {"bottom": 1, "top": 1, "non_layer": "average"}},
        "transitions": {"method": "layer_swap", "base": fam.base, "experts": experts,
                        "params": {"bottom": 1, "top": 1, "bottom_transition": 1,
                                   "top_transition": 1, "transition_weights": "magnitude"}},
        "soup": {"method": "soup", "models": [fam.task, fam.language],
                 "params": {"weights": "uniform"}},
        "task_arithmetic": {"method": "task_arithmetic", "base": fam.base,
                            "models": [fam.task, fam.language],
                            "params": {"weights": "uniform", "lambda": 0.7}},
        "ties": {"method": "ties", "base": fam.base, "models": [fam.task, fam.language],
                 "params": {"density": 0.5, "lambda": 1.0, "normalize": True}},
        "dare_ties": {"method": "dare_ties", "base": fam.base,
                      "models": [fam.task, fam.language, fam.language2],
                      "params": {"density": [0.3, 0.5, 1.0], "weights": [1.0, 0.5, 0.8],
                                 "normalize": True}},
        "breadcrumbs_ties": {"method": "breadcrumbs_ties", "base": fam.base,
                             "models": [fam.task, fam.language],
                             "params": {"density": 0.6, "gamma": 0.1, "rescale": True}},
        "della_linear": {"method": "della_linear", "base": fam.base,
                         "models": [fam.task, fam.language],
                         "params": {"density": 0.5, "epsilon": 0.2, "lambda": 1.2}},
        "linear": {"method": "linear", "models": [fam.task, fam.language],
                   "params": {"weights": [0.3, 0.6], "normalize": True}},
        "slerp": {"method": "slerp", "models": [fam.base, fam.language], "params": {"t": 0.3}},
        "nuslerp": {"method": "nuslerp", "base": fam.base, "models": [fam.task, fam.language],
                    "params": {"weights": [1.0, 2.0], "nuslerp_flatten": False}},
        "model_stock": {"method": "model_stock", "base": fam.base,
                        "models": [fam.task, fam.language, fam.language2]},
    }  # fmt: skip


@pytest.mark.parametrize(
    "method",
    ["layer_swap", "transitions", "soup", "task_arithmetic", "ties", "dare_ties",
     "breadcrumbs_ties", "della_linear", "linear", "slerp", "nuslerp", "model_stock"],
)  # fmt: skip
@pytest.mark.parametrize("chunk_elements", [1 << 10, 1 << 12, 1 << 22])
def test_gpu_merge_equals_cpu_merge(
    method: str, chunk_elements: int, llama: Family, run_merge: Any, tmp_path: Path
) -> None:
    recipe = recipes(llama)[method]
    gpu = run_merge(recipe, tmp_path / "gpu", device="cuda", chunk_elements=chunk_elements)
    cpu = run_merge(recipe, tmp_path / "cpu", chunk_elements=chunk_elements)
    gpu_tensors, cpu_tensors = load(gpu.out_dir), load(cpu.out_dir)
    assert gpu_tensors.keys() == cpu_tensors.keys()
    for name, tensor in cpu_tensors.items():
        if method in NUMERIC:
            torch.testing.assert_close(gpu_tensors[name], tensor, msg=name)
        else:
            torch.testing.assert_close(gpu_tensors[name], tensor, rtol=0, atol=0, msg=name)
    if method not in NUMERIC:  # same bytes, so the same sha256 per weights file
        weights = {n: d for n, d in cpu.files.items() if n.endswith(".safetensors")}
        assert weights and {n: gpu.files[n] for n in weights} == weights


def test_merged_on_gpu_loads_and_runs_on_gpu(llama: Family, run_merge: Any, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = run_merge(recipes(llama)["ties"], tmp_path / "out", device="cuda:0").out_dir
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).to("cuda")
    ids = torch.tensor([[1, 5, 9, 12]], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape[:2] == (1, 4) and torch.isfinite(logits).all()
