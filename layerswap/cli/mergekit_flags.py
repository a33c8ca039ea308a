"""mergekit-yaml's flags on `layerswap merge`, so that its habits carry over: each one honoured,
accepted with a note on why it changes nothing here, or refused with the reason. This table is
the only list of them; the options, the help and the docs' table are made from it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import click

Handling = Literal["honoured", "no-op", "refused"]


@dataclass(frozen=True)
class Flag:
    name: str  # mergekit-yaml's option, without the dashes
    handling: Handling
    why: str  # what Layerswap does instead (shown as a note, or as the refusal)
    value: type | None = None  # the option takes a value of this type
    negation: bool = False  # also `--no-<name>` (mergekit's boolean pairs)
    short: str | None = None  # mergekit's one-letter form


FLAGS = (
    Flag("cuda", "honoured", "the same as --device cuda"),
    Flag("gpu-rich", "honoured", "the same as --device cuda; the other GPU options are no-ops"),
    Flag(
        "copy-tokenizer",
        "no-op",
        "the tokenizer is always written, as mergekit does by default",
        negation=True,
    ),
    Flag("lazy-unpickle", "no-op", "safetensors are always read lazily; pickles never are"),
    Flag("low-cpu-memory", "no-op", "a merge streams chunk by chunk, its memory is bounded"),
    Flag("read-to-gpu", "no-op", "inputs are read in chunks and moved to the --device"),
    Flag("multi-gpu", "no-op", "one --device computes a merge"),
    Flag("clone-tensors", "no-op", "each output tensor is written once, from its own bytes"),
    Flag("async-write", "no-op", "output files are always written beside the arithmetic"),
    Flag("write-threads", "no-op", "the writer's threads are chosen for the disk", value=int),
    Flag("num-threads", "no-op", "the CPU kernels use every core (at most four)", value=int),
    Flag(
        "out-shard-size",
        "no-op",
        "shards are sized in bytes: a recipe's output.shard_size (2GB by default)",
        value=str,
    ),
    Flag(
        "write-model-card", "no-op", "README.md (the model card) is always written", negation=True
    ),
    Flag("transformers-cache", "no-op", "Hub downloads go to LAYERSWAP_CACHE_DIR", value=str),
    Flag("lora-merge-cache", "no-op", "Hub downloads go to LAYERSWAP_CACHE_DIR", value=str),
    Flag(
        "random-seed",
        "no-op",
        "random drops take the recipe's params.seed (0), the same "
        "bytes on every run; `--dry-run` prints the recipe to edit",
        value=int,
    ),
    Flag(
        "verbose",
        "no-op",
        "warnings and progress are always shown (-q: no progress bar)",
        short="v",
    ),
    Flag("safe-serialization", "no-op", "the output is always safetensors", negation=True),
    Flag(
        "allow-crimes",
        "refused",
        "Layerswap merges checkpoints of one architecture only: "
        "tensors of another architecture have other meanings at the same names",
    ),
    Flag("trust-remote-code", "refused", "Layerswap never runs code that a checkpoint ships"),
    Flag(
        "unsafe-truncate-embeddings",
        "refused",
        "differing vocabularies are aligned by token (tokenizer_source), never cut",
    ),
)


def _attribute(flag: Flag) -> str:
    return "mergekit_" + flag.name.replace("-", "_")


def mergekit_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Adds every flag of FLAGS to a click command (hidden from --help's option list, which
    names them in one line instead)."""
    for flag in reversed(FLAGS):
        if flag.value is not None:
            decls = [f"--{flag.name}", _attribute(flag)]
            command = click.option(*decls, type=flag.value, default=None, hidden=True)(command)
        elif flag.negation:
            decls = [f"--{flag.name}/--no-{flag.name}", _attribute(flag)]
            command = click.option(*decls, default=None, hidden=True)(command)
        else:
            decls = [f"--{flag.name}", _attribute(flag)] + (
                [f"-{flag.short}"] if flag.short else []
            )
            command = click.option(*decls, is_flag=True, default=None, hidden=True)(command)
    return command


def take_mergekit_flags(values: dict[str, Any]) -> tuple[bool, list[str]]:
    """Pops the flags' values from a command's keyword arguments. Returns (a CUDA flag was
    given, the notes to print); a refused flag is a usage error naming it and why."""
    cuda, notes = False, []
    for flag in FLAGS:
        given = values.pop(_attribute(flag), None)
        if given is None:
            continue
        option = f"--{flag.name}" if given is not False else f"--no-{flag.name}"
        if flag.handling == "refused":
            raise click.UsageError(f"{option}: {flag.why}")
        if flag.handling == "honoured":
            cuda = True
        notes.append(f"note: {option} (mergekit-yaml's): {flag.why}")
    return cuda, notes


def flags_table() -> str:
    """The docs' table of the flags (Markdown), made from FLAGS."""
    rows = ["| mergekit-yaml flag | in `layerswap merge` |", "|---|---|"]
    for flag in FLAGS:
        name = f"`--{flag.name}`" + (f" / `--no-{flag.name}`" if flag.negation else "")
        rows.append(f"| {name} | {flag.handling}: {flag.why} |")
    return "\n".join(rows)
