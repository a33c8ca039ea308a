"""The files mergekit-yaml writes beside the weights, written for a translated config as it
writes them (mergekit 0.1.5 with transformers 5, the version it requires).

- The donor: mergekit takes config.json, and the tokenizer it copies, from the config's
  `base_model`, else from whichever model its set of models yields first (Python's set order,
  which may change from run to run); Layerswap then from the recipe's own choice, saying so
  where the models' files differ.
- config.json: the donor's, as transformers writes a config anew: `dtype` set to `out_dtype`
  (else `dtype`) where the config gives one, a `torch_dtype` key renamed `dtype`, the keys
  sorted; the layer count and vocabulary size as the merge changed them.
- The tokenizer: without `chat_template` or `tokenizer_source`, and where the donor has a
  tokenizer_config.json and a tokenizer.json or tokenizer.model, mergekit copies `COPIED`,
  byte for byte, generation_config.json among them. Otherwise it loads the tokenizer with
  transformers and saves it anew (`resave`): tokenizer.json (or tokenizer.model),
  tokenizer_config.json with its keys sorted, without the chat template and with the options
  it was loaded with (is_local, local_files_only), and the chat template in
  chat_template.jinja; no generation_config.json, no special_tokens_map.json.

What transformers changes when it saves a tokenizer written by an older version (its class
name, its added-token lists) is not redone here: such a tokenizer_config.json may differ from
mergekit's in those keys.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.errors import CheckpointError
from engine.io.checkpoint import read_json, set_config_values
from engine.io.digests import file_sha256
from engine.io.file_access import Opener, copy_file, read_file
from engine.io.lora import split_source
from engine.limits import MAX_SIDE_FILE_BYTES
from engine.mergekit.chat_templates import Chosen, choose
from engine.plan.model import Plan

CONFIG = "config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE = "chat_template.jinja"
GENERATION = "generation_config.json"
TOKENIZERS = ("tokenizer.json", "tokenizer.model")  # what a re-saved tokenizer keeps of the files
SLOW = ("vocab.json", "merges.txt")  # a tokenizer without either, which transformers converts
COPIED = (
    "tokenizer_config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer.model",
    "added_tokens.json", "merges.txt", "chat_template.jinja", "generation_config.json",
    "chat_template.json", "video_preprocessor_config.json",
)  # fmt: skip
RESAVED = frozenset({*TOKENIZERS, TOKENIZER_CONFIG, TEMPLATE})


def donate(plan: Plan, donor: str | None, chat_template: Any) -> list[str]:
    """Make mergekit's donor the plan's config (and, unless the vocabulary is aligned, its
    tokenizer) input; the warnings on what differs from mergekit."""
    said: list[str] = []
    found = _index(plan, donor) if donor is not None else None
    if found is not None:
        plan.config_input = found
        if plan.vocabulary is None:
            plan.tokenizer_input = found
    elif donor is not None:
        said.append(
            f"base_model {donor}: mergekit takes config.json and the tokenizer from it; this "
            f"merge does not read it, so they come from {_label(plan, plan.config_input)}"
        )
    elif _files_differ(plan):
        said.append(
            "without base_model, mergekit takes config.json and the tokenizer from whichever "
            "model its set of models yields first (Python's set order, which may change from run "
            "to run); the models' files differ, and Layerswap takes "
            f"{_label(plan, plan.config_input)}'s"
        )
    return said + _tokenizer_warnings(plan, chat_template)


def write(plan: Plan, staging: Path, dtype: str, chat_template: Any) -> list[str]:
    """Write config.json and the tokenizer's files into `staging` as mergekit does; the names
    written."""
    written = []
    donor = plan.config_input
    if _has(plan, donor, CONFIG):
        _write_config(plan, donor, staging / CONFIG, dtype)
        written.append(CONFIG)
    source = plan.tokenizer_input
    if copies_tokenizer(plan, chat_template):
        for name in COPIED:
            if _has(plan, source, name):
                copy_file(_path(plan, source, name), staging / name, MAX_SIDE_FILE_BYTES,
                          _opener(plan, source))  # fmt: skip
                written.append(name)
        return written
    return written + _resave(plan, staging, chosen_template(plan, chat_template))


def copies_tokenizer(plan: Plan, chat_template: Any) -> bool:
    """Whether mergekit copies the donor's tokenizer files (else it saves the tokenizer anew).
    A `model+adapter` donor is the directory mergekit merges the LoRA into, which holds no
    tokenizer: it saves the model's anew."""
    source = plan.tokenizer_input
    return (
        plan.vocabulary is None
        and not chat_template
        and not _is_lora(plan, source)
        and _has(plan, source, TOKENIZER_CONFIG)
        and any(_has(plan, source, name) for name in TOKENIZERS)
    )


