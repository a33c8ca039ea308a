"""The torch kernels' memory stays what their buffers need, whatever the number of chunks.

Measured in a fresh process (an earlier test's freed heap would hide any growth): how far its
anonymous resident memory rises, read after every chunk, while every tensor of a slerp is
computed, the last chunks held as the writer holds them, against the bytes of the kernels'
kept buffers. With a fresh buffer per chunk it rose by 198 MB over an embedding and a head of
64 one-MB chunks each, where the buffers and held chunks take 7 MB (workspace.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CHUNK = 256 * 1024  # elements: the embedding below spans 64 chunks, a layer weight half a one
HELD = 32  # output chunks alive at once: as many as the writer holds at the default chunk size
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import collections, json, math, sys
from pathlib import Path

from engine.kernels.torch_kernels import Kernels
from engine.planner import make_plan
from engine.recipe import parse_recipe

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

first, second, chunk, held = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
recipe = parse_recipe({"method": "slerp", "models": [first, second], "params": {"t": 0.3}})
plan = make_plan(recipe, resolve=Path, chunk_elements=chunk)
kernels = Kernels(plan, device="cpu", chunk_elements=chunk)
computed = [t for t in plan.tensors if t.op == "slerp"]
outputs = collections.deque(maxlen=held)
smallest = min(computed, key=lambda t: math.prod(t.shape))
outputs.extend(kernels.output_bytes(smallest))  # torch's own allocations on first use
outputs.clear()
before = peak = rss("RssAnon")
for tensor in computed:
    for piece in kernels.output_bytes(tensor):
        outputs.append(piece)
        peak = max(peak, rss("RssAnon"))
print(json.dumps({"grown": peak - before, "workspace": kernels.workspace.nbytes(),
                  "chunks": max(math.prod(t.shape) for t in computed) // chunk}))
"""


@pytest.fixture(scope="module")
def wide_vocabulary(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two BF16 Llamas with an embedding and a head of 64 chunks each."""
    from worker.examples import make_checkpoint

    root = tmp_path_factory.mktemp("wide-vocabulary")
    base = make_checkpoint(root / "base", layers=1, hidden=256, intermediate=512,
                           vocab=64 * CHUNK // 256, heads=4, kv_heads=2)  # fmt: skip
    tuned = make_checkpoint(root / "tuned", base=base, seed=1, non_layer_scale=1.0)
    return base, tuned


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_slerp_memory_does_not_grow_with_chunks(wide_vocabulary: tuple[Path, Path]) -> None:
    first, second = wide_vocabulary
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(first), str(second), str(CHUNK), str(HELD)],
        capture_output=True, text=True, check=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    measured = json.loads(done.stdout)
    assert measured["chunks"] >= 64
    chunk_bytes = CHUNK * torch.float32.itemsize
    held = HELD * (CHUNK // 4) * torch.bfloat16.itemsize  # output chunks are quarter chunks
    # the kept buffers, the held outputs and 16 chunks of slack for the allocator (fresh
    # buffers took one and a half chunks more per chunk)
    assert measured["grown"] <= measured["workspace"] + held + 16 * chunk_bytes, measured
