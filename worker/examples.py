"""Tiny real checkpoints and recipes to try every merge method in seconds (also test fixtures).

`make_examples(out)` writes a 6-layer Llama base, a "math" task expert (changed mostly in the
middle layers) and a "swh" language expert (changed mostly at the bottom and top), each a real
Hugging Face checkpoint that `AutoModelForCausalLM.from_pretrained` loads, plus one recipe YAML
per method. Experts are simulated as base + seeded gaussian noise scaled per layer. Their
config.json says their weights are random (core.evaluation.random_weights), so that an
evaluation can say why their scores are 0. Larger ones: worker.sized_examples.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch

from core.evaluation.random_weights import mark_random_weights
from engine.architectures import Refusal, find_layer_stack

Arch = Literal["llama", "qwen2", "mistral", "gemma"]
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(4)
DEFAULT_LAYER_SCALE = 0.05

_SENTENCES = (
    "Natalia sold clips to 48 of her friends in April, and then half as many in May.",
    "How many clips did Natalia sell altogether in April and May?",
    "Weng earns 12 dollars an hour for babysitting. Yesterday she did 50 minutes.",
    "Betty is saving money for a new wallet which costs 100 dollars.",
    "James writes a 3 page letter to 2 different friends twice a week.",
    "The answer is 72. Let us think step by step.",
    "If a train travels 60 miles in 1 hour, how far does it travel in 3 hours?",
    "There are 15 trees in the grove. Workers will plant 6 more trees today.",
    "The quick brown fox jumps over the lazy dog 7 times before noon.",
    "Add 25 and 17, then subtract 9, and divide the result by 3.",
    "Please answer the question and show your work: 8 + 5 = 13.",
    "A farmer has 24 cows and 36 sheep; what is the total number of animals?",
    "Habari ya asubuhi, rafiki yangu. Habari za leo?",
    "Tafadhali nisaidie kuhesabu: 3 + 4 = 7.",
    "Natalia aliuza klipu kwa marafiki zake 48 mwezi Aprili.",
    "Jibu ni 72. Hebu tufikiri hatua kwa hatua.",
    "Ninapenda kusoma vitabu na kujifunza lugha mpya kila siku.",
    "Mwalimu aliwapa wanafunzi maswali 10 ya hesabu.",
    "Kuna miti 15 shambani. Wafanyakazi watapanda miti 6 zaidi leo.",
    "Treni inasafiri maili 60 kwa saa 1. Itasafiri umbali gani kwa saa 3?",
    "Asante sana kwa msaada wako, tutaonana kesho asubuhi.",
    "Mkulima ana ng'ombe 24 na kondoo 36; jumla ya wanyama ni wangapi?",
    "Watoto wanacheza mpira uwanjani baada ya shule.",
    "Swahili na Kiingereza ni lugha rasmi za Kenya na Tanzania.",
    "Zero one two three four five six seven eight nine: 0 1 2 3 4 5 6 7 8 9.",
    "sifuri moja mbili tatu nne tano sita saba nane tisa kumi.",
)


@functools.cache
def _tokenizer_json() -> str:
    """Train the tiny BPE tokenizer once per process (so every example shares identical files)."""
    # tokenizers and transformers: heavy; loaded only when examples are made
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Metaspace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    tokenizer.decoder = decoders.Metaspace()
    trainer = BpeTrainer(vocab_size=256, special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    tokenizer.train_from_iterator(_SENTENCES, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    json_text: str = tokenizer.to_str()
    return json_text


def make_tokenizer(out_dir: Path) -> None:
    """Save a tiny real BPE tokenizer (vocab <= 256; <unk> <s> </s> <pad> = ids 0..3)."""
    # tokenizers and transformers: heavy; loaded only when examples are made
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=512,
    )  # fmt: skip
    wrapped.save_pretrained(str(out_dir))


def model_config(
    arch: Arch, *, layers: int, hidden: int, intermediate: int, vocab: int, heads: int,
    kv_heads: int, tie_embeddings: bool, dtype: torch.dtype,
) -> Any:  # fmt: skip
    """A transformers config of `arch` with these sizes and the tokenizer's special token ids."""
    # transformers: heavy; loaded only when examples are made
    from transformers import GemmaConfig, LlamaConfig, MistralConfig, Qwen2Config

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig,
               "gemma": GemmaConfig}  # fmt: skip
    if arch not in classes:
        raise ValueError(f"arch must be one of {sorted(classes)} (got {arch!r})")
    if hidden % heads or heads % kv_heads:
        raise ValueError("hidden must be divisible by heads, and heads by kv_heads")
    return classes[arch](
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, max_position_embeddings=512,
        tie_word_embeddings=tie_embeddings, dtype=dtype,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    )  # fmt: skip