def chosen_template(plan: Plan, chat_template: Any) -> Chosen:
    """The template `chat_template` gives the output; `auto` reads every merged model's."""
    if chat_template != "auto":
        return choose(chat_template, [])
    seen: dict[str, int] = {}
    for i, ref in enumerate(plan.inputs):
        seen.setdefault(ref.source, i)  # a model listed twice counts once, as in mergekit's set
    return choose(chat_template, [(_label(plan, i), own_template(plan, i)) for i in seen.values()])


def own_template(plan: Plan, source: int) -> str | None:
    """The chat template input `source`'s tokenizer carries, as transformers loads it:
    chat_template.jinja, else tokenizer_config.json's (a named list's `default`)."""
    if _has(plan, source, TEMPLATE):
        return _text(plan, source, TEMPLATE)
    config = _tokenizer_config(plan, source)
    found = config.get("chat_template")
    if isinstance(found, list):
        named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
        found = named.get("default")
    return found if isinstance(found, str) else None


def _tokenizer_warnings(plan: Plan, chat_template: Any) -> list[str]:
    if copies_tokenizer(plan, chat_template):
        return []
    source = plan.tokenizer_input
    said = list(chosen_template(plan, chat_template).warnings)
    if not any(_has(plan, source, name) for name in (*TOKENIZERS, *SLOW)):
        if chat_template:
            said.append(f"chat_template: {_label(plan, source)} has no tokenizer to carry it")
        return said
    if not any(_has(plan, source, name) for name in TOKENIZERS):
        said.append(
            f"{_label(plan, source)} has no tokenizer.json: mergekit saves one that transformers "
            "converts from its vocab.json and merges.txt; Layerswap copies those"
        )
    if _has(plan, plan.config_input, GENERATION):
        why = (
            "chat_template"
            if chat_template
            else f"{_label(plan, source)} is a model+LoRA reference"
            if _is_lora(plan, source)
            else f"{_label(plan, source)} has no {TOKENIZER_CONFIG}"
        )
        said.append(
            f"{'tokenizer_source' if plan.vocabulary is not None else why}: mergekit saves the "
            f"tokenizer anew and then writes no {GENERATION}; neither does Layerswap (copy "
            f"{_label(plan, plan.config_input)}'s for its generation settings)"
        )
    return said


