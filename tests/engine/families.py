"""Tiny random checkpoints of many model families, saved by transformers itself.

Each family is a config (the smallest sizes its class accepts), the transformers class that
saves and loads it, and -- written here from the files transformers saves, not from the
engine's table -- where the language model's layers are. Nothing here imports the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

TEXT_LAYERS = 4
VISION_LAYERS = 2  # fewer than the text stack: a swap by index would touch layers 0 and 1
_SIZES = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 64,
    "max_position_embeddings": 64,
}
_DECODER = {**_SIZES, "num_hidden_layers": TEXT_LAYERS}
_HEAD_DIM = {**_DECODER, "head_dim": 8}
_TOKENS = {**_HEAD_DIM, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # within 64
_MOE = {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 16}
_GPT = {"n_embd": 16, "n_layer": TEXT_LAYERS, "n_head": 2, "vocab_size": 64, "n_positions": 64}
_VISION = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": VISION_LAYERS,
    "num_attention_heads": 2,
    "image_size": 16,
    "patch_size": 8,
}
_DEEPSEEK = {
    **_DECODER,
    "moe_intermediate_size": 16,
    "n_routed_experts": 2,
    "num_experts_per_tok": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 8,
    "q_lora_rank": 8,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 4,
    "num_key_value_heads": 2,  # multi-head latent attention: as many as the query heads
}
_FALCON = {"hidden_size": 16, "num_hidden_layers": TEXT_LAYERS, "num_attention_heads": 2}
_BLOOM = {"hidden_size": 16, "n_layer": TEXT_LAYERS, "n_head": 2}
_MPT = {"d_model": 16, "n_layers": TEXT_LAYERS, "n_heads": 2, "max_seq_len": 64}
_T5 = {"d_model": 16, "d_ff": 32, "d_kv": 8, "num_layers": TEXT_LAYERS, "num_heads": 2}
_BART = {
    "d_model": 16, "encoder_layers": TEXT_LAYERS, "decoder_layers": TEXT_LAYERS,
    "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 32,
    "decoder_ffn_dim": 32, "max_position_embeddings": 64, "vocab_size": 64,
}  # fmt: skip
_QWEN2_VL_VISION = {
    "depth": VISION_LAYERS,
    "embed_dim": 16,
    "hidden_size": 16,
    "num_heads": 2,
    "mlp_ratio": 2,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


@dataclass(frozen=True)
class FamilySpec:
    """How to build one family, and where its language model's layers are in the files."""

    config: dict[str, Any]
    stack: str | None = "model.layers"  # None: no single language stack (encoder-decoder)
    kind: str = "causal"  # causal | image_text | seq2seq
    other_stacks: tuple[str, ...] = field(default=())


