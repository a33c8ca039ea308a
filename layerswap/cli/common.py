"""What several commands share: one-line errors, settings, the Hub token, the cache, progress."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import click
from pydantic import ValidationError
from tqdm import tqdm

from core.hub.credentials import token_for
from core.settings import Settings
from engine.errors import DeviceError, EngineError, Remedy
from engine.merge import resolve_device

# The command line's words for what to do about an engine error (its `remedy`); the API has its own.
CLI_ADVICE: dict[Remedy, str] = {
    "free_space": "free space on that disk (or remove output directories you no longer need) "
    "and run again",
    "overwrite": "pass --overwrite to replace it",
}


def fail(code: str, message: str, status: int) -> NoReturn:
    """One line on stderr, `layerswap: error [code]: message`, and exit `status`."""
    click.echo(f"layerswap: error [{code}]: {message}", err=True)
    sys.exit(status)


@contextmanager
def engine_errors() -> Iterator[None]:
    """Every expected failure ends as one line on stderr and a non-zero exit code."""
    try:
        yield
    except EngineError as e:
        fail(e.code, e.advised(CLI_ADVICE), 1)
    except KeyboardInterrupt:
        click.echo("layerswap: interrupted; no output was left behind", err=True)
        sys.exit(130)


def load_settings(**overrides: Any) -> Settings:
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as e:
        problem = e.errors()[0]
        where = ".".join(str(p) for p in problem["loc"]) or "settings"
        message = str(problem["msg"]).removeprefix("Value error, ")
        fail("invalid_settings", f"{where}: {message}", 2)


def check_merge_device(settings: Settings) -> None:
    """LAYERSWAP_MERGE_DEVICE=cuda on a host without a GPU stops the process at start, not
    every job later."""
    try:
        resolve_device(settings.merge_device)
    except DeviceError as e:
        fail("invalid_settings", f"merge_device: {e.message}", 2)


def hub_token(credential: str | None) -> str | None:
    """The CLI's Hub token: the named credential of the default tenant (LAYERSWAP_DEFAULT_TENANT,
    "default") in LAYERSWAP_HUB_CREDENTIALS, else HF_TOKEN (the user's own), else none (public
    repositories only)."""
    if credential is None:
        return os.environ.get("HF_TOKEN") or None
    settings = load_settings()
    return token_for(
        credential, tenant=settings.default_tenant, credentials=settings.hub_credentials
    )


def cache_dir() -> Path:
    """The CLI's cache: input sha256s and Hub downloads (LAYERSWAP_CACHE_DIR, else XDG)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("LAYERSWAP_CACHE_DIR") or Path(root) / "layerswap")


@contextmanager
def progress_bar(*, disabled: bool) -> Iterator[Callable[[Any], None]]:
    # Created on the first report, so a merge that fails while planning prints only its error.
    bar: tqdm[Any] | None = None

    def update(p: Any) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(
                total=p.bytes_total, unit="B", unit_scale=True, disable=disabled, desc="merging"
            )
        bar.total = p.bytes_total
        bar.set_postfix_str(f"{p.tensors_done}/{p.tensors_total} tensors", refresh=False)
        bar.update(p.bytes_done - bar.n)

    try:
        yield update
    finally:
        if bar is not None:
            bar.close()
