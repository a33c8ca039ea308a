"""`hf://org/name[@revision]` sources."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from engine.io.lora import SEPARATOR, split_source
from engine.recipe import Recipe, named_sources
from engine.schema.parts import TOKENIZER_MODEL_PREFIX

SCHEME = "hf://"
_REPO = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_REF_RE = re.compile(
    rf"^hf://(?P<repo>{_REPO})(?:@(?P<revision>[A-Za-z0-9][A-Za-z0-9._/-]{{0,199}}))?$"
)
_SHA_RE = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class HubRef:
    repo: str
    revision: str  # a branch, a tag or a commit sha

    @property
    def pinned(self) -> bool:
        return bool(_SHA_RE.match(self.revision))

    def __str__(self) -> str:
        return f"{SCHEME}{self.repo}@{self.revision}"


def is_hub_source(source: str) -> bool:
    return source.startswith(SCHEME)


def parse_hub_source(source: str) -> HubRef:
    """Raises ValueError with the expected form when `source` is not a valid hf:// reference."""
    match = _REF_RE.match(source)
    if not match:
        raise ValueError(
            f"{source!r} is not a Hub source: use hf://org/name or hf://org/name@revision"
        )
    return HubRef(match["repo"], match["revision"] or "main")


def hub_sources(recipe: Recipe) -> list[str]:
    """The recipe's hf:// sources, each once, in order (a `model+adapter` source's parts
    each on its own)."""
    parts = [part for n in named_sources(recipe) for part in source_parts(n.source)]
    return list(dict.fromkeys(part for part in parts if is_hub_source(part)))


def source_parts(source: str) -> list[str]:
    """The model and, for a `model+adapter` source, the adapter."""
    model, adapter = split_source(source)
    return [model] if adapter is None else [model, adapter]


def renamed(source: str, mapping: dict[str, str]) -> str:
    """`source` with each of its parts renamed by `mapping`."""
    return SEPARATOR.join(mapping.get(part, part) for part in source_parts(source))


def replace_sources(request: dict[str, Any], mapping: dict[str, str]) -> dict[str, Any]:
    """A recipe mapping with its sources renamed by `mapping` (e.g. pinned to commit shas)."""
    result = dict(request)
    if isinstance(result.get("experts"), dict):
        result["experts"] = {
            role: [renamed(x, mapping) for x in items] for role, items in result["experts"].items()
        }
    if isinstance(result.get("models"), list):
        result["models"] = [renamed(x, mapping) for x in result["models"]]
    if result.get("base") is not None:
        result["base"] = renamed(result["base"], mapping)
    params = result.get("params")
    if isinstance(params, dict) and isinstance(params.get("slices"), list):  # passthrough's
        result["params"] = {
            **params,
            "slices": [_renamed_slice(s, mapping) for s in params["slices"]],
        }
    if isinstance(result.get("slices"), list):  # the other methods' layers of each source
        result["slices"] = [_renamed_slice(s, mapping) for s in result["slices"]]
    source = result.get("tokenizer_source")
    if isinstance(source, str):  # names a source, maybe as model:<source>
        prefix = TOKENIZER_MODEL_PREFIX if source.startswith(TOKENIZER_MODEL_PREFIX) else ""
        named = source.removeprefix(prefix)
        result["tokenizer_source"] = prefix + renamed(named, mapping)
    return result


def _renamed_slice(piece: Any, mapping: dict[str, str]) -> Any:
    if not isinstance(piece, dict) or not isinstance(piece.get("sources"), list):
        return piece
    sources = [
        {**x, "model": renamed(x["model"], mapping)}
        if isinstance(x, dict) and isinstance(x.get("model"), str)
        else x
        for x in piece["sources"]
    ]
    return {**piece, "sources": sources}
