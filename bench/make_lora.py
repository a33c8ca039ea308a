"""A small PEFT LoRA adapter for the benchmark checkpoints: rank 16 on every layer's q_proj,
v_proj and down_proj, random A and B (B not zero, so that applying it changes the weights),
written as `save_pretrained` writes one (adapter_config.json, adapter_model.safetensors).

    .venv/bin/python bench/make_lora.py [--preset large]   # bench/data/<preset>/lora
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from peft import LoraConfig
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="large")
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    data = ROOT / "bench" / "data" / args.preset
    model = json.loads((data / "base" / "config.json").read_text())
    index = json.loads((data / "base" / "model.safetensors.index.json").read_text())
    shapes = _shapes(data / "base", index["weight_map"])
    out = data / "lora"
    out.mkdir(exist_ok=True)
    modules = sorted(target.split(".")[-1] for target in TARGETS)
    config = LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, target_modules=modules, lora_dropout=0.0,
        bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip
    config.base_model_name_or_path = str(data / "base")
    config.save_pretrained(str(out))
    generator = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(model["num_hidden_layers"]):
        for target in sorted(TARGETS):
            name = f"model.layers.{layer}.{target}"
            rows, columns = shapes[f"{name}.weight"]
            prefix = f"base_model.model.{name}"
            a = torch.randn(args.rank, columns, generator=generator) / columns**0.5
            b = torch.randn(rows, args.rank, generator=generator) * 0.002
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    print(f"{out}: {len(tensors)} tensors, rank {args.rank}")


def _shapes(model: Path, weight_map: dict[str, str]) -> dict[str, list[int]]:
    """Every tensor's shape, from the shards' headers."""
    shapes: dict[str, list[int]] = {}
    for shard in sorted(set(weight_map.values())):
        with (model / shard).open("rb") as file:
            size = int.from_bytes(file.read(8), "little")
            header = json.loads(file.read(size))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


if __name__ == "__main__":
    main()
