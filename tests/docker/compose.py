"""Driving docker-compose.yml from a test: the same commands the README gives, with the
test-only override (deploy/compose.test.yml) that swaps in locally built stand-in images."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
FILES = [ROOT / "docker-compose.yml", ROOT / "deploy" / "compose.test.yml"]


def docker_available() -> str | None:
    """Why the Docker tests cannot run here, or None when they can."""
    if shutil.which("docker") is None:
        return "no docker command (scripts/docker.sh installs Debian's docker.io)"
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        return "no Docker engine answers (scripts/docker.sh starts dockerd)"
    if compose_command() is None:
        return "neither `docker compose` nor `docker-compose` is installed"
    return None


def compose_command() -> list[str] | None:
    """`docker compose` (v2) where it exists, else Debian's `docker-compose` (1.29)."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Compose:
    """One deployment: a compose project with its own ports and secrets."""

    project: str
    env: dict[str, str]
    command: list[str] = field(default_factory=lambda: compose_command() or [])
    timings: dict[str, float] = field(default_factory=dict)  # seconds, printed at the end
    up_started: float = 0.0  # time.monotonic() at the first `up -d`

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.env['API_PORT']}"

    @property
    def flower_url(self) -> str:
        return f"http://127.0.0.1:{self.env['FLOWER_PORT']}"

    def run(
        self, *args: str, timeout: float = 900, check: bool = True, stdin: bytes | None = None
    ) -> str:
        """`docker compose -f docker-compose.yml -f deploy/compose.test.yml --profile cpu ARGS`;
        its stdout. A failure shows its output."""
        files = [part for f in FILES for part in ("-f", str(f))]
        cmd = [*self.command, "-p", self.project, *files, "--profile", "cpu", *args]
        done = subprocess.run(
            cmd, cwd=ROOT, env={**os.environ, **self.env}, capture_output=True, timeout=timeout,
            input=stdin,
        )  # fmt: skip
        out, err = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed:\n{out}\n{err}")
        return out

    def exec(self, service: str, *cmd: str) -> str:
        return self.run("exec", "-T", service, *cmd).strip()

    def copy_in(self, service: str, source: Path, target: str) -> None:
        """Copy a host directory's contents into the service's container (a volume there) as
        the container's user, as the README shows: a tar stream through `exec`."""
        archive = subprocess.run(["tar", "-C", str(source), "-c", "."], capture_output=True,
                                 check=True).stdout  # fmt: skip
        self.exec(service, "mkdir", "-p", target)
        self.run("exec", "-T", service, "tar", "-x", "-C", target, stdin=archive)

    def container(self, service: str) -> str:
        """The id of the service's (first) container, running or not."""
        ids = self.run("ps", "-a", "-q", service).split()
        assert ids, f"no container for {service}"
        return ids[0]

    def logs(self, service: str) -> str:
        return self.run("logs", "--no-color", service)

    def running(self) -> list[str]:
        """Names of this project's running containers, by Docker's own account."""
        label = f"label=com.docker.compose.project={self.project}"
        out = docker("ps", "-q", "--filter", label)
        return out.split()

    def wait_ready(self, timeout: float = 300) -> dict[str, Any]:
        """Poll /readyz through the published port until it answers 200."""
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            try:
                response = httpx.get(f"{self.api_url}/readyz", timeout=5)
                if response.status_code == 200:
                    return dict(response.json())
                last = response.text
            except httpx.HTTPError as e:
                last = e
            time.sleep(1)
        raise AssertionError(f"the API was not ready within {timeout:.0f} s: {last}\n"
                             + self.run("ps", check=False) + self.logs("api"))  # fmt: skip


def docker(*args: str, timeout: float = 600) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def cpu_limit(container: str, cpus: float | None) -> None:
    """Cap a container's CPU share (`None`: no cap). The tests that stop a worker mid-merge cap
    it first, so that the merge lasts long enough on any machine for the stop to land mid-way;
    uncapped, it can end between the check that it runs and the stop."""
    quota = -1 if cpus is None else int(cpus * 100_000)
    docker("update", "--cpu-period", "100000", "--cpu-quota", str(quota), container)


def image_config(image: str) -> dict[str, Any]:
    return dict(json.loads(docker("image", "inspect", image))[0]["Config"])


def wait_for(condition: Any, what: str, timeout: float = 300, every: float = 0.5) -> Any:
    """Poll `condition()` until it returns something truthy (returned), or fail naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
