"""The model card (README.md) of a merge output, rendered from its manifest alone.

Front matter the Hub understands (base_model with base_model_relation: merge, tags,
library_name, model-index when evaluations exist); a body stating the method, its parameters,
the inputs with their commit shas, and where every layer came from.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from engine.methods import METHODS


def _title(method: str) -> str:
    return METHODS[method].title if method in METHODS else method


def _tags(method: str) -> tuple[str, ...]:
    return METHODS[method].tags if method in METHODS else ()


def hub_repo(source: str) -> tuple[str, str | None] | None:
    """('org/name', revision) for an hf:// source, else None."""
    if not source.startswith("hf://"):
        return None
    repo, _, revision = source.removeprefix("hf://").partition("@")
    return repo, revision or None


def render_card(
    manifest: dict[str, Any],
    *,
    name: str | None = None,
    evaluations: list[dict[str, Any]] | None = None,
) -> str:
    recipe = manifest["recipe"]
    method = str(recipe["method"])
    lines = _front_matter(manifest, method, name, evaluations)
    lines += [f"# {name or 'Merged model'}", ""]
    lines += [
        f"Made with Layerswap by {_title(method)}, with no training."
        " `layerswap.json` beside this card records the full recipe, every"
        " input file's sha256 and every output file's sha256.",
        "",
        "## Method",
        "",
        f"`{method}` with parameters:",
        "",
        "```json",
        json.dumps(recipe.get("params", {}), indent=2, sort_keys=True),
        "```",
        "",
    ]
    if manifest.get("mergekit_config"):
        lines += ["Translated from this mergekit config:", "", "```yaml"]
        lines += [yaml.safe_dump(manifest["mergekit_config"], sort_keys=False).rstrip(), "```", ""]
    lines += _inputs_table(manifest["inputs"])
    lines += ["", "## Where each layer comes from", "", "| layer | origin | made from |"]
    lines.append("|---|---|---|")
    for row in manifest["layers"]:
        lines.append(f"| {row['layer']} | {row['origin']} | {row['made_from']} |")
    if evaluations:
        lines += ["", "## Evaluation", "", "| task | metric | value |", "|---|---|---|"]
        for e in evaluations:
            lines.append(f"| {e['task']} | {e['metric']} | {e['value']} |")
    if manifest.get("warnings"):
        lines += ["", "## Warnings", ""] + [f"- {w}" for w in manifest["warnings"]]
    return "\n".join(lines) + "\n"


def _front_matter(
    manifest: dict[str, Any],
    method: str,
    name: str | None,
    evaluations: list[dict[str, Any]] | None,
) -> list[str]:
    """The YAML front matter the Hub reads (base models, tags, model-index), then a blank line."""
    repos = list(dict.fromkeys(r[0] for i in manifest["inputs"] if (r := hub_repo(i["source"]))))
    front: dict[str, Any] = {}
    if repos:
        front["base_model"] = repos
        front["base_model_relation"] = "merge"
    front["library_name"] = "transformers"
    front["tags"] = ["merge", "layerswap", *_tags(method)]
    if evaluations:
        front["model-index"] = [{"name": name or "merged-model", "results": _results(evaluations)}]
    return ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", ""]


def _inputs_table(inputs: list[dict[str, Any]]) -> list[str]:
    """The Inputs section: each input's role, label, and its Hub repository and revision."""
    lines = ["## Inputs", "", "| role | input | source | revision |", "|---|---|---|---|"]
    for entry in inputs:
        found = hub_repo(entry["source"])
        if found:
            repo, revision = found
            source = f"[{repo}](https://huggingface.co/{repo})"
            rev = f"`{revision}`" if revision else "—"
        else:
            source, rev = f"`{entry['source']}`", "local"
        lines.append(f"| {entry['role']} | {entry['label']} | {source} | {rev} |")
    return lines


def _results(evaluations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "task": {"type": "text-generation", "name": e["task"]},
            "dataset": {"name": e.get("dataset", e["task"]), "type": e.get("dataset", e["task"])},
            "metrics": [{"type": e["metric"], "value": e["value"]}],
        }
        for e in evaluations
    ]
