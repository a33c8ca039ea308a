"""Session-wide tiny real checkpoints (built once) and a helper that runs the engine on them.

The Hugging Face client reads its environment once, at import: before anything imports it,
HF_ENDPOINT is pointed at a port reserved here for the test suite's own Hub-compatible server
(tests/hub/server.py, started by the `fake_hub` fixture), Xet is off, and its cache is private.
Nothing in the suite can reach the real Hub.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any


def _reserve_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


HUB_PORT = _reserve_port()
for _name in [n for n in os.environ if n.startswith(("HF_", "HUGGINGFACE_"))]:
    del os.environ[_name]  # a developer's token or endpoint must not leak into the tests
os.environ.update(
    HF_ENDPOINT=f"http://127.0.0.1:{HUB_PORT}",
    HF_HUB_DISABLE_XET="1",
    HF_HOME=tempfile.mkdtemp(prefix="layerswap-tests-hf-"),
    HF_HUB_DISABLE_TELEMETRY="1",
    HF_HUB_DISABLE_PROGRESS_BARS="1",
    HF_HUB_DISABLE_UPDATE_CHECK="1",
)
import pytest  # noqa: E402  (after the environment above)
import torch  # noqa: E402
from xdist.scheduler import LoadScopeScheduling  # noqa: E402

from tests.helpers import built_once, stringify  # noqa: E402

if TYPE_CHECKING:
    from worker.examples import Arch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# Minutes long (a deployment built, then driven step by step; the console; the fuzzing):
# collected first, so that under `pytest -n N --dist loadfile` (scripts/test.sh) workers start
# on them while the others share out the rest, rather than end the run on one of them.
LONGEST = ("tests/docker/", "tests/console/", "tests/service/test_fuzz.py")
# Modules that share a session fixture made at great cost run on one worker: the console's
# seeded service runs evaluations, a sweep and an analysis, a minute or more each time; the
# MLflow modules' tracking server starts in half a minute.
SHARED = ("tests/console/", "tests/integrations/test_mlflow")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not item.nodeid.startswith(LONGEST))  # stable: order kept


class ModuleScheduling(LoadScopeScheduling):  # type: ignore[misc]  # xdist is untyped
    """xdist's loadfile, the modules under each of SHARED's prefixes handed out as one file."""

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return next((folder for folder in SHARED if module.startswith(folder)), module)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> LoadScopeScheduling | None:
    """`--dist loadfile` (scripts/test.sh) by ModuleScheduling; other modes, xdist's own."""
    return ModuleScheduling(config, log) if config.getvalue("dist") == "loadfile" else None


LAYERS = 6
# Per-layer noise (relative to each tensor's std): the task expert changes the middle most,
# the language experts the ends, so magnitudes differ between roles.
TASK_SCALE = (0.01, 0.06, 0.08, 0.08, 0.06, 0.01)
LANGUAGE_SCALE = (0.08, 0.02, 0.01, 0.01, 0.02, 0.08)


@dataclass(frozen=True)
class Family:
    """One base and experts fine-tuned from it (all real Hugging Face checkpoints)."""

    base: Path
    task: Path
    language: Path
    task2: Path  # more experts, for multi-expert souping
    language2: Path
    language3: Path

    @property
    def num_layers(self) -> int:
        import json

        return int(json.loads((self.base / "config.json").read_text())["num_hidden_layers"])


