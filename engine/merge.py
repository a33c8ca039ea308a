"""Run a plan: stream every output tensor into shards in a staging directory, then publish it.

The output appears atomically: everything is written beside the target, fsynced, and renamed
into place only when complete; any failure or cancellation removes the staging directory.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import (
    DeviceError,
    DiskFull,
    EngineError,
    MergeCanceled,
    OutputError,
    OutputTooLarge,
    RecipeError,
    is_disk_full,
)
from engine.io.checkpoint import (
    EXTRA_CONFIG_FILES,
    INDEX_FILE,
    TOKENIZER_FILES,
    set_config_values,
)
from engine.io.digests import file_sha256
from engine.io.file_access import FileGuard, Opener, copy_file
from engine.io.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from engine.limits import MAX_SIDE_FILE_BYTES
from engine.mergekit import MergekitOrigin
from engine.model_card import render_card
from engine.plan.model import Plan
from engine.plan.output_size import check_output_ratio
from engine.planner import DEFAULT_CHUNK_ELEMENTS, Resolver, make_plan
from engine.progress import CancelCheck, ProgressCallback
from engine.recipe import Recipe, recipe_to_dict
from engine.streaming import shard_layout, stream_shards

MANIFEST = "layerswap.json"
CARD = "README.md"
ENGINE_VERSION = "1"


@dataclass(frozen=True)
class MergeOptions:
    device: str = "cpu"
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
    durable: bool = True  # fsync files and directory before the rename
    hash_cache: Path | None = None  # remembers input sha256s across runs
    overwrite: bool = False
    drain_tick_s: float = 0.5  # progress and cancellation while the last writes drain
    # Names this attempt's staging directory, so a retry can tell its own leftovers apart.
    staging_tag: str = ""
    job: dict[str, Any] | None = None  # recorded in the manifest: which job made the output
    # sha256s known without reading the file (Hub LFS files, of which only the header may be
    # here when the merge reads none of their tensors)
    known_digests: dict[Path, str] = field(default_factory=dict)
    # Called with the planned output size in bytes once the plan is made, before anything is
    # written; raises to refuse (the service's per-tenant storage quota).
    reserve_space: Callable[[int], None] | None = None
    # The mergekit config the recipe was translated from: checked against the plan, its
    # warnings added to the plan's, the config recorded in the manifest.
    mergekit: MergekitOrigin | None = None
    # Confines the files read from the inputs (the service's allowed source directories);
    # None: every file as named, symlinks followed (engine/io/file_access.py).
    file_guard: FileGuard | None = None
    # The most times the inputs' size the output may be (OutputTooLarge); None: no bound.
    max_output_ratio: float | None = None


@dataclass(frozen=True)
class MergeResult:
    out_dir: Path
    files: dict[str, str]  # file name -> sha256, every file in out_dir
    plan_digest: str
    manifest: dict[str, Any]
    seconds: float


def merge(
    recipe: Recipe,
    out_dir: Path,
    *,
    resolve: Resolver,
    options: MergeOptions | None = None,
    on_progress: ProgressCallback | None = None,
    should_cancel: CancelCheck | None = None,
) -> MergeResult:
    """Plan and execute a recipe into `out_dir` (which must not exist unless overwrite)."""
    options = options or MergeOptions()
    check_output(out_dir, overwrite=options.overwrite)
    try:
        plan = make_plan(
            recipe, resolve=resolve, chunk_elements=options.chunk_elements,
            should_cancel=should_cancel, guard=options.file_guard,
        )  # fmt: skip
    except RecipeError as e:  # named as the mergekit config names it, where it was one
        raise (options.mergekit.renamed(e) if options.mergekit else e) from None
    try:
        return execute(plan, recipe, out_dir, options, on_progress, should_cancel)
    finally:
        plan.close()


def check_output(out_dir: Path, *, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"{out_dir}: exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise OutputError(f"{out_dir}: already exists and is not empty", remedy="overwrite")


def execute(
    plan: Plan,
    recipe: Recipe,
    out_dir: Path,
    options: MergeOptions,
    on_progress: ProgressCallback | None = None,
    should_cancel: CancelCheck | None = None,
) -> MergeResult:
    device = resolve_device(options.device)
    started = time.monotonic()
    out_dir = out_dir.absolute()
    if options.mergekit is not None:
        options.mergekit.apply(plan)
    needed = _check_size(plan, options)
    staging = _make_staging(out_dir, options.staging_tag)
    stop_hashing = threading.Event()
    with ThreadPoolExecutor(1, thread_name_prefix="input-digests") as pool:
        inputs = pool.submit(
            _identify_inputs, plan, options.hash_cache, options.known_digests, stop_hashing.is_set
        )
        try:
            _check_free_space(staging, needed)
            files = stream_shards(
                plan, staging, device=device, chunk_elements=options.chunk_elements,
                durable=options.durable, tick_s=options.drain_tick_s, on_progress=on_progress,
                should_cancel=should_cancel, started=started,
            )  # fmt: skip
            files.update(_write_side_files(plan, staging, recipe.output.dtype, options.mergekit))
            manifest = _write_card_and_manifest(
                plan, recipe, staging, inputs, files, options.job, options.mergekit
            )
            if should_cancel is not None and should_cancel():  # the last look before the rename
                raise MergeCanceled("canceled before the output was published")
            _publish(staging, out_dir, durable=options.durable, overwrite=options.overwrite)
        except BaseException as e:  # cleanup on any exit (a cancel too), then re-raised
            stop_hashing.set()  # the pool's exit waits for the hashing thread: end it now
            shutil.rmtree(staging, ignore_errors=True)
            if is_disk_full(e):
                raise DiskFull.at(out_dir.parent, "the output") from None
            named = naming_output(e, staging, out_dir) if isinstance(e, EngineError) else e
            if named is not e:
                raise named from None
            raise
    return MergeResult(out_dir, files, plan.digest(), manifest, time.monotonic() - started)


def _check_size(plan: Plan, options: MergeOptions) -> int:
    """The output's planned size, once it is allowed: refused before any write when it is too
    many times its inputs' or does not fit the caller's room (a tenant's storage quota)."""
    if options.max_output_ratio is not None:
        try:
            check_output_ratio(plan, options.max_output_ratio)
        except OutputTooLarge as e:
            raise (options.mergekit.renamed(e) if options.mergekit else e) from None
    needed = planned_output_bytes(plan)
    if options.reserve_space is not None:
        options.reserve_space(needed)
    return needed


def naming_output(error: EngineError, staging: Path, out_dir: Path) -> EngineError:
    """`error` as it names the output directory where it named `staging`, the hidden directory
    the output is written in before it is published (`.<name>.staging-…`): the caller knows the
    output by its own name, e.g. `<out_dir>/model.safetensors`. `error` itself where it names
    no file of `staging`."""
    hidden, shown = str(staging), str(out_dir)
    details = {k: v.replace(hidden, shown) if isinstance(v, str) else v
               for k, v in error.details.items()}  # fmt: skip
    if hidden not in error.message and details == error.details:
        return error
    named = copy.copy(error)  # the same kind of error, with all it carries
    named.message = error.message.replace(hidden, shown)
    named.args = (named.message,)
    named.details = details
    return named


def _make_staging(out_dir: Path, staging_tag: str) -> Path:
    """A new directory beside `out_dir` to write the output in, named after the attempt
    (`staging_tag`) so a retry can tell its own leftovers apart."""
    tag = f"{staging_tag}-" if staging_tag else ""
    staging = out_dir.parent / f".{out_dir.name}.staging-{tag}{uuid.uuid4().hex[:12]}"
    try:
        staging.mkdir(parents=True)
    except OSError as e:
        if is_disk_full(e):
            raise DiskFull.at(out_dir.parent, "the output directory") from None
        raise OutputError(f"{out_dir}: cannot create output ({e.strerror})") from None
    return staging


def _write_card_and_manifest(
    plan: Plan,
    recipe: Recipe,
    staging: Path,
    inputs: Future[list[dict[str, Any]]],
    files: dict[str, str],
    job: dict[str, Any] | None,
    mergekit: MergekitOrigin | None,
) -> dict[str, Any]:
    """Write README.md and then layerswap.json (listing every other file's sha256, the card's
    included) into `staging`, adding both to `files`; the manifest."""
    manifest = _manifest(plan, recipe, inputs, files, job, mergekit)
    card = render_card(manifest, name=recipe.output.name)
    (staging / CARD).write_text(card, encoding="utf-8")
    files[CARD] = file_sha256(staging / CARD)
    manifest["outputs"] = dict(sorted(files.items()))
    files[MANIFEST] = _write_json(staging / MANIFEST, manifest)
    return manifest


def resolve_device(name: str) -> str:
    """Validate the device before anything is written; torch is imported only for CUDA."""
    if name == "cpu":
        return name
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        # torch: seconds to import; only a CUDA device needs it
        import torch

        if not torch.cuda.is_available():
            raise DeviceError(f"device {name!r} requested but no CUDA GPU is available")
        if name.startswith("cuda:") and int(name[5:]) >= (count := torch.cuda.device_count()):
            raise DeviceError(f"device {name!r} requested but this host has {count} CUDA GPU(s)")
        return name
    raise DeviceError(f"unknown device {name!r} (use cpu, cuda or cuda:N)")


def _write_side_files(
    plan: Plan, staging: Path, dtype: str = "source", mergekit: MergekitOrigin | None = None
) -> dict[str, str]:
    """Index (if sharded), configs from the config input, tokenizer from the tokenizer input;
    a mergekit config's as mergekit writes them (engine/mergekit/side_files.py).

    When the recipe converts the weights (`output.dtype`), config.json's dtype says so too:
    transformers loads weights in the dtype the config declares.
    """
    written: dict[str, str] = {}
    if len(plan.shards) > 1:
        weight_map = {plan.tensors[i].name: s.filename for s in plan.shards for i in s.tensors}
        index = {"metadata": {"total_size": plan.total_bytes}, "weight_map": weight_map}
        written[INDEX_FILE] = _write_json(staging / INDEX_FILE, index)
    if mergekit is not None:
        if plan.vocabulary is None:
            _warn_tokenizer_mismatch(plan)
        names = mergekit.write_side_files(plan, staging)
        return written | {name: file_sha256(staging / name) for name in names}
    config_dir = Path(plan.inputs[plan.config_input].path)
    tokenizer_dir = Path(plan.inputs[plan.tokenizer_input].path)
    vocabulary = plan.vocabulary
    rewritten = vocabulary is not None and vocabulary.tokenizer_changed
    openers = _openers(plan)
    sources = _side_file_sources(config_dir, None if rewritten else tokenizer_dir)
    for directory, name in sources:
        if (directory / name).is_file():
            copy_file(directory / name, staging / name, MAX_SIDE_FILE_BYTES, openers[directory])
            if name == "config.json" and (dtype != "source" or plan.config_changes):
                _edit_config(staging / name, dtype, plan.config_changes)
            written[name] = file_sha256(staging / name)
    if vocabulary is None:
        _warn_tokenizer_mismatch(plan)
    elif rewritten:  # tokens added or dropped: a new tokenizer.json numbering the rows
        for name in vocabulary.write_tokenizer(tokenizer_dir, staging, openers[tokenizer_dir]):
            written[name] = file_sha256(staging / name)
    return written


def _openers(plan: Plan) -> dict[Path, Opener]:
    """How each input directory's files are opened (its checkpoint's opener)."""
    return {
        Path(ref.path): checkpoint.opener
        for ref, checkpoint in zip(plan.inputs, plan.checkpoints, strict=True)
    }


def _side_file_sources(config_dir: Path, tokenizer_dir: Path | None) -> list[tuple[Path, str]]:
    """The files copied as they are: configs, and the tokenizer's unless it is written anew."""
    copies = [(config_dir, "config.json")] + [(config_dir, n) for n in EXTRA_CONFIG_FILES]
    if tokenizer_dir is None:
        return copies
    return copies + [(tokenizer_dir, n) for n in TOKENIZER_FILES]


def _edit_config(path: Path, dtype: str, changes: dict[str, Any]) -> None:
    """Rewrite config.json with the output's dtype (unless "source") and the plan's changes
    (dotted keys, e.g. text_config.num_hidden_layers)."""
    config = json.loads(path.read_text(encoding="utf-8"))
    set_config_values(config, changes)
    if dtype != "source":
        _set_config_dtype(config, dtype)
    _write_json(path, config)


def _set_config_dtype(config: dict[str, Any], dtype: str) -> None:
    for section in (config, config.get("text_config")):
        if isinstance(section, dict):
            for key in ("torch_dtype", "dtype"):
                if key in section:
                    section[key] = dtype
    if "torch_dtype" not in config and "dtype" not in config:
        config["torch_dtype"] = dtype


def _warn_tokenizer_mismatch(plan: Plan) -> None:
    reference = Path(plan.inputs[plan.tokenizer_input].path) / "tokenizer.json"
    if not reference.is_file():
        return
    openers = _openers(plan)
    digest = file_sha256(reference, opener=openers[reference.parent])
    for ref in plan.inputs:
        other = Path(ref.path) / "tokenizer.json"
        if other.is_file() and file_sha256(other, opener=openers[other.parent]) != digest:
            plan.warnings.append(
                f"tokenizer.json of {ref.label} differs from "
                f"{plan.inputs[plan.tokenizer_input].label}'s, which was used"
            )


def planned_output_bytes(plan: Plan) -> int:
    """What the output's weights and side files will take on disk: the shards (headers
    included) and the files copied from the inputs (their sizes are on disk already). The model
    card, manifest and index, a few KB, come on top."""
    config_dir = Path(plan.inputs[plan.config_input].path)
    tokenizer_dir = Path(plan.inputs[plan.tokenizer_input].path)
    side = 0
    for directory, name in _side_file_sources(config_dir, tokenizer_dir):
        with contextlib.suppress(OSError):
            side += (directory / name).stat().st_size
    headers = sum(len(header) for header, _ in shard_layout(plan))
    return plan.total_bytes + headers + side


def _check_free_space(directory: Path, needed: int) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise DiskFull(
            f"the output needs {needed} bytes but {free} are free in {directory.parent}",
            details={"path": str(directory.parent), "needed_bytes": needed, "free_bytes": free},
        )


def _identify_inputs(
    plan: Plan,
    cache: Path | None,
    known: dict[Path, str],
    should_stop: Callable[[], bool] | None = None,
) -> list[dict[str, Any]]:
    identities = []
    for ref, checkpoint in zip(plan.inputs, plan.checkpoints, strict=True):
        files = sorted({*checkpoint.weight_files, checkpoint.path / "config.json"})
        opener = checkpoint.opener
        identity = {
            "label": ref.label,
            "role": ref.role,
            "source": ref.source,
            "files": {
                f.name: known.get(f) or file_sha256(f, cache, should_stop, opener) for f in files
            },
        }
        if (adapter := checkpoint.adapter) is not None:  # a model+adapter source's adapter
            identity["adapter_files"] = {
                f.name: known.get(f) or file_sha256(f, cache, should_stop, adapter.opener)
                for f in (adapter.path / ADAPTER_CONFIG, adapter.path / ADAPTER_WEIGHTS)
            }
        identities.append(identity)
    return identities


def _manifest(
    plan: Plan,
    recipe: Recipe,
    inputs: Future[list[dict[str, Any]]],
    files: dict[str, str],
    job: dict[str, Any] | None,
    mergekit: MergekitOrigin | None,
) -> dict[str, Any]:
    return {
        "layerswap_engine": ENGINE_VERSION,
        **({"job": job} if job else {}),
        "recipe": recipe_to_dict(recipe),
        **({"mergekit_config": mergekit.config} if mergekit else {}),
        "inputs": inputs.result(),
        "resolved_weights": plan.resolved_weights,
        "plan_digest": plan.digest(),
        "layer_stack": plan.layer_stack.to_dict() if plan.layer_stack else None,
        "layers": [
            {"layer": r.layer, "origin": r.origin, "made_from": r.terms} for r in plan.layer_rows()
        ],
        **({"vocabulary": plan.vocabulary.to_dict()} if plan.vocabulary else {}),
        "outputs": dict(sorted(files.items())),
        "warnings": plan.warnings,
    }


def _write_json(path: Path, data: Any) -> str:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return file_sha256(path)


def _publish(staging: Path, out_dir: Path, *, durable: bool, overwrite: bool) -> None:
    if durable:
        for entry in staging.iterdir():
            _fsync(entry)
        _fsync(staging)
    previous = None
    if out_dir.exists():
        check_output(out_dir, overwrite=overwrite)
        previous = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:12]}"
        os.rename(out_dir, previous)
    os.rename(staging, out_dir)
    if durable:
        _fsync(out_dir.parent)
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
