"""mergekit-yaml with its random drops replaced by given masks, so that the arithmetic of DARE
and DELLA around them can be compared bit for bit with Layerswap's (whose drops are seeded).

Run by .venv-bench's Python: `python mergekit_given_drops.py CONFIG OUT MASKS`, MASKS a
safetensors file holding, under `<tensor name>/<i>`, the mask of the i-th model's delta. Each
torch.bernoulli mergekit makes (one per model and tensor, in model order: DARE's and DELLA's
drops) returns that mask instead of drawing one.
"""

import sys
from typing import Any

import torch
from mergekit.merge_methods import generalized_task_arithmetic as gta
from mergekit.scripts.run_yaml import main
from safetensors.torch import load_file

MASKS = load_file(sys.argv[3])
current: dict[str, Any] = {"name": None, "term": 0}
merge_group = gta.GeneralizedTaskArithmeticMerge.merge_group


def named_merge_group(self: Any, group: Any, /, **parameters: Any) -> torch.Tensor:
    current["name"], current["term"] = group.metadata.name, 0
    merged: torch.Tensor = merge_group(self, group, **parameters)
    return merged


def given_bernoulli(p: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    mask = MASKS[f"{current['name']}/{current['term']}"]
    current["term"] += 1
    return mask.reshape(p.shape).to(p.dtype)


gta.GeneralizedTaskArithmeticMerge.merge_group = named_merge_group  # type: ignore[method-assign]
torch.bernoulli = given_bernoulli  # type: ignore[assignment]
main.main(args=[sys.argv[1], sys.argv[2], "--allow-crimes"], standalone_mode=False)
