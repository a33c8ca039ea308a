"""docker-compose.yml and the Dockerfile agree with the code: every LAYERSWAP_* variable they set
is a real setting (and valid), and every command they run is a real command. (No Docker engine
here: the files are checked, not run.) The documentation of every setting is generated from
Settings and checked in tests/docs."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from core.settings import Settings
from layerswap.cli import cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "docker-compose.yml").read_text()))


def test_compose_has_every_service(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {
        "postgres",
        "redis",
        "migrate",
        "api",
        "worker",
        "worker-cpu",
        "flower",
    }
    assert "healthcheck" in services["postgres"] and "healthcheck" in services["redis"]
    assert services["migrate"]["restart"] == "no"
    assert services["api"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert services["worker-cpu"]["profiles"] == ["cpu"] and "deploy" not in services["worker-cpu"]


def test_only_the_gpu_profile_needs_a_gpu(compose: dict[str, Any]) -> None:
    """`--profile cpu up -d` must start on a host without the NVIDIA runtime: every service
    with a device reservation is in the `gpu` profile, which that command leaves out."""
    for name, service in compose["services"].items():
        if "devices" in json.dumps(service.get("deploy", {})):
            assert service.get("profiles") == ["gpu"], name


def test_production_files_name_the_official_images(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["postgres"]["image"] == "postgres:16"
    assert services["redis"]["image"] == "redis:7"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim" in dockerfile
    # The test override's stand-ins and build-only pip settings stay out of both files.
    for text in (dockerfile, (ROOT / "docker-compose.yml").read_text()):
        assert "layerswap-test" not in text and "find-links" not in text and "cert" not in text
    workers = {services[s]["image"] for s in ("worker", "worker-cpu")}
    lean = {services[s]["image"] for s in ("api", "migrate", "flower")}
    assert workers == {"layerswap:latest"} and lean == {"layerswap-api:latest"}
    assert services["api"]["build"]["target"] == "api"
    assert services["worker"]["build"]["target"] == "worker"


def test_every_service_stops_within_seconds(compose: dict[str, Any]) -> None:
    """Every container runs under an init (Docker's tini as PID 1, which passes a stop on):
    a process that is PID 1 itself ignores SIGTERM until it has a handler, so a stop during
    its start-up would wait out the grace period. Workers hand their job back when stopped
    (worker/stopping.py): their grace period is for a step that cannot stop midway, not a
    whole merge."""
    for name, service in compose["services"].items():
        assert service.get("init") is True, name
    for name in ("worker", "worker-cpu"):
        grace = re.fullmatch(r"(\d+)(s|m)", compose["services"][name]["stop_grace_period"])
        assert grace is not None, name
        assert int(grace[1]) * (60 if grace[2] == "m" else 1) <= 120, name


def test_compose_flower_is_local_password_protected_and_given_only_the_broker(
    compose: dict[str, Any],
) -> None:
    flower = compose["services"]["flower"]
    assert flower["ports"] == ["127.0.0.1:${FLOWER_PORT:-5555}:5555"]  # this host's loopback only
    env = flower["environment"]
    assert set(env) == {"FLOWER_BASIC_AUTH"}  # no database URL, no Hub tokens
    # ${VAR:?message}: compose refuses to start flower without a password.
    assert re.fullmatch(r"\$\{FLOWER_BASIC_AUTH:\?[^}]+\}", env["FLOWER_BASIC_AUTH"])
    assert "volumes" not in flower  # not the data volume either
    text = json.dumps(flower)
    for secret in ("LAYERSWAP_", "POSTGRES", "HUB_CREDENTIALS", "postgresql"):
        assert secret not in text, secret
    command = flower["command"]
    assert command[:2] == ["celery", "--broker=redis://redis:6379/0"] and "flower" in command
    assert not any("basic_auth=" in part for part in command)  # not in `ps` or the file


def test_compose_settings_are_real_and_valid(compose: dict[str, Any]) -> None:
    fields = set(Settings.model_fields)
    for name, service in compose["services"].items():
        env = service.get("environment") or {}
        ours = {k: str(v) for k, v in env.items() if k.startswith("LAYERSWAP_")}
        for key in ours:
            assert key.removeprefix("LAYERSWAP_").lower() in fields, (name, key)
        if ours:
            with pytest.MonkeyPatch.context() as patch:
                for key, value in ours.items():
                    # ${VAR:-default} as compose expands it with VAR unset
                    patch.setenv(key, re.sub(r"\$\{\w+:-(.*?)\}(?!\})", r"\1", value))
                settings = Settings()  # raises if any value is invalid
            assert settings.executor == "celery", name


def test_compose_commands_exist(compose: dict[str, Any]) -> None:
    runner = CliRunner()
    for name, service in compose["services"].items():
        command = service.get("command")
        if isinstance(command, list) and command[0] == "layerswap":
            result = runner.invoke(cli, [*command[1:], "--help"])
            assert result.exit_code == 0, (name, result.output)


def test_dockerfile_copies_what_exists() -> None:
    text = (ROOT / "Dockerfile").read_text()
    for source in re.findall(r"^COPY (?!--from)(\S+(?: \S+)*) \S+$", text, flags=re.MULTILINE):
        for path in source.split():
            assert (ROOT / path).exists(), path
    assert '"torch==2.13.0"' in text  # the pinned torch, installed first


def test_the_test_override_sets_real_settings_and_only_swaps_images() -> None:
    """deploy/compose.test.yml (tests/docker): its LAYERSWAP_* variables are real, valid
    settings, and it names no service the production file lacks."""
    override = yaml.safe_load((ROOT / "deploy" / "compose.test.yml").read_text())
    production = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert set(override["services"]) <= set(production["services"])
    fields = set(Settings.model_fields)
    for name, service in override["services"].items():
        env = {k: str(v) for k, v in (service.get("environment") or {}).items()}
        assert all(k.removeprefix("LAYERSWAP_").lower() in fields for k in env), name
        with pytest.MonkeyPatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            Settings(executor="celery")  # raises if any value is invalid