def noise_unit(tensor: torch.Tensor, fallback: float) -> float:
    """What a perturbation is relative to: the tensor's std, or `fallback` if it is constant.

    Constant tensors (norm weights: all ones, or zeros in Gemma) fall back to the model's
    `initializer_range`, so their deltas are on the scale of the weight matrices' deltas.
    """
    std = float(tensor.detach().to(torch.float32).std()) if tensor.numel() > 1 else 0.0
    return std if std > 0 else fallback


def _perturb(
    model: Any, *, seed: int, layer_scale: Sequence[float], non_layer_scale: float
) -> None:
    """In place: W += N(0, 1) · scale · unit(W), scale per layer (tied weights counted once)."""
    generator = torch.Generator().manual_seed(seed)
    fallback = float(getattr(model.config, "initializer_range", 0.02) or 0.02)
    params = dict(model.named_parameters())  # shared (tied) parameters appear once
    stack = find_layer_stack(model.config.to_dict(), params)
    if isinstance(stack, Refusal):
        raise ValueError(stack.reason)
    with torch.no_grad():
        for name in sorted(params):
            param = params[name]
            layer = stack.layer_of(name)
            scale = non_layer_scale if layer is None else layer_scale[layer]
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if scale == 0.0:
                continue
            updated = param.to(torch.float32) + noise * (scale * noise_unit(param, fallback))
            param.copy_(updated.to(param.dtype))


@contextmanager
def _quiet_progress() -> Iterator[None]:
    """Silence transformers' "Writing model shards" bar for the duration only."""
    # transformers: heavy; loaded only when examples are made
    from transformers.utils import logging

    enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        if enabled:
            logging.enable_progress_bar()  # type: ignore[no-untyped-call]


def make_checkpoint(
    out_dir: Path,
    *,
    arch: Arch = "llama",
    layers: int = 4,
    hidden: int = 64,
    intermediate: int = 128,
    vocab: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    tie_embeddings: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    base: Path | None = None,
    layer_scale: Sequence[float] | None = None,
    non_layer_scale: float = 0.0,
    shard_size: str | None = None,
) -> Path:
    """Write a tiny real checkpoint (safetensors, config, generation config, tokenizer).

    Without `base`: a randomly initialised model of `arch` under `torch.manual_seed(seed)`.
    With `base`: a simulated fine-tune: the base's weights (its architecture; the size
    arguments are ignored) cast to `dtype`, plus gaussian noise seeded by `seed`, of std
    `layer_scale[l]` (default 0.05 for every layer) times the tensor's own std (the config's
    `initializer_range` for constant tensors such as norm weights) in layer l, and
    `non_layer_scale` times that for the other tensors.
    `shard_size` (e.g. "100KB") shards the weights and writes model.safetensors.index.json.
    """
    if base is None:
        config = model_config(
            arch, layers=layers, hidden=hidden, intermediate=intermediate, vocab=vocab,
            heads=heads, kv_heads=kv_heads, tie_embeddings=tie_embeddings, dtype=dtype,
        )  # fmt: skip
        model = _random_model(config, dtype=dtype, seed=seed)
    else:
        model = _simulated_fine_tune(
            base, dtype=dtype, seed=seed, layer_scale=layer_scale, non_layer_scale=non_layer_scale
        )
    _save(model, out_dir, shard_size)
    return out_dir


