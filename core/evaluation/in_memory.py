"""A layer swap assembled in memory for evaluation: no checkpoint written, none reloaded.

A layer swap's output is, tensor for tensor, a copy of one expert's tensor except the
transition layers and averaged non-layer tensors. So the experts' tensors are loaded once per
worker process (an LRU of a few checkpoints: a sweep's jobs for one pair follow each other),
copied tensors are taken by reference, and only the averaged ones are computed — by the
engine's own kernels, so every tensor has the bytes the streaming engine would write. The
model is built around those tensors (no weight initialisation, `assign=True`).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.evaluation.errors import EvaluationFailed
from engine.errors import MergeCanceled
from engine.io.checkpoint import Checkpoint
from engine.io.digests import file_sha256
from engine.io.file_access import FileGuard
from engine.kernels.tensor_io import read_elements
from engine.kernels.torch_kernels import Kernels
from engine.methods.layer_swap import LayerSwapRecipe
from engine.plan.model import Plan
from engine.planner import make_plan

MAX_HELD = 4  # checkpoints kept loaded: a pair and its base, plus one
_held: OrderedDict[tuple[Any, ...], dict[str, torch.Tensor]] = OrderedDict()
_lock = threading.Lock()


@dataclass
class Assembled:
    model: Any  # a transformers model, eval mode, on CPU
    tokenizer: Any
    digest: str  # identifies the model: plan digest + every input file's sha256
    plan_digest: str
    referenced: int  # tensors taken from an expert as they are
    computed: int  # tensors computed (transitions, averaged non-layer tensors)
    seconds: float


def assemble(
    recipe: LayerSwapRecipe,
    resolve: Callable[[str], Path],
    *,
    hash_cache: Path | None = None,
    known_digests: dict[Path, str] | None = None,  # Hub LFS files: their sha256 is known
    should_cancel: Callable[[], bool] | None = None,
    guard: FileGuard | None = None,  # confines the files read (engine/io/file_access.py)
) -> Assembled:
    # transformers: heavy; loaded by in-memory evaluations only
    from transformers import AutoTokenizer

    started = time.monotonic()
    plan = make_plan(recipe, resolve=resolve, guard=guard)
    try:
        state, referenced, computed = _assemble_tensors(plan, should_cancel)
        identity = _input_files(plan, hash_cache, known_digests, should_cancel)
        plan_digest = plan.digest()
        digest = hashlib.sha256(
            json.dumps({"plan": plan_digest, "inputs": identity}, sort_keys=True).encode()
        ).hexdigest()
        config_dir = Path(plan.inputs[plan.config_input].path)
        tokenizer_dir = Path(plan.inputs[plan.tokenizer_input].path)
    finally:
        plan.close()
    model = _load_model(config_dir, state)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return Assembled(
        model, tokenizer, digest, plan_digest, referenced, computed, time.monotonic() - started
    )


def _assemble_tensors(
    plan: Plan, should_cancel: Callable[[], bool] | None
) -> tuple[dict[str, torch.Tensor], int, int]:
    """(state dict, tensors referenced, tensors computed): copied tensors taken from the held
    experts, averaged ones computed whole by the engine's kernels."""
    largest = max((_numel(t.shape) for t in plan.tensors), default=1)
    kernels = Kernels(plan, device="cpu", chunk_elements=max(1, largest))
    state: dict[str, torch.Tensor] = {}
    referenced = computed = 0
    for tensor in plan.tensors:
        if should_cancel is not None and should_cancel():
            raise MergeCanceled("canceled while assembling the model")
        if tensor.op == "copy":
            state[tensor.name] = _tensor(plan.checkpoints[tensor.terms[0].source], tensor.name)
            referenced += 1
        elif tensor.op == "linear":
            whole = torch.cat([c.reshape(-1) for c in kernels.chunks(tensor)])
            state[tensor.name] = whole.view(tensor.shape)
            computed += 1
        else:
            raise EvaluationFailed(f"{tensor.name}: a {tensor.op} tensor in a layer swap")
    return state, referenced, computed


def _input_files(
    plan: Plan,
    hash_cache: Path | None,
    known_digests: dict[Path, str] | None,
    should_cancel: Callable[[], bool] | None,
) -> list[dict[str, Any]]:
    """Each input's label and the sha256 of its weight files and config (part of the digest)."""
    return [
        {
            "label": ref.label,
            "files": {
                f.name: (known_digests or {}).get(f) or file_sha256(f, hash_cache, should_cancel)
                for f in sorted({*checkpoint.weight_files, checkpoint.path / "config.json"})
            },
        }
        for ref, checkpoint in zip(plan.inputs, plan.checkpoints, strict=True)
    ]


def _load_model(config_dir: Path, state: dict[str, torch.Tensor]) -> Any:
    """The model of `config_dir` built around `state` (no weight initialisation), eval mode."""
    # transformers: heavy; loaded only when a model is evaluated in memory
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = AutoConfig.from_pretrained(str(config_dir))
    dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
    loaded = model.load_state_dict(state, strict=False, assign=True)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in loaded.missing_keys if k not in tied and not k.endswith("lm_head.weight")]
    if loaded.unexpected_keys or missing:
        raise EvaluationFailed(
            f"the assembled tensors do not fit {type(model).__name__}: missing {missing[:3]}, "
            f"unexpected {loaded.unexpected_keys[:3]}"
        )
    if loaded.missing_keys:
        model.tie_weights()
    model.eval()
    return model


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _tensor(checkpoint: Checkpoint, name: str) -> torch.Tensor:
    """One tensor of `checkpoint`, read once and held while the checkpoint is among the last
    used. Only tensors asked for are read: a Hub input may hold just the shards a plan reads
    (the others are header-only files)."""
    key = (
        str(checkpoint.path.resolve()),
        *(
            (str(f.resolve()), (s := f.stat()).st_size, s.st_mtime_ns, s.st_ino)
            for f in checkpoint.weight_files
        ),
    )
    with _lock:
        tensors = _held.setdefault(key, {})
        _held.move_to_end(key)
        while len(_held) > MAX_HELD:
            _held.popitem(last=False)
        if name in tensors:
            return tensors[name]
    info = checkpoint.tensors[name]
    tensor = read_elements(checkpoint, info, 0, _numel(info.shape)).view(info.shape)
    with _lock:
        return tensors.setdefault(name, tensor)


def held() -> int:
    """How many checkpoints are loaded (for tests and logs)."""
    with _lock:
        return len(_held)
