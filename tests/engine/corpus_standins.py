"""The published configs of mergekit_corpus/ made runnable: every model they name replaced by a
tiny local stand-in of the family, layer count and dtype their header gives, and nothing else
changed.

Stand-ins (`StandIns`): per (family, layers, dtype) one base, randomly initialised by
transformers, and fine-tunes of it (its weights plus seeded noise), each with a tokenizer, a chat
template and a generation config; hidden size 16, two heads, 256 tokens, so 80 layers stay small.
A config's base_model is the base; its other models are fine-tunes, a different one per distinct
name; a LoRA reference's adapter is a random rank-2 adapter of the base. The base's config.json,
generation config and chat template differ from the fine-tunes' (which share theirs): an output
that takes them from the wrong input shows it, while a config without base_model, whose donor
mergekit picks in set order, gets the same files whichever model is picked.

`adapt` substitutes the stand-ins' absolute paths for the references in the config's text, line
by line, so its comments, quoting and key order stay as published.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from tests.helpers import built_once

CORPUS = Path(__file__).with_name("mergekit_corpus")
# The header's family when it names no transformers class of its own: Phi-4 is published as
# Phi3ForCausalLM; configs with placeholder models ("unknown") get a Llama.
CLASS_OF = {"phi4": "phi3", "unknown": "llama"}
# Layer counts the header leaves open: any count serves configs that name no layer; BERT's (26)
# must reach its slices' layer 2.
UNKNOWN_LAYERS = {"bert": 3, "unknown": 4}
# A dtype mergekit does not know (35: `bfloat`) is not the models' own: Mistral Large is bf16.
MODEL_DTYPE = {"bfloat": "bfloat16"}
_SIZES = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2,
          "vocab_size": 256, "max_position_embeddings": 256}  # fmt: skip
_TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}  # worker.examples' ids
_DECODER = {**_SIZES, **_TOKENS, "num_key_value_heads": 1}
_GPT2 = {"n_embd": 16, "n_head": 2, "n_inner": 32, "vocab_size": 256, "n_positions": 256}
_VISION = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 2, "image_size": 16, "patch_size": 8}  # fmt: skip
_GEMMA3 = {"text_config": {**_DECODER, "head_dim": 8}, "vision_config": _VISION,
           "mm_tokens_per_image": 4, "boi_token_index": 253, "eoi_token_index": 254,
           "image_token_index": 255}  # fmt: skip
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {  # family -> (auto class, config)
    "llama": ("causal", {**_DECODER, "head_dim": 8}),
    "mistral": ("causal", {**_DECODER, "head_dim": 8}),
    "qwen2": ("causal", _DECODER),
    "gemma2": ("causal", {**_DECODER, "head_dim": 8}),
    "phi3": ("causal", _DECODER),
    "gpt2": ("causal", {**_GPT2, "bos_token_id": 1, "eos_token_id": 2}),
    "bert": ("encoder", {**_SIZES, "pad_token_id": 3}),
    "gemma3": ("image_text", _GEMMA3),
}
LAYER_KEY = {"gpt2": "n_layer"}
BASE_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
TUNED_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TUNED_GENERATION = {"do_sample": True, "temperature": 0.6, "top_p": 0.9}
NOISE = 0.05  # a fine-tune's change, relative to each tensor's spread
_REFERENCE_KEYS = ("model", "base_model", "tokenizer_source", "source")
_NOT_MODELS = ("union", "base")  # tokenizer sources that name no model
_REFERENCE_LINE = re.compile(
    r"^(?P<lead>\s*(?:-\s+)?(?:" + "|".join(_REFERENCE_KEYS) + r")\s*:\s+)"
    r"(?P<value>.+?)(?P<tail>(?:\s+#.*)?\s*)$"
)


@dataclass(frozen=True)
class Group:
    """Which stand-ins a config needs: its header's family, layer count and dtype."""

    family: str
    layers: int
    dtype: str

    @property
    def key(self) -> str:
        return f"mergekit-corpus-{self.family}-{self.layers}-{self.dtype}"


