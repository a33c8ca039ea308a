"""The `layerswap` command line: merge, evaluate, analyze, examples (the engine alone); serve,
worker, keys, db (the service); submit, status, wait, lineage (a remote service, through the
client).

A command's module is imported when that command runs (click's lazily loaded subcommands), so
`layerswap status` loads the client only and `layerswap merge` never loads the web framework or
Celery. Modules that import torch (the delta analysis, the example checkpoints) are imported
inside their commands besides, so the other commands of their module never load it.
"""

from __future__ import annotations

import importlib

import click

# command name -> "module:attribute" (a click command or group)
COMMANDS = {
    "merge": "layerswap.cli.merge:merge",
    "evaluate": "layerswap.cli.evaluate:evaluate",
    "analyze": "layerswap.cli.analyze:analyze",
    "examples": "layerswap.cli.analyze:examples",
    "serve": "layerswap.cli.serve:serve",
    "worker": "layerswap.cli.serve:worker",
    "keys": "layerswap.cli.admin:keys",
    "db": "layerswap.cli.admin:db",
    "submit": "layerswap.cli.remote:submit",
    "status": "layerswap.cli.remote:status",
    "wait": "layerswap.cli.remote:wait",
    "lineage": "layerswap.cli.remote:lineage",
}


class LazyGroup(click.Group):
    """A group whose commands are imported from COMMANDS when first looked up."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module, attribute = COMMANDS[cmd_name].split(":")
        command = getattr(importlib.import_module(module), attribute)
        assert isinstance(command, click.Command)
        return command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Layerswap: merge fine-tuned LLM checkpoints (layer swap, soup, task arithmetic, TIES)."""


def main() -> None:
    cli()
