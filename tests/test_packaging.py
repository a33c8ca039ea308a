"""The built wheel, installed as a user would: built (sdist, then the wheel from the sdist) from a
copy of the sources, installed with its client's wheel into new virtualenvs outside the
checkout, and run there with HOME, the working directory and TMPDIR empty folders of their own.

The base install runs the engine's commands without a web stack; the `server` extra runs the
service (embedded default, a layer swap through the API) and migrates PostgreSQL. Afterwards
everything written is inside the data directory each was given. Installs resolve every
dependency for real (no path into the development virtualenv), from uv's cache when
scripts/setup.sh has filled it, at the versions in constraints.txt."""

from __future__ import annotations

import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import healthy, stop, wait_for
from tests.service.conftest import layer_swap, postgres_database

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "core", "service", "worker", "layerswap")
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
# Package data the service opens by path at run time.
PACKAGE_DATA = (
    "core/db/migrations/env.py",
    "core/db/migrations/script.py.mako",
    "core/db/migrations/versions/0001_initial.py",
    "core/evaluation/tasks/mgsm_local_direct_template",
    "core/evaluation/tasks/mgsm_local_direct_sw.yaml",
    "core/evaluation/lm_eval_tasks.txt.gz",
)


def uv() -> str:
    from uv import find_uv_bin  # the dev extra's pinned uv

    return str(find_uv_bin())


def uv_env_module() -> dict[str, Any]:
    return runpy.run_path(str(ROOT / "scripts" / "uv_env.py"))


def uv_environment() -> dict[str, str]:
    """The environment scripts/setup.sh gives uv: the machine's pip configuration translated."""
    translate = uv_env_module()
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                             capture_output=True, text=True, check=False).stdout  # fmt: skip
    wanted = translate["uv_environment"](translate["parse_pip_config"](listing), os.environ)
    return {**os.environ, **wanted}


@dataclass(frozen=True)
class Dist:
    wheel: Path
    sdist: Path
    client_wheel: Path


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    """sdist and wheel (built from the sdist) of a copy of the sources, and the client's wheel."""
    source = tmp_path_factory.mktemp("source")
    junk = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in (*PACKAGES, "client"):
        shutil.copytree(ROOT / name, source / name, ignore=junk)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("dist")
    for target in (source, source / "client"):
        command = [uv(), "build", "-q", "--out-dir", str(out), str(target)]
        built = subprocess.run(command, env=uv_environment(), capture_output=True, text=True,
                               timeout=300)  # fmt: skip
        assert built.returncode == 0, built.stderr
    return Dist(
        wheel=out / f"layerswap-{VERSION}-py3-none-any.whl",
        sdist=out / f"layerswap-{VERSION}.tar.gz",
        client_wheel=next(out.glob("layerswap_client-*.whl")),
    )


@dataclass(frozen=True)
class Installed:
    """A virtualenv with the wheel, and the empty folders its commands run with."""

    venv: Path
    data: Path
    home: Path
    work: Path
    tmp: Path

    def env(self, **extra: str) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("LAYERSWAP_", "PYTHON", "VIRTUAL_ENV", "XDG_", "HF_HOME"))
        }
        env.update(HOME=str(self.home), TMPDIR=str(self.tmp), VIRTUAL_ENV=str(self.venv),
                   PATH=f"{self.venv / 'bin'}{os.pathsep}{env['PATH']}", **extra)  # fmt: skip
        return env

    def run(self, *args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.venv / "bin" / "layerswap"), *args], env=self.env(**env),
                              cwd=self.work, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)  # fmt: skip

    def written_elsewhere(self) -> list[str]:
        """Whatever appeared in HOME, the working directory or TMPDIR; but for the empty
        TMPDIR/torchinductor_<user> that importing transformers' model classes makes torch
        create (torch._inductor.config, at import)."""
        found = (p for root in (self.home, self.work, self.tmp) for p in root.rglob("*"))
        return sorted(str(p) for p in found if not _torch_import_leftover(p, self.tmp))

    def distributions(self) -> set[str]:
        python = str(self.venv / "bin" / "python")
        listed = subprocess.run([uv(), "pip", "list", "--python", python, "--format=freeze"],
                                capture_output=True, text=True, check=True)  # fmt: skip
        return {line.split("==")[0].lower() for line in listed.stdout.split()}


