"""The `layerswap` command line: merge, evaluate, analyze, examples (the engine alone); serve,
worker, keys, db (the service); submit, status, wait, lineage (a remote service, through the
client).

The base install carries the engine's commands and the remote ones; `serve` needs the `server`
extra, `worker`, `db` and `keys` the `worker` extra, and says so when it is missing.

A command's module is imported when that command runs (click's lazily loaded subcommands), so
`layerswap status` loads the client only and `layerswap merge` never loads the web framework or
Celery. Modules that import torch (the delta analysis, the example checkpoints) are imported
inside their commands besides, so the other commands of their module never load it.
"""

from __future__ import annotations

import gc
import importlib
import os
import signal
import sys

import click

# command name -> ("module:attribute" of a click command or group, its line in `layerswap --help`)
COMMANDS = {
    "merge": ("layerswap.cli.merge:merge", "Merge the checkpoints a recipe names."),
    "evaluate": ("layerswap.cli.evaluate:evaluate", "Evaluate a checkpoint with lm-eval."),
    "analyze": ("layerswap.cli.analyze:analyze", "Delta analysis of experts against their base."),
    "examples": ("layerswap.cli.analyze:examples", "Create example checkpoints and recipes."),
    "serve": ("layerswap.cli.serve:serve", "Run the HTTP API."),
    "worker": ("layerswap.cli.celery_worker:worker", "Run a Celery worker."),
    "keys": ("layerswap.cli.admin:keys", "API keys."),
    "db": ("layerswap.cli.admin:db", "Database schema."),
    "submit": ("layerswap.cli.remote:submit", "Submit RECIPE to a running service."),
    "status": ("layerswap.cli.remote:status", "A job's status, stage, progress, output and error."),
    "wait": ("layerswap.cli.remote:wait", "Follow a job until it ends."),
    "lineage": ("layerswap.cli.remote:lineage", "The artifacts and jobs an artifact came from."),
}  # fmt: skip

# command name -> the extra (pyproject.toml) it needs beyond the base install
EXTRAS = {"serve": "server", "worker": "worker", "keys": "worker", "db": "worker"}

# Our own top-level packages: a missing one of these is a broken install, not a missing extra.
OURS = frozenset({"layerswap", "service", "worker", "core", "engine", "layerswap_client"})


class LazyGroup(click.Group):
    """A group whose commands are imported from COMMANDS when first looked up; its help lists
    them from COMMANDS without importing any (importing all of them, the service's and the
    worker's, took `layerswap --help` from 0.1 s to 2 s)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module, attribute = COMMANDS[cmd_name][0].split(":")
        try:
            command = getattr(importlib.import_module(module), attribute)
        except ModuleNotFoundError as e:
            missing = (e.name or "").partition(".")[0]
            extra = EXTRAS.get(cmd_name)
            if extra is None or not missing or missing in OURS:
                raise
            click.echo(
                f"layerswap: error [missing_extra]: `layerswap {cmd_name}` needs the {extra!r} "
                f"extra ({missing} is not installed): pip install 'layerswap[{extra}]'",
                err=True,
            )
            sys.exit(2)
        assert isinstance(command, click.Command)
        if _collector_paused:
            _resume_collector()
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, COMMANDS[name][1]) for name in self.list_commands(ctx)])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="layerswap", prog_name="layerswap")
def cli() -> None:
    """Layerswap: merge fine-tuned LLM checkpoints (layer swap, soup, TIES, slerp, DARE, ...)."""


# A command's imports make a few hundred thousand objects that live until the process ends:
# collecting while they pile up, and all of them again at exit, took 0.1 s of a merge's start.
# So the collector is paused for the imports, then told to leave what they made alone.
_collector_paused = False


def _resume_collector() -> None:
    global _collector_paused
    _collector_paused = False
    gc.freeze()
    gc.enable()


def _stop_as_init() -> None:
    """As PID 1 (a container started without an init, a Kubernetes pod) the kernel drops every
    signal the process has no handler for: until Celery or uvicorn install theirs, after seconds
    of imports, a stop would be ignored, and the container killed at the end of its grace
    period. There, SIGTERM ends the process, as it does anywhere else."""
    if os.getpid() == 1:
        signal.signal(signal.SIGTERM, _terminated)


def _terminated(signum: int, _frame: object) -> None:
    os._exit(128 + signum)  # what a shell reports for a process the signal ended


def main() -> None:
    global _collector_paused
    _stop_as_init()
    if gc.isenabled():
        gc.disable()
        _collector_paused = True
    cli()