FAMILY_SPECS: dict[str, FamilySpec] = {
    "llama": FamilySpec(_DECODER),
    "mistral": FamilySpec(_DECODER),
    "mixtral": FamilySpec({**_DECODER, "num_local_experts": 2, "num_experts_per_tok": 1}),
    "qwen2": FamilySpec(_DECODER),
    "qwen2_moe": FamilySpec({**_DECODER, **_MOE, "shared_expert_intermediate_size": 16}),
    "qwen3": FamilySpec(_HEAD_DIM),
    "qwen3_moe": FamilySpec({**_HEAD_DIM, **_MOE}),
    "gemma": FamilySpec(_HEAD_DIM),
    "gemma2": FamilySpec(_HEAD_DIM),
    "gemma3_text": FamilySpec(_HEAD_DIM),
    "phi": FamilySpec(_DECODER),
    "phi3": FamilySpec({**_DECODER, "pad_token_id": 0}),
    "olmo2": FamilySpec(_DECODER),
    "granite": FamilySpec(_DECODER),
    "stablelm": FamilySpec(_DECODER),
    "starcoder2": FamilySpec(_DECODER),
    "cohere": FamilySpec(_DECODER),
    "deepseek_v3": FamilySpec(_DEEPSEEK),
    # More decoder-only families people merge, each as transformers builds it
    "olmo": FamilySpec(_TOKENS),
    "olmo3": FamilySpec(_TOKENS),
    "smollm3": FamilySpec(_TOKENS),
    "glm": FamilySpec(_TOKENS),
    "glm4": FamilySpec(_TOKENS),
    "gpt_oss": FamilySpec(_TOKENS),
    "exaone4": FamilySpec(_TOKENS),
    "ernie4_5": FamilySpec(_TOKENS),
    "llama4_text": FamilySpec(_TOKENS),
    "nemotron": FamilySpec(_TOKENS),
    "granitemoe": FamilySpec(_TOKENS),
    "phimoe": FamilySpec(_TOKENS),
    "helium": FamilySpec(_TOKENS),
    "seed_oss": FamilySpec(_TOKENS),
    "apertus": FamilySpec(_TOKENS),
    "arcee": FamilySpec(_TOKENS),
    "hunyuan_v1_dense": FamilySpec(_TOKENS),
    "minimax": FamilySpec(_TOKENS),
    "gpt_neox": FamilySpec(_DECODER, "gpt_neox.layers"),
    "gpt2": FamilySpec(_GPT, "transformer.h"),
    "gptj": FamilySpec({**_GPT, "rotary_dim": 4}, "transformer.h"),
    "falcon": FamilySpec({**_FALCON, "vocab_size": 64}, "transformer.h"),
    "bloom": FamilySpec({**_BLOOM, "vocab_size": 64}, "transformer.h"),
    "mpt": FamilySpec({**_MPT, "vocab_size": 64}, "transformer.blocks"),
    "gemma3": FamilySpec(
        {
            "text_config": _HEAD_DIM,
            "vision_config": _VISION,
            "mm_tokens_per_image": 4,
            "image_token_index": 63,
            "boi_token_index": 61,
            "eoi_token_index": 62,
        },
        "language_model.model.layers",
        "image_text",
        ("vision_tower.", "multi_modal_projector."),
    ),
    "llava": FamilySpec(
        {
            "text_config": {"model_type": "llama", **_DECODER},
            "vision_config": {"model_type": "clip_vision_model", **_VISION, "projection_dim": 16},
            "image_token_index": 63,
            "vision_feature_layer": -1,
        },
        "language_model.model.layers",
        "image_text",
        ("vision_tower.", "multi_modal_projector."),
    ),
    "qwen2_vl": FamilySpec(
        {
            "text_config": {
                **_DECODER,
                "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
            },
            "vision_config": _QWEN2_VL_VISION,
            "image_token_id": 63,
            "video_token_id": 62,
            "vision_start_token_id": 61,
        },
        "model.layers",
        "image_text",
        ("visual.",),
    ),
    "t5": FamilySpec(
        {**_T5, "num_decoder_layers": TEXT_LAYERS, "vocab_size": 64},
        None,
        "seq2seq",
        ("encoder.block.", "decoder.block."),
    ),
    "bart": FamilySpec(_BART, None, "seq2seq", ("model.encoder.layers.", "model.decoder.layers.")),
}


def installed(family: str) -> bool:
    """Whether the installed transformers has a config class for `family`."""
    from transformers import CONFIG_MAPPING

    return family in CONFIG_MAPPING


def model_class(kind: str) -> Any:
    import transformers

    return {
        "causal": transformers.AutoModelForCausalLM,
        "image_text": transformers.AutoModelForImageTextToText,
        "seq2seq": transformers.AutoModelForSeq2SeqLM,
    }[kind]


def save_family(family: str, out: Path, seed: int) -> Path:
    """A random-weight checkpoint of `family`, bf16, as `save_pretrained` writes it."""
    from transformers import AutoConfig

    spec = FAMILY_SPECS[family]
    config = AutoConfig.for_model(family, **spec.config)
    with torch.random.fork_rng(devices=[]):  # seeded init, global RNG left as it was
        torch.manual_seed(seed)
        model = model_class(spec.kind).from_config(config)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return out


def forward_check(family: str, directory: Path) -> None:
    """Load a checkpoint with transformers (every tensor used, none missing) and run it."""
    spec = FAMILY_SPECS[family]
    model, info = model_class(spec.kind).from_pretrained(
        directory, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], (family, info)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    extra = {"decoder_input_ids": ids[:, :2]} if spec.kind == "seq2seq" else {}
    with torch.no_grad():
        logits = model(input_ids=ids, **extra).logits
    assert logits.shape[-1] == 64 and bool(torch.isfinite(logits).all()), family