def _torch_import_leftover(path: Path, tmp: Path) -> bool:
    return path.parent == tmp and path.name.startswith("torchinductor_") and not any(path.iterdir())


def install(base: Path, dist: Dist, extra: str | None) -> Installed:
    folders = {name: base / name for name in ("venv", "data", "home", "work", "tmp")}
    for name in ("data", "home", "work", "tmp"):
        folders[name].mkdir()
    created = subprocess.run([uv(), "venv", "-q", "--python", sys.executable, str(folders["venv"])],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert created.returncode == 0, created.stderr
    project = f"layerswap[{extra}] @ {dist.wheel.as_uri()}" if extra else str(dist.wheel)
    # torch as here (the CPU build on a CPU host), the rest at the tested versions.
    wanted = [f"torch=={version('torch')}", str(dist.client_wheel), project]
    common = ["pip", "install", "-q", "--python", str(folders["venv"] / "bin" / "python"),
              "-c", str(ROOT / "constraints.txt"), *wanted]  # fmt: skip
    for offline in (["--offline"], []):  # uv's cache first; the indexes when it lacks something
        done = subprocess.run([uv(), *common, *offline], env=uv_environment(),
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        if done.returncode == 0:
            break
    assert done.returncode == 0, done.stderr
    return Installed(**folders)


@pytest.fixture(scope="module")
def engine_only(dist: Dist, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    return install(tmp_path_factory.mktemp("engine-only"), dist, extra=None)


@pytest.fixture(scope="module")
def server(dist: Dist, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    return install(tmp_path_factory.mktemp("server"), dist, extra="server")


def test_pip_configuration_becomes_uv_variables() -> None:
    translate = uv_env_module()
    listing = "\n".join([
        ":env:.find-links='/opt/wheels'",
        "global.find-links='/elsewhere /also'",  # the PIP_* variable wins, as in pip
        "global.extra-index-url='file:///a/simple file:///b/simple'",
        "install.index-url='https://mirror.example/simple'",
        "global.index-url='https://ignored.example/simple'",  # [install] wins over [global]
        "global.cert='/etc/ca.crt'",
        "global.constraint='/etc/pip/constraints.txt'",
        "global.trusted-host='mirror.example other.example'",
        "global.timeout='60'",
        "download.find-links='/for/pip/download/only'",
        "not a setting",
    ])  # fmt: skip
    options = translate["parse_pip_config"](listing)
    assert options["find-links"] == "/opt/wheels"
    assert options["index-url"] == "https://mirror.example/simple"
    given = {"SSL_CERT_FILE": "/mine.pem", "UV_HTTP_TIMEOUT": "5"}  # already set: left alone
    assert translate["uv_environment"](options, given) == {
        "UV_FIND_LINKS": "/opt/wheels",
        "UV_DEFAULT_INDEX": "https://mirror.example/simple",
        "UV_INDEX": "file:///a/simple file:///b/simple",
        "UV_INDEX_STRATEGY": "unsafe-best-match",
        "UV_CONSTRAINT": "/etc/pip/constraints.txt",
        "UV_INSECURE_HOST": "mirror.example other.example",
    }
    several = translate["uv_environment"]({"find-links": "/a /b"}, {})
    assert several == {"UV_FIND_LINKS": "/a,/b"}  # uv's list of find-links is comma-separated


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_the_wheel_and_the_sdist_carry_the_package_data(dist: Dist, kind: str) -> None:
    if kind == "wheel":
        with zipfile.ZipFile(dist.wheel) as wheel:
            names = set(wheel.namelist())
    else:
        with tarfile.open(dist.sdist) as sdist:
            names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    missing = [path for path in PACKAGE_DATA if path not in names]
    assert not missing, f"{kind} lacks {missing}"
    migrations = {n for n in names if n.startswith("core/db/migrations/versions/")}
    shipped = {f"core/db/migrations/versions/{p.name}"
               for p in (ROOT / "core/db/migrations/versions").glob("*.py")}  # fmt: skip
    assert shipped <= migrations


@pytest.fixture(scope="module")
def examples(engine_only: Installed) -> Path:
    """`layerswap examples` of the base install, in its data directory."""
    examples = engine_only.data / "examples"
    made = engine_only.run("examples", str(examples))
    assert made.returncode == 0, made.stderr
    return examples


def test_the_engine_commands_run_from_the_base_install_without_a_web_stack(
    engine_only: Installed, examples: Path
) -> None:
    installed = engine_only.distributions()
    assert {"layerswap", "layerswap-client", "torch"} <= installed
    assert not {"fastapi", "uvicorn", "sqlalchemy", "celery", "lm-eval"} & installed

    shown = engine_only.run("--version")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == f"layerswap, version {VERSION}"

    assert (examples / "math" / "model.safetensors").is_file()
    out = engine_only.data / "merged"
    merged = engine_only.run("merge", str(examples / "layer_swap.yaml"), "--out", str(out),
                             LAYERSWAP_CACHE_DIR=str(engine_only.data / "cache"))  # fmt: skip
    assert merged.returncode == 0, merged.stderr
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()

    # The service's commands say which extra they need, in one line.
    for command, extra in (("serve", "server"), ("worker", "worker"), ("db", "worker")):
        refused = engine_only.run(command, "--help")
        assert refused.returncode == 2, refused.stdout
        assert f"needs the '{extra}' extra" in refused.stderr, refused.stderr
        assert f"pip install 'layerswap[{extra}]'" in refused.stderr
        assert "Traceback" not in refused.stderr

    assert engine_only.written_elsewhere() == []


def test_the_code_run_is_the_wheels(server: Installed) -> None:
    script = "import sys\nfor name in sys.argv[1:]: print(__import__(name).__file__)"
    found = subprocess.run(
        [str(server.venv / "bin" / "python"), "-c", script, *PACKAGES, "layerswap_client"],
        env=server.env(), cwd=server.work, capture_output=True, text=True, check=True,
    )  # fmt: skip
    files = [Path(line) for line in found.stdout.split()]
    assert len(files) == len(PACKAGES) + 1
    assert all(f.is_relative_to(server.venv) for f in files), files


def test_the_installed_service_migrates_postgresql(server: Installed) -> None:
    with postgres_database() as url:
        given = {"LAYERSWAP_DATABASE_URL": url, "LAYERSWAP_DATA_DIR": str(server.data)}
        first = server.run("db", "upgrade", **given)
        assert first.returncode == 0, first.stderr
        assert "database schema migrated from <none> to" in first.stdout
        again = server.run("db", "upgrade", **given)
        assert again.returncode == 0, again.stderr
        assert "database schema is up to date" in again.stdout
    assert server.written_elsewhere() == []


@pytest.fixture
def serving(server: Installed, examples: Path) -> Iterator[tuple[Installed, str]]:
    """`layerswap serve` on its embedded default, with the data directory as its only setting."""
    for name in ("math", "swh"):  # the sources layer_swap() names, under the allowed root
        shutil.copytree(examples / name, server.data / "checkpoints" / name)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = (server.venv.parent / "serve.log").open("w")
    process = subprocess.Popen(
        [str(server.venv / "bin" / "layerswap"), "serve", "--port", str(port)],
        env=server.env(LAYERSWAP_DATA_DIR=str(server.data)), cwd=server.work,
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: process.poll() is not None or healthy(url), "the API to answer", 120)
        assert process.poll() is None, (server.venv.parent / "serve.log").read_text()
        yield server, url
    finally:
        stop(process, signal.SIGINT)
        log.close()


def test_the_installed_service_serves_a_layer_swap(serving: tuple[Installed, str]) -> None:
    server, url = serving
    with httpx.Client(base_url=url, timeout=30) as client:
        created = client.post("/v1/merges", json=layer_swap())
        assert created.status_code == 202, created.text
        job_id = created.json()["id"]

        def ended() -> dict[str, Any] | None:
            job: dict[str, Any] = client.get(f"/v1/merges/{job_id}").json()
            return job if job["status"] in {"succeeded", "failed", "canceled"} else None

        job = wait_for(ended, "the merge to end", 180, interval=0.2)
    assert job["status"] == "succeeded", job
    artifact = httpx.get(f"{url}/v1/artifacts/{job['output']['artifact_id']}", timeout=30).json()
    location = Path(artifact["location"])
    assert location.is_relative_to(server.data) and (location / "model.safetensors").is_file()
    assert server.written_elsewhere() == []
