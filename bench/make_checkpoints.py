"""Synthetic Llama-shaped checkpoints for the benchmark: base/, task/ (math) and lang/ (swh).

Fast and with bounded memory: the three models share one tensor layout, so each shard's
safetensors header is written once per file and then every tensor is generated a chunk of rows
at a time (base values ~ N(0, 0.02) in bf16; an expert is base + a small seeded perturbation,
larger in the middle layers for the task expert and at the bottom/top for the language expert)
and appended to the three files at once. Peak memory is a few chunks, whatever the preset.

The layout is what `save_pretrained` produces: tensors assigned to shards in state-dict order
with a size budget, sorted by name inside each file (as the safetensors library writes them),
files named `model-0000k-of-0000n.safetensors` plus `model.safetensors.index.json`, a real
LlamaConfig `config.json`, `generation_config.json` and a word-level tokenizer whose vocabulary
is the model's.

    .venv/bin/python bench/make_checkpoints.py --preset small   # ~0.25B params, ~0.5 GB/model
    .venv/bin/python bench/make_checkpoints.py --preset large   # ~1.7B params, ~3.4 GB/model
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import struct
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

BENCH_DIR = Path(__file__).resolve().parent
DATA_DIR = BENCH_DIR / "data"
MODELS = ("base", "task", "lang")  # lang = the Swahili language expert, task = the math expert
CHUNK_ELEMENTS = 8 * 1024 * 1024
WEIGHT_STD = 0.02  # initializer_range of Llama; trained weights are of this order
NORM_STD = 0.05  # norm weights: 1 + N(0, NORM_STD)
DELTA_REL = 0.1  # an expert's perturbation, relative to the weights' std
GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class Preset:
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    shard_bytes: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


PRESETS: dict[str, Preset] = {
    # ~0.25B parameters (0.49 GB in bf16), 2 shards of <= 256 MiB.
    "small": Preset(1024, 2816, 16, 32000, 16, 4, 256 * MIB),
    # ~1.7B parameters (3.4 GB in bf16), 4 shards of <= 1 GiB, as in the README's table.
    "large": Preset(2048, 5632, 32, 64000, 32, 8, GIB),
    # A few MB: for trying the scripts themselves in seconds.
    "tiny": Preset(256, 688, 4, 4000, 8, 4, 4 * MIB),
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    layer: int | None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return 2 * self.numel  # bf16

    @property
    def is_norm(self) -> bool:
        return len(self.shape) == 1


def tensor_specs(p: Preset) -> list[TensorSpec]:
    """Every tensor of a Llama model with an untied lm_head, in state-dict order."""
    kv = p.kv_heads * p.head_dim
    specs = [TensorSpec("model.embed_tokens.weight", (p.vocab, p.hidden), None)]
    for i in range(p.layers):
        prefix = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj.weight": (p.heads * p.head_dim, p.hidden),
            "self_attn.k_proj.weight": (kv, p.hidden),
            "self_attn.v_proj.weight": (kv, p.hidden),
            "self_attn.o_proj.weight": (p.hidden, p.heads * p.head_dim),
            "mlp.gate_proj.weight": (p.intermediate, p.hidden),
            "mlp.up_proj.weight": (p.intermediate, p.hidden),
            "mlp.down_proj.weight": (p.hidden, p.intermediate),
            "input_layernorm.weight": (p.hidden,),
            "post_attention_layernorm.weight": (p.hidden,),
        }
        specs += [TensorSpec(prefix + name, shape, i) for name, shape in shapes.items()]
    specs.append(TensorSpec("model.norm.weight", (p.hidden,), None))
    specs.append(TensorSpec("lm_head.weight", (p.vocab, p.hidden), None))
    return specs


def shard_layout(specs: list[TensorSpec], budget: int) -> list[list[TensorSpec]]:
    """Shards as transformers makes them: state-dict order, a new shard when the budget would
    be exceeded; inside a file the tensors are sorted by name (the safetensors library does)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > budget:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return [sorted(shard, key=lambda s: s.name) for shard in shards]


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]


