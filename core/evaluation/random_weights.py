"""Checkpoints that say they have random weights: `layerswap examples` marks its experts so in
config.json (a merge copies the mark with the config), so that wherever their scores are shown
a reader learns why they are 0."""

from __future__ import annotations

import json
from pathlib import Path

RANDOM_WEIGHTS_KEY = "layerswap_example"
RANDOM_WEIGHTS_VALUE = "random"
RANDOM_WEIGHTS_NOTE = (
    "note: the example experts (and merges of them) have random weights, so scores of 0 are "
    "expected"
)


def has_random_weights(model_dir: Path) -> bool:
    """Whether config.json in `model_dir` carries the examples' mark (False if it cannot be
    read: the evaluation itself says why)."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get(RANDOM_WEIGHTS_KEY) == RANDOM_WEIGHTS_VALUE


def mark_random_weights(model_dir: Path) -> None:
    """Add the mark to config.json in `model_dir`, in place."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config[RANDOM_WEIGHTS_KEY] = RANDOM_WEIGHTS_VALUE
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