def _resave(plan: Plan, staging: Path, chosen: Chosen) -> list[str]:
    """The tokenizer as transformers saves it once loaded (module docstring)."""
    source = plan.tokenizer_input
    vocabulary = plan.vocabulary
    if vocabulary is not None and vocabulary.tokenizer_changed:
        written = vocabulary.write_tokenizer(
            Path(plan.inputs[source].path), staging, _opener(plan, source)
        )
        for name in set(written) - RESAVED:  # transformers saves none of these
            (staging / name).unlink()
        made = staging / TOKENIZER_CONFIG
        config = _json_object(made, None) if made.is_file() else {}
    else:
        written = [n for n in TOKENIZERS if _has(plan, source, n)]
        written = written or [n for n in SLOW if _has(plan, source, n)]
        for name in written:
            copy_file(_path(plan, source, name), staging / name, MAX_SIDE_FILE_BYTES,
                      _opener(plan, source))  # fmt: skip
        config = _tokenizer_config(plan, source)
    if not written:  # no tokenizer: mergekit cannot load one, and writes none
        return []
    template = _template(plan, config, chosen)
    config["is_local"] = not plan.inputs[source].source.startswith("hf://")
    config["local_files_only"] = False
    text = json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    (staging / TOKENIZER_CONFIG).write_text(text, encoding="utf-8")
    names = {*written, TOKENIZER_CONFIG} - {TEMPLATE}
    if template is not None:
        (staging / TEMPLATE).write_text(template, encoding="utf-8")
        names.add(TEMPLATE)
    elif (staging / TEMPLATE).exists():
        (staging / TEMPLATE).unlink()
    return sorted(names)


def _template(plan: Plan, config: dict[str, Any], chosen: Chosen) -> str | None:
    """The template saved in chat_template.jinja, taken out of `config`: the chosen one, else
    the tokenizer's own (a list of named ones stays in the config)."""
    own = config.pop("chat_template", None)
    if isinstance(own, list):
        config["chat_template"] = own
        own = None
    if chosen.text is not None:
        config.pop("chat_template", None)
        return chosen.text
    if _has(plan, plan.tokenizer_input, TEMPLATE):
        return _text(plan, plan.tokenizer_input, TEMPLATE)
    return own if isinstance(own, str) else None


def _write_config(plan: Plan, donor: int, target: Path, dtype: str) -> None:
    config = _json_object(_path(plan, donor, CONFIG), _opener(plan, donor))
    set_config_values(config, plan.config_changes)
    named = config.pop("torch_dtype", None)
    if dtype != "source":
        config["dtype"] = dtype
    elif named is not None and "dtype" not in config:
        config["dtype"] = named
    target.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _files_differ(plan: Plan) -> bool:
    """Whether the models' config.json or tokenizer files differ (None: a file absent)."""
    found = set()
    for i in {ref.source: i for i, ref in enumerate(plan.inputs)}.values():
        found.add(tuple(
            file_sha256(_path(plan, i, n), opener=_opener(plan, i)) if _has(plan, i, n) else None
            for n in (CONFIG, *COPIED)
        ))  # fmt: skip
    return len(found) > 1


def _index(plan: Plan, source: str) -> int | None:
    return next((i for i, ref in enumerate(plan.inputs) if ref.source == source), None)


def _label(plan: Plan, source: int) -> str:
    """An input as the mergekit config names it (its source)."""
    return plan.inputs[source].source


def _is_lora(plan: Plan, source: int) -> bool:
    return split_source(plan.inputs[source].source)[1] is not None


def _path(plan: Plan, source: int, name: str) -> Path:
    return Path(plan.inputs[source].path) / name


def _has(plan: Plan, source: int, name: str) -> bool:
    return _path(plan, source, name).is_file()


def _opener(plan: Plan, source: int) -> Opener:
    return plan.checkpoints[source].opener


def _text(plan: Plan, source: int, name: str) -> str:
    data = read_file(_path(plan, source, name), MAX_SIDE_FILE_BYTES, _opener(plan, source))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError.at(_path(plan, source, name), "not UTF-8 text") from None


def _tokenizer_config(plan: Plan, source: int) -> dict[str, Any]:
    if not _has(plan, source, TOKENIZER_CONFIG):
        return {}
    return _json_object(_path(plan, source, TOKENIZER_CONFIG), _opener(plan, source))


def _json_object(path: Path, opener: Opener | None) -> dict[str, Any]:
    found = read_json(path, opener=opener) if opener is not None else read_json(path)
    if not isinstance(found, dict):
        raise CheckpointError.at(path, "must be a JSON object")
    return found