@dataclass(frozen=True)
class Published:
    """One file of the corpus: its name, its text as published, and what its header says."""

    name: str
    text: str
    group: Group

    @property
    def config(self) -> Any:
        return yaml.safe_load(self.text)

    @property
    def method(self) -> str:
        return str(self.config["merge_method"])


@cache
def corpus() -> dict[str, Published]:
    """Every config of the corpus, by file name without `.yml`."""
    found = {}
    for path in sorted(CORPUS.glob("*.yml")):
        text = path.read_text(encoding="utf-8")
        header = re.search(r"^# family: (\S+)\s+layers: (\S+)\s+dtype: (\S+)", text, re.M)
        assert header, f"{path.name}: no '# family: ... layers: ... dtype: ...' line"
        family, layers, dtype = header.groups()
        standin = CLASS_OF.get(family, family)
        count = UNKNOWN_LAYERS[family] if layers == "unknown" else int(layers)
        group = Group(standin, count, MODEL_DTYPE.get(dtype, dtype))
        found[path.stem] = Published(path.stem, text, group)
    return found


# -- the references a config makes ------------------------------------------------------------
def references(config: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(role, reference) for every model the config names, in order: role "base" for a
    base_model, "model" for the others."""
    if isinstance(config.get("base_model"), str):
        yield "base", config["base_model"]
    yield from _inputs(config)
    for module in (config.get("modules") or {}).values():
        yield from _inputs(module)
    tokenizer = config.get("tokenizer") or {}
    for source in (config.get("tokenizer_source"), tokenizer.get("source")):
        if isinstance(source, str) and source not in _NOT_MODELS:
            yield "model", source


def _inputs(block: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for entry in block.get("models") or []:
        yield "model", entry["model"]
    for piece in block.get("slices") or []:
        if isinstance(piece.get("base_model"), str):
            yield "base", piece["base_model"]
        for source in piece["sources"]:
            yield "model", source["model"]


def model_name(reference: str) -> str:
    """The model a reference names, less a LoRA (`model+lora`)."""
    return reference.split("+", 1)[0]


def assignment(config: dict[str, Any]) -> dict[str, str]:
    """Each distinct model name -> "base" or "tuned-N" (N from 1, in order of first mention)."""
    names: dict[str, str] = {}
    for role, reference in sorted(references(config), key=lambda r: r[0] != "base"):
        name = model_name(reference)
        if name not in names:
            tuned = sum(1 for v in names.values() if v != "base")
            first_base = role == "base" and "base" not in names.values()
            names[name] = "base" if first_base else f"tuned-{tuned + 1}"
    return names


def needs_lora(config: dict[str, Any]) -> bool:
    return any("+" in reference for _, reference in references(config))


@cache
def _needed() -> dict[Group, tuple[int, bool]]:
    """Per group, how many fine-tunes its configs need at most, and whether a LoRA adapter."""
    needed: dict[Group, tuple[int, bool]] = {}
    for published in corpus().values():
        config = published.config
        tuned = sum(1 for v in assignment(config).values() if v != "base")
        before, lora = needed.get(published.group, (0, False))
        needed[published.group] = (max(before, tuned), lora or needs_lora(config))
    return needed


# -- adapting a config ----------------------------------------------------------------------------
class StandIns:
    """The stand-ins of each group, built on first use, once per test run (pytest-xdist's
    workers share them), under the run's temporary directory."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory

    def directory(self, group: Group) -> Path:
        tuned, lora = _needed()[group]
        return built_once(self.factory, group.key, lambda d: build_group(d, group, tuned, lora))

    def adapt(self, published: Published) -> str:
        """The config's text with each model reference replaced by its stand-in's path."""
        root = self.directory(published.group)
        names = {n: root / member for n, member in assignment(published.config).items()}

        def standin(reference: str) -> str | None:
            name, plus, _lora = reference.partition("+")
            if name not in names:
                return None
            return str(names[name]) + (f"+{root / 'lora'}" if plus else "")

        lines = [_substituted(line, standin) for line in published.text.splitlines()]
        text = "\n".join(lines) + "\n"
        for _, reference in references(yaml.safe_load(text)):
            for part in reference.split("+"):
                assert Path(part).is_dir(), f"{published.name}: {reference} was not substituted"
        return text


def _substituted(line: str, standin: Any) -> str:
    match = _REFERENCE_LINE.match(line)
    if not match:
        return line
    value = match["value"]
    quote = value[0] if value[0] in "\"'" and value[-1] == value[0] and len(value) > 1 else ""
    found = standin(value[1:-1] if quote else value)
    if found is None:  # not a model: `source: union`
        return line
    return f"{match['lead']}{quote}{found}{quote}{match['tail']}"


# -- building the stand-ins -----------------------------------------------------------------------
def build_group(directory: Path, group: Group, tuned: int, lora: bool) -> None:
    base = save_base(directory / "base", group)
    for seed in range(1, tuned + 1):
        save_tuned(base, directory / f"tuned-{seed}", seed=seed)
    if lora:
        save_lora(base, directory / "lora")


def save_base(out: Path, group: Group) -> Path:
    """A randomly initialised model of the group's family, as transformers saves it, with the
    tiny BPE tokenizer of worker.examples and a chat template."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    from transformers import AutoModelForImageTextToText as ImageText

    from worker.examples import make_tokenizer

    kind, sizes = FAMILIES[group.family]
    sizes = json.loads(json.dumps(sizes))  # a copy, nested sections too
    layers = sizes.get("text_config", sizes)
    layers[LAYER_KEY.get(group.family, "num_hidden_layers")] = group.layers
    config = AutoConfig.for_model(group.family, **sizes)
    auto = {"causal": AutoModelForCausalLM, "encoder": AutoModel, "image_text": ImageText}[kind]
    with torch.random.fork_rng(devices=[]):  # seeded, the global RNG left as it was
        torch.manual_seed(0)
        model = auto.from_config(config)  # type: ignore[no-untyped-call]
    model.to(getattr(torch, group.dtype)).save_pretrained(str(out))
    make_tokenizer(out)
    (out / "chat_template.jinja").write_text(BASE_TEMPLATE, encoding="utf-8")
    return out


def save_tuned(base: Path, out: Path, *, seed: int) -> Path:
    """The base plus seeded noise in every tensor; its own config.json (use_cache off, as
    trainers save it), generation config (sampling) and chat template, shared by every
    fine-tune."""
    shutil.copytree(base, out, ignore=shutil.ignore_patterns("*.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    for file in base.glob("*.safetensors"):
        tensors = load_file(str(file))
        for name in sorted(tensors):
            tensor = tensors[name].float()
            spread = float(tensor.std()) if tensor.numel() > 1 else 0.0
            unit = spread or max(float(tensor.abs().mean()), 0.02)  # a norm's ones or zeros
            noise = torch.randn(tensor.shape, generator=generator) * NOISE * unit
            tensors[name] = (tensor + noise).to(tensors[name].dtype)
        save_file(tensors, str(out / file.name), metadata={"format": "pt"})
    _edit_json(out / "config.json", {"use_cache": False})
    if (out / "generation_config.json").is_file():
        _edit_json(out / "generation_config.json", TUNED_GENERATION)
    (out / "chat_template.jinja").write_text(TUNED_TEMPLATE, encoding="utf-8")
    return out


def _edit_json(path: Path, changes: dict[str, Any]) -> None:
    data = {**json.loads(path.read_text(encoding="utf-8")), **changes}
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def save_lora(base: Path, out: Path) -> Path:
    """A rank-2 LoRA adapter of the base's attention (peft, both matrices random, so merging it
    changes the weights)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft asks transformers a deprecated name
        torch.manual_seed(7)
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        adapter = LoraConfig(
            r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False
        )
        get_peft_model(model, adapter).save_pretrained(str(out))
    return out