def _family(
    root: Path,
    *,
    arch: Arch = "llama",
    layers: int = LAYERS,
    dtype: torch.dtype = torch.bfloat16,
    tie_embeddings: bool = False,
    seed: int = 0,
) -> Family:
    from worker.examples import make_checkpoint

    def scale(values: tuple[float, ...]) -> list[float]:
        return [values[round(i * (len(values) - 1) / max(layers - 1, 1))] for i in range(layers)]

    base = make_checkpoint(
        root / "base",
        arch=arch,
        layers=layers,
        dtype=dtype,
        tie_embeddings=tie_embeddings,
        seed=seed,
    )

    def expert(name: str, seed_: int, layer: tuple[float, ...], non_layer: float) -> Path:
        return make_checkpoint(
            root / name,
            base=base,
            dtype=dtype,
            seed=seed_,
            layer_scale=scale(layer),
            non_layer_scale=non_layer,
        )

    task = expert("task", seed + 1, TASK_SCALE, 0.01)
    language = expert("language", seed + 2, LANGUAGE_SCALE, 0.03)
    return Family(
        base,
        task,
        language,
        task2=expert("task2", seed + 3, TASK_SCALE, 0.02),
        language2=expert("language2", seed + 4, LANGUAGE_SCALE, 0.02),
        language3=expert("language3", seed + 5, LANGUAGE_SCALE, 0.05),
    )


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Family:
    """bf16 Llama, 6 layers: base, two task experts, three language experts."""
    return _family(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def llama32(tmp_path_factory: pytest.TempPathFactory) -> Family:
    """float32 Llama, 6 layers (for tight numeric checks of non-exact arithmetic)."""
    return _family(tmp_path_factory.mktemp("llama32"), dtype=torch.float32, seed=10)


@pytest.fixture(scope="session")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Family:
    """bf16 Qwen2, 4 layers (q/k/v biases: 1-D tensors inside layers)."""
    return _family(tmp_path_factory.mktemp("qwen2"), arch="qwen2", layers=4, seed=20)


@pytest.fixture(scope="session")
def gpt2_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two unrelated float32 GPT-2s (`transformer.h`, `n_layer`), 4 layers, tied head."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from worker.examples import make_tokenizer

    root = tmp_path_factory.mktemp("gpt2")
    config = GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=4, n_head=4)
    paths = []
    for name, seed in (("a", 40), ("b", 41)):
        with torch.random.fork_rng(devices=[]):  # the global RNG is left as it was
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
        model.save_pretrained(str(root / name))
        make_tokenizer(root / name)
        paths.append(root / name)
    return paths[0], paths[1]


@pytest.fixture(scope="session")
def gemma_tied(tmp_path_factory: pytest.TempPathFactory) -> Family:
    """bf16 Gemma, 4 layers, tied embeddings: no lm_head.weight in the files."""
    return _family(
        tmp_path_factory.mktemp("gemma"), arch="gemma", layers=4, tie_embeddings=True, seed=30
    )


@dataclass(frozen=True)
class Sharded:
    """Sharded copies (same weights) of the bf16 Llama family's base and task expert."""

    base: Path
    task: Path


@pytest.fixture(scope="session")
def sharded(llama: Family, tmp_path_factory: pytest.TempPathFactory) -> Sharded:
    from worker.examples import make_checkpoint

    root = tmp_path_factory.mktemp("sharded")
    zero = [0.0] * LAYERS

    def copy(source: Path, name: str) -> Path:
        return make_checkpoint(root / name, base=source, layer_scale=zero, shard_size="40KB")

    return Sharded(base=copy(llama.base, "base"), task=copy(llama.task, "task"))


# -- running the engine -----------------------------------------------------------------------
Merge = Callable[..., Any]


@pytest.fixture
def run_merge(tmp_path: Path) -> Merge:
    """run_merge(recipe_dict, out=None, **MergeOptions) -> MergeResult (sources are paths)."""
    from engine.merge import MergeOptions, merge
    from engine.recipe import parse_recipe

    counter = iter(range(1_000_000))

    def run(
        recipe: dict[str, Any],
        out: Path | None = None,
        *,
        should_cancel: Callable[[], bool] | None = None,
        **options: Any,
    ) -> Any:
        out = out or tmp_path / f"out{next(counter)}"
        options.setdefault("durable", False)
        return merge(
            parse_recipe(stringify(recipe)),
            out,
            resolve=Path,
            options=MergeOptions(**options),
            should_cancel=should_cancel,
        )

    return run


@pytest.fixture(scope="session")
def examples(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """base/, math/ and swh/ (a 6-layer Llama family) plus recipe files; made once per run
    (pytest-xdist's workers share them)."""
    from worker.examples import make_examples

    return built_once(tmp_path_factory, "examples", make_examples)


@pytest.fixture(scope="session")
def fake_hub() -> Any:
    """The suite's Hub-compatible server, on the port HF_ENDPOINT names."""
    from tests.hub.server import FakeHub

    hub = FakeHub(port=HUB_PORT).start()
    yield hub
    hub.close()


@pytest.fixture
def hub(fake_hub: Any) -> Any:
    """The Hub server, emptied for this test (no repos, tokens, faults or logged requests)."""
    fake_hub.reset()
    return fake_hub


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Any:
    """A factory of real, tiny tmpfs mounts (root only, as CI runs): `small_filesystem(bytes)`
    returns an empty directory on a filesystem of that size, so writes past it fail with the
    kernel's own ENOSPC. Unmounted at the end of the test."""
    import subprocess

    mounted: list[Path] = []

    def make(size_bytes: int) -> Path:
        where = tmp_path / f"small-fs-{len(mounted)}"
        where.mkdir()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(where)], check=True
        )
        mounted.append(where)
        return where

    yield make
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], check=False)