def safetensors_header(shard: list[TensorSpec]) -> bytes:
    """The 8-byte length + JSON header (space-padded to 8 bytes) for one shard."""
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in shard:
        entries[spec.name] = {
            "dtype": "BF16",
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def delta_factor(model: str, layer: int | None, layers: int) -> float:
    """How strongly an expert differs from base: the task expert mostly in the middle layers,
    the language expert mostly at the bottom and top (the pattern layer swapping relies on)."""
    if layer is None:
        return 1.0
    edge = abs(2.0 * layer / max(1, layers - 1) - 1.0) ** 2  # 1 at the ends, 0 in the middle
    return 0.5 + edge if model == "lang" else 1.5 - edge


def row_chunks(spec: TensorSpec) -> Iterator[tuple[int, ...]]:
    """Shapes of successive chunks of whole rows, each at most CHUNK_ELEMENTS (>= one row)."""
    rows = spec.shape[0]
    row = math.prod(spec.shape[1:])
    step = max(1, CHUNK_ELEMENTS // max(1, row))
    for start in range(0, rows, step):
        yield (min(step, rows - start), *spec.shape[1:])


def write_tensor(
    spec: TensorSpec,
    files: Mapping[str, BinaryIO],
    generators: dict[str, torch.Generator],
    layers: int,
) -> None:
    std = NORM_STD if spec.is_norm else WEIGHT_STD
    for shape in row_chunks(spec):
        base = torch.empty(shape, dtype=torch.bfloat16).normal_(
            0.0, std, generator=generators["base"]
        )
        if spec.is_norm:
            base.add_(1.0)
        files["base"].write(base.view(torch.uint8).numpy().data)
        for model in ("task", "lang"):
            scale = DELTA_REL * std * delta_factor(model, spec.layer, layers)
            noise = torch.empty(shape, dtype=torch.bfloat16).normal_(
                0.0, scale, generator=generators[model]
            )
            files[model].write(noise.add_(base).view(torch.uint8).numpy().data)


def write_side_files(p: Preset, directory: Path, model: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

    config = LlamaConfig(
        vocab_size=p.vocab, hidden_size=p.hidden, intermediate_size=p.intermediate,
        num_hidden_layers=p.layers, num_attention_heads=p.heads, num_key_value_heads=p.kv_heads,
        head_dim=p.head_dim, max_position_embeddings=4096, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=3,
        dtype=torch.bfloat16, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    config.save_pretrained(str(directory))
    GenerationConfig.from_model_config(config).save_pretrained(str(directory))
    special = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {token: i for i, token in enumerate(special)}
    vocab.update({f"w{i}": i for i in range(len(special), p.vocab)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wrapped = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>", model_max_length=4096,
    )  # fmt: skip
    wrapped.save_pretrained(str(directory))
    (directory / "README.md").write_text(
        f"Synthetic Llama-shaped checkpoint ({model}) made by bench/make_checkpoints.py; "
        "random weights, for benchmarking only.\n"
    )


def make_checkpoints(preset: str, out: Path, *, seed: int = 0, force: bool = False) -> Path:
    """Write out/{base,task,lang}; returns out. Skips the work if a complete set exists."""
    p = PRESETS[preset]
    stamp = out / "complete.json"
    description = {
        "preset": preset, "seed": seed, **p.__dict__, "models": list(MODELS), "format": 2,
    }  # fmt: skip
    if not force and stamp.is_file() and json.loads(stamp.read_text()) == description:
        print(f"{out}: already complete (use --force to remake)", file=sys.stderr)
        return out
    if out.exists():
        shutil.rmtree(out)
    specs = tensor_specs(p)
    shards = shard_layout(specs, p.shard_bytes)
    names = shard_names(len(shards))
    generators = {
        model: torch.Generator().manual_seed(seed * 1000 + i) for i, model in enumerate(MODELS)
    }
    for model in MODELS:
        (out / model).mkdir(parents=True)
    started = time.monotonic()
    for shard, filename in zip(shards, names, strict=True):
        header = safetensors_header(shard)
        with ExitStack() as stack:
            files = {m: stack.enter_context(open(out / m / filename, "wb")) for m in MODELS}
            for f in files.values():
                f.write(header)
            for spec in shard:
                write_tensor(spec, files, generators, p.layers)
        print(f"  wrote {filename} x{len(MODELS)} ({time.monotonic() - started:.1f} s)")
    total = sum(s.nbytes for s in specs)
    for model in MODELS:
        if len(shards) > 1:
            weight_map = {s.name: n for shard, n in zip(shards, names, strict=True) for s in shard}
            index = {
                "metadata": {"total_size": total, "total_parameters": total // 2},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (out / model / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        write_side_files(p, out / model, model)
    stamp.write_text(json.dumps(description, indent=2))
    params = sum(s.numel for s in specs)
    print(
        f"{out}: {len(MODELS)} models x {params / 1e9:.3f}B params ({total / 1e9:.2f} GB, "
        f"{len(shards)} shard(s)) in {time.monotonic() - started:.1f} s"
    )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--out", type=Path, help="default: bench/data/<preset>")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="remake even if complete")
    args = parser.parse_args(argv)
    make_checkpoints(
        args.preset, args.out or DATA_DIR / args.preset, seed=args.seed, force=args.force
    )


if __name__ == "__main__":
    main()