def _save(model: Any, out_dir: Path, shard_size: str | None) -> None:
    """The weights and config (sharded at `shard_size` if given), then the tokenizer."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with _quiet_progress():
        if shard_size is None:
            model.save_pretrained(str(out_dir))
        else:
            model.save_pretrained(str(out_dir), max_shard_size=shard_size)
    make_tokenizer(out_dir)


def _random_model(config: Any, *, dtype: torch.dtype, seed: int) -> Any:
    """A model of `config` initialised under `torch.manual_seed(seed)`; the global RNG is left
    as it was."""
    # transformers: heavy; loaded only when examples are made
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]


def _simulated_fine_tune(
    base: Path,
    *,
    dtype: torch.dtype,
    seed: int,
    layer_scale: Sequence[float] | None,
    non_layer_scale: float,
) -> Any:
    """The model at `base`, cast to `dtype`, with seeded noise added (make_checkpoint says how
    much)."""
    # transformers: heavy; loaded only when examples are made
    from transformers import AutoModelForCausalLM

    with _quiet_progress():
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=dtype)
    count = int(model.config.num_hidden_layers)
    scales = [DEFAULT_LAYER_SCALE] * count if layer_scale is None else list(layer_scale)
    if len(scales) != count:
        raise ValueError(f"layer_scale has {len(scales)} entries for {count} layers")
    _perturb(model, seed=seed, layer_scale=scales, non_layer_scale=non_layer_scale)
    return model


EXAMPLE_LAYERS = 6
# Per-layer noise (relative to each tensor's std): math changes the middle, swh the ends.
MATH_SCALE = (0.01, 0.06, 0.08, 0.08, 0.06, 0.01)
SWH_SCALE = (0.08, 0.02, 0.01, 0.01, 0.02, 0.08)
# expert -> (seed, per-layer noise, noise of the other tensors), both relative to the tensor's std
EXPERTS: dict[str, tuple[int, tuple[float, ...], float]] = {
    "math": (1, MATH_SCALE, 0.01),
    "swh": (2, SWH_SCALE, 0.03),
}

_HEADER = "# Paths are relative to this file. Try: layerswap merge {name}.yaml --out out-{name}\n"
_OUTPUT = "output: {dtype: source, shard_size: 2GB}\n"
RECIPES: dict[str, str] = {
    "layer_swap": (
        "method: layer_swap\n"
        "experts: {task: [./math], language: [./swh]}\n"
        "params: {bottom: 1, top: 1, non_layer: average}\n"
    ),
    "layer_swap_transitions": (
        "method: layer_swap\n"
        "base: ./base   # needed for magnitude transition weights\n"
        "experts: {task: [./math], language: [./swh]}\n"
        "params:\n  bottom: 1\n  top: 1\n  bottom_transition: 1\n  top_transition: 1\n"
        "  transition_weights: magnitude\n  non_layer: average\n"
    ),
    "soup": "method: soup\nmodels: [./math, ./swh]\nparams: {weights: uniform}\n",
    "task_arithmetic": (
        "method: task_arithmetic\nbase: ./base\nmodels: [./math, ./swh]\n"
        "params: {weights: uniform, lambda: 1.0}\n"
    ),
    "ties": (
        "method: ties\nbase: ./base\nmodels: [./math, ./swh]\n"
        "params: {weights: uniform, density: 0.5, lambda: 1.0, normalize: true}\n"
    ),
}


def make_examples(out_dir: Path) -> dict[str, Path]:
    """Write base/, math/, swh/ (6-layer Llama) and one recipe YAML per method into `out_dir`.

    Returns paths keyed "base", "math", "swh" and by recipe name ("layer_swap", "soup", ...).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"base": make_checkpoint(out_dir / "base", layers=EXAMPLE_LAYERS, seed=0)}
    for name, (seed, layer_scale, non_layer_scale) in EXPERTS.items():
        paths[name] = make_checkpoint(
            out_dir / name,
            base=paths["base"],
            seed=seed,
            layer_scale=layer_scale,
            non_layer_scale=non_layer_scale,
        )
    return paths | write_recipes(out_dir, checkpoints=paths)


def write_recipes(out_dir: Path, *, checkpoints: dict[str, Path]) -> dict[str, Path]:
    """Mark the checkpoints as random weights, then write one recipe YAML per method and the
    evaluation rows beside them; returns their paths keyed by recipe name and "eval-data"."""
    for path in checkpoints.values():
        mark_random_weights(path)
    paths = {}
    for name, body in RECIPES.items():
        path = out_dir / f"{name}.yaml"
        path.write_text(_HEADER.format(name=name) + body + _OUTPUT, encoding="utf-8")
        paths[name] = path
    paths["eval-data"] = make_eval_data(out_dir / "eval-data")
    return paths


def make_eval_data(out_dir: Path, language: str = "sw", questions: int = 16) -> Path:
    """A few MGSM-format rows (made-up arithmetic, not MGSM itself) in the layout the shipped
    `mgsm_local_direct_<lang>` tasks read, so an evaluation can be tried without the dataset:
    <out_dir>/mgsm/<lang>/{train,test}.jsonl. Real data: scripts/export_mgsm.py."""

    def row(i: int, with_answer: bool) -> dict[str, object]:
        a, b = 3 + i, 4 + 2 * i
        question = f"Juma ana machungwa {a} na anapewa {b} zaidi. Ana machungwa mangapi sasa?"
        return {
            "question": f"Question: {question}" if with_answer else question,
            "answer": f"Step-by-Step Answer: {a} + {b} = {a + b}." if with_answer else None,
            "answer_number": a + b,
            "equation_solution": f"{a} + {b} = {a + b}",
        }

    folder = out_dir / "mgsm" / language
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", [row(i, True) for i in range(8)]),
                        ("test", [row(i, False) for i in range(8, 8 + questions)])):  # fmt: skip
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        (folder / f"{split}.jsonl").write_text(lines, encoding="utf-8")
    return out_dir
