"""Fetch what a merge needs from the Hub, and nothing else.

1. Small files (configs, index, tokenizer) are downloaded whole.
2. Every safetensors shard is first present only as its header: the first 8 + N bytes, read
   with Range requests, in a sparse file of the shard's full size. The engine can open and plan
   with it (it reads headers only to plan).
3. The plan says which tensors each input contributes. A shard the merge reads all of is
   downloaded whole; of any other, only the byte ranges of the tensors read are fetched (Range
   requests, adjacent tensors in one) into that same sparse file. For a layer swap that is the
   task expert's middle layers and the language expert's ends: the bytes used, not the shards
   that hold them.

Whole files go through huggingface_hub into its cache keyed by commit sha (its file locks make
concurrent jobs fetching the same file safe, and each file is stored once). Sparse shards are
cached per commit too: a sidecar lists the ranges present, written (after the data is synced)
under a file lock, so a later job fetches only what is still missing and a crash mid-range
leaves that range missing, not wrong. A range cannot be checked against the file's sha256 (the
Hub hashes whole files), so a sparse shard is used only where the listing gives that sha256 as
the shard's identity; else the shard is downloaded whole. Each job sees its inputs through a
private directory of symlinks, removed when it ends.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from filelock import FileLock
from huggingface_hub import (
    get_session,
    hf_hub_download,
    hf_hub_url,
    hf_raise_for_status,
    try_to_load_from_cache,
)

# Public (documented, in huggingface_hub.utils.__all__); its lazy export hides it from mypy.
from huggingface_hub.utils import build_hf_headers  # type: ignore[attr-defined]
from tqdm.auto import tqdm

from core.hub.errors import HubError, HubFileMissing, hub_errors, retrying
from core.hub.pin import PinnedRepo, pin
from core.hub.refs import hub_sources, is_hub_source, parse_hub_source
from engine.errors import CheckpointError, DiskFull, MergeCanceled, is_disk_full
from engine.io.checkpoint import EXTRA_CONFIG_FILES, INDEX_FILE, TOKENIZER_FILES
from engine.io.lora import ADAPTER_CONFIG, split_source
from engine.limits import MAX_SIDE_FILE_BYTES
from engine.planner import Resolver, make_plan
from engine.recipe import Recipe

BACKOFF_S = 0.5  # the first retry's pause (core.hub.errors.retrying doubles it)
log = logging.getLogger("layerswap.hub")
T = TypeVar("T")
SIDE_FILES = frozenset(
    {"config.json", INDEX_FILE, *EXTRA_CONFIG_FILES, *TOKENIZER_FILES, ADAPTER_CONFIG}
)
MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit
CHUNK = 1 << 20  # bytes written per read of a ranged response

ProgressSink = Callable[[int, int], None]  # (bytes done, bytes total)
Span = tuple[int, int]  # [first byte, end byte) of a file


@dataclass
class FetchedInputs:
    """Where the engine finds each Hub source, and the sha256s it need not compute."""

    directories: dict[str, Path] = field(default_factory=dict)
    digests: dict[Path, str] = field(default_factory=dict)
    pins: dict[str, PinnedRepo] = field(default_factory=dict)
    downloaded: list[str] = field(default_factory=list)  # "repo/file" fetched whole
    ranged: dict[str, list[Span]] = field(default_factory=dict)  # "repo/file": ranges read
    root: Path | None = None

    def resolver(self, local: Resolver) -> Resolver:
        return lambda source: self.directories[source] if is_hub_source(source) else local(source)

    def close(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


def fetch_inputs(
    recipe: Recipe,
    *,
    cache_dir: Path,
    token: str | None,
    local: Resolver,
    on_progress: ProgressSink | None = None,
    should_cancel: Callable[[], bool] | None = None,
    headers_only: bool = False,
) -> FetchedInputs:
    """Make every hf:// source of `recipe` (pinned to a commit sha) a local directory holding
    what the merge reads (`headers_only`: enough to plan, no weights). The caller closes the
    result when the merge is over."""
    _prune_views(cache_dir / "views")
    root = cache_dir / "views" / uuid.uuid4().hex
    fetched = FetchedInputs(root=root)
    meter = _Meter(on_progress, should_cancel)
    try:
        for source in hub_sources(recipe):
            view = root / str(len(fetched.directories))
            _fetch_headers(source, view, fetched, cache_dir, token, meter)
        if headers_only:
            return fetched
        needed = _needed_spans(recipe, fetched, local)
        whole, sparse = _sort_shards(needed, fetched, cache_dir, meter)
        _fetch_ranges(sparse, fetched, cache_dir, token, meter)
        _download_whole(whole, fetched, cache_dir, token, meter)
        meter.report()
    except BaseException:  # cleanup only (a cancel included): the view goes, the error stays
        fetched.close()
        raise
    return fetched


def _fetch_headers(
    source: str, view: Path, fetched: FetchedInputs, cache_dir: Path, token: str | None,
    meter: _Meter,
) -> None:  # fmt: skip
    """Pin `source` and make `view` its directory: side files whole, shards as headers only."""
    ref = parse_hub_source(source)
    if not ref.pinned:
        raise HubError(f"{source}: not pinned to a commit sha")
    fetched.pins[source] = pinned = _retrying(partial(pin, ref, token))
    view.mkdir(parents=True)
    fetched.directories[source] = view
    side = _side_files(pinned, source)
    meter.total += sum(pinned.files[n].size for n in side)
    for name in side:
        _link(view / name, _download(pinned, name, cache_dir, token, meter))
    _check_index(pinned, view)
    for name in pinned.weight_files:
        _link(view / name, _header_file(pinned, name, cache_dir, token))
        if sha := pinned.files[name].sha256:
            fetched.digests[view / name] = sha


_Whole = tuple[str, str]  # (source, shard) to download whole
_Sparse = tuple[str, str, list[Span]]  # (source, shard, the ranges to fetch)


def _sort_shards(
    needed: dict[str, dict[str, list[Span] | None]],
    fetched: FetchedInputs,
    cache_dir: Path,
    meter: _Meter,
) -> tuple[list[_Whole], list[_Sparse]]:
    """The shards to download whole and those to fetch by range. One the client's cache holds
    whole (an earlier job read it all) is linked now; one whose sha256 the listing does not
    give, or whose every tensor is read, is downloaded whole."""
    whole: list[_Whole] = []
    sparse: list[_Sparse] = []
    for source, shards in needed.items():
        pinned, view = fetched.pins[source], fetched.directories[source]
        for name, spans in sorted(shards.items()):
            if cached := _cached(pinned, name, cache_dir):
                _link(view / name, cached)
            elif spans is None or not pinned.files[name].sha256 or _all_data(view / name, spans):
                whole.append((source, name))
                meter.total += pinned.files[name].size
            else:
                sparse.append((source, name, spans))
    return whole, sparse


def _fetch_ranges(
    sparse: list[_Sparse], fetched: FetchedInputs, cache_dir: Path, token: str | None,
    meter: _Meter,
) -> None:  # fmt: skip
    """Fetch into each sparse shard the ranges it still lacks; the whole missing size is
    counted into the progress total before the first byte is fetched."""
    missing = []  # (source, name, spans, header file, bytes not yet fetched)
    for source, name, spans in sparse:
        header = _header_file(fetched.pins[source], name, cache_dir, token)
        missing.append((source, name, spans, header, _size(_subtract(spans, _present(header)))))
    meter.total += sum(counted for *_, counted in missing)
    for source, name, spans, header, counted in missing:
        pinned = fetched.pins[source]
        with FileLock(f"{header}.lock"):  # concurrent jobs: one fetches, the others reuse
            present = _present(header)
            gaps = _subtract(spans, present)
            meter.add(max(0, counted - _size(gaps)))  # fetched meanwhile by another job
            if gaps:
                _fill(pinned, name, token, header, present, gaps, meter)
        fetched.ranged[f"{pinned.repo}/{name}"] = spans


def _download_whole(
    whole: list[_Whole], fetched: FetchedInputs, cache_dir: Path, token: str | None,
    meter: _Meter,
) -> None:  # fmt: skip
    for source, name in whole:
        pinned = fetched.pins[source]
        path = _download(pinned, name, cache_dir, token, meter)
        _link(fetched.directories[source] / name, path)
        fetched.downloaded.append(f"{pinned.repo}/{name}")


def fetch_model(
    source: str,
    *,
    cache_dir: Path,
    token: str | None,
    on_progress: ProgressSink | None = None,
    should_cancel: Callable[[], bool] | None = None,
) -> FetchedInputs:
    """A whole Hub model (configs, tokenizer, every safetensors shard), pinned to a commit sha,
    as a local directory for a reader other than the engine (an evaluation loads it all). The
    caller closes the result."""
    _prune_views(cache_dir / "views")
    root = cache_dir / "views" / uuid.uuid4().hex
    fetched = FetchedInputs(root=root)
    meter = _Meter(on_progress, should_cancel)
    try:
        ref = parse_hub_source(source)
        if not ref.pinned:
            raise HubError(f"{source}: not pinned to a commit sha")
        fetched.pins[source] = pinned = _retrying(partial(pin, ref, token))
        view = root / "0"
        view.mkdir(parents=True)
        fetched.directories[source] = view
        side = _side_files(pinned, source)
        meter.total = sum(pinned.files[n].size for n in [*side, *pinned.weight_files])
        for name in side:
            _link(view / name, _download(pinned, name, cache_dir, token, meter))
        _check_index(pinned, view)
        for name in pinned.weight_files:
            _link(view / name, _download(pinned, name, cache_dir, token, meter))
            fetched.downloaded.append(f"{pinned.repo}/{name}")
            if sha := pinned.files[name].sha256:
                fetched.digests[view / name] = sha
        meter.report()
    except BaseException:  # cleanup only (a cancel included): the view goes, the error stays
        fetched.close()
        raise
    return fetched


def _side_files(pinned: PinnedRepo, source: str) -> list[str]:
    """The configs, index and tokenizer files; their sizes are known from the listing, so an
    oversized one is refused before it is downloaded."""
    side = [n for n in pinned.files if n in SIDE_FILES]
    for name in side:
        if (size := pinned.files[name].size) > MAX_SIDE_FILE_BYTES:
            raise CheckpointError.at(
                f"{source}/{name}", f"{size} bytes; at most {MAX_SIDE_FILE_BYTES}"
            )
    return side


def _prune_views(views: Path, older_than_s: float = 24 * 3600) -> None:
    """Views of jobs whose worker was killed are never closed: drop those a day old (a view
    is symlinks only; the cache itself is kept)."""
    if not views.is_dir():
        return
    cutoff = time.time() - older_than_s
    for view in views.iterdir():
        try:
            if view.stat().st_mtime < cutoff:
                shutil.rmtree(view, ignore_errors=True)
        except FileNotFoundError:
            continue  # another job pruned it first


def _check_index(pinned: PinnedRepo, view: Path) -> None:
    """Every shard the index names must be in the commit (else the engine would see a
    missing file and blame the checkpoint)."""
    index = view / INDEX_FILE
    if not index.exists():
        return
    try:
        names = set(json.loads(index.read_text()).get("weight_map", {}).values())
    except (ValueError, AttributeError):
        return  # a malformed index: the engine says what is wrong with it
    if missing := sorted(n for n in names if isinstance(n, str) and n not in pinned.files):
        raise HubFileMissing(
            f"hf://{pinned.repo}@{pinned.sha}: {', '.join(missing[:3])} listed in {INDEX_FILE} "
            "but not in the repository"
        )


def _needed_spans(
    recipe: Recipe, fetched: FetchedInputs, local: Resolver
) -> dict[str, dict[str, list[Span] | None]]:
    """Per Hub source and shard, the byte ranges of the tensors the merge reads, adjacent ones
    joined (None: the whole shard, as when the recipe weighs inputs by magnitude: planning then
    reads every weight)."""
    if recipe.plans_from_weights:
        return {s: dict.fromkeys(p.weight_files) for s, p in fetched.pins.items()}
    plan = make_plan(recipe, resolve=fetched.resolver(local))
    try:
        by_input: dict[int, dict[str, list[Span]]] = {}
        for tensor in plan.tensors:
            for index in plan.inputs_read(tensor):
                info = plan.checkpoints[index].tensors[tensor.read_name]
                spans = by_input.setdefault(index, {}).setdefault(info.file.name, [])
                spans.append((info.start, info.start + info.nbytes))
        needed: dict[str, dict[str, list[Span] | None]] = {}
        for index, ref in enumerate(plan.inputs):
            model, adapter = split_source(ref.source)
            if adapter in fetched.pins:  # a LoRA adapter: small, and read whole
                needed[adapter] = dict.fromkeys(fetched.pins[adapter].weight_files)
            if model in fetched.pins:
                shards = needed.setdefault(model, {})
                for name, spans in by_input.get(index, {}).items():
                    shards[name] = _join(spans + (shards.get(name) or []))
        return needed
    finally:
        plan.close()


def _join(spans: list[Span]) -> list[Span]:
    """Sorted, with overlapping or adjacent spans made one."""
    joined: list[Span] = []
    for first, end in sorted(spans):
        if joined and first <= joined[-1][1]:
            joined[-1] = (joined[-1][0], max(end, joined[-1][1]))
        elif end > first:
            joined.append((first, end))
    return joined


def _subtract(spans: list[Span], present: list[Span]) -> list[Span]:
    """The parts of `spans` not in `present` (both joined)."""
    gaps: list[Span] = []
    for first, end in spans:
        for have_first, have_end in present:
            if have_end <= first or have_first >= end:
                continue
            if have_first > first:
                gaps.append((first, have_first))
            first = max(first, have_end)
            if first >= end:
                break
        if first < end:
            gaps.append((first, end))
    return gaps


def _size(spans: list[Span]) -> int:
    return sum(end - first for first, end in spans)


def _all_data(header_file: Path, spans: list[Span]) -> bool:
    """Whether `spans` are all of the shard's tensor data (then it is downloaded whole)."""
    with header_file.open("rb") as f:
        data_start = 8 + int.from_bytes(f.read(8), "little")
    return spans == [(data_start, header_file.stat().st_size)]


def _link(link: Path, target: Path) -> None:
    tmp = link.with_name(f".{link.name}.{uuid.uuid4().hex[:8]}")
    tmp.symlink_to(target)
    os.replace(tmp, link)


def _retrying(call: Callable[[], T]) -> T:
    return retrying(call, what="Hub request", first_pause_s=BACKOFF_S)


def _download(
    pinned: PinnedRepo, name: str, cache_dir: Path, token: str | None, meter: _Meter
) -> Path:
    """The whole file, from the client's cache (keyed by commit sha) or downloaded into it."""

    def once() -> Path:
        meter.check()
        with hub_errors(f"hf://{pinned.repo}@{pinned.sha}/{name}"):
            path = hf_hub_download(
                pinned.repo,
                name,
                revision=pinned.sha,
                cache_dir=cache_dir / "files",
                token=token or False,
                tqdm_class=meter.tqdm_class(),
            )
        return Path(str(path))

    return _retrying(once)


def _cached(pinned: PinnedRepo, name: str, cache_dir: Path) -> Path | None:
    """The whole file, if the client's cache has it."""
    found = try_to_load_from_cache(
        pinned.repo, name, cache_dir=cache_dir / "files", revision=pinned.sha
    )
    return Path(found) if isinstance(found, str) else None


def _header_file(pinned: PinnedRepo, name: str, cache_dir: Path, token: str | None) -> Path:
    """The shard's header in a sparse file of the shard's size (cached per commit)."""
    path = cache_dir / "headers" / pinned.repo / pinned.sha / name
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):  # concurrent jobs: one fetches, the others reuse
        if not path.is_file():
            _write_header_file(pinned, name, token, path)
    return path


def _write_header_file(pinned: PinnedRepo, name: str, token: str | None, path: Path) -> None:
    where = f"hf://{pinned.repo}@{pinned.sha}/{name}"
    size = pinned.files[name].size
    length = int.from_bytes(_read_range(pinned, name, token, 0, 7), "little")
    if not 0 < length <= min(MAX_HEADER, size - 8):
        raise HubError(f"{where}: not a safetensors file (header length {length})")
    header = _read_range(pinned, name, token, 8, 8 + length - 1)
    tmp = path.with_name(f".{name}.{uuid.uuid4().hex[:8]}")
    try:
        with tmp.open("wb") as f:
            f.write(length.to_bytes(8, "little") + header)
            f.truncate(size)  # sparse: the data is never read from here
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)  # no half-written header file stays in the cache
        if is_disk_full(e):
            raise DiskFull.at(path.parent, f"the header of {where}") from None
        raise


def _ranges_file(header_file: Path) -> Path:
    return header_file.with_name(f"{header_file.name}.ranges.json")


def _present(header_file: Path) -> list[Span]:
    """The data ranges of a sparse shard already fetched (none if its list is unreadable)."""
    try:
        spans = json.loads(_ranges_file(header_file).read_text())
        return _join([(int(first), int(end)) for first, end in spans])
    except FileNotFoundError:
        return []
    except (ValueError, TypeError):
        log.warning("%s: unreadable list of fetched ranges; fetching them again", header_file)
        return []


def _fill(
    pinned: PinnedRepo,
    name: str,
    token: str | None,
    header_file: Path,
    present: list[Span],
    gaps: list[Span],
    meter: _Meter,
) -> None:
    """Fetch `gaps` into the sparse shard, sync it, then add them to its list of `present`
    ranges (the caller holds the shard's lock)."""
    fd = os.open(header_file, os.O_WRONLY)
    try:
        for first, end in gaps:
            _fetch_span(pinned, name, token, fd, first, end, meter)
        os.fsync(fd)
    except OSError as e:
        if is_disk_full(e):
            raise DiskFull.at(
                header_file.parent, f"hf://{pinned.repo}@{pinned.sha}/{name}"
            ) from None
        raise
    finally:
        os.close(fd)
    listing = _ranges_file(header_file)
    tmp = listing.with_name(f".{listing.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(_join(present + gaps)))
    os.replace(tmp, listing)


def _fetch_span(
    pinned: PinnedRepo, name: str, token: str | None, fd: int, first: int, end: int, meter: _Meter
) -> None:
    """Bytes [first, end) of the file into `fd` at the same offsets; a retry after a dropped
    connection asks only for the rest."""
    where = f"hf://{pinned.repo}@{pinned.sha}/{name}"
    done = first

    def once() -> None:
        nonlocal done
        meter.check()
        with _range_get(pinned, name, token, done, end - 1) as response:
            if response.status_code != 206:
                raise HubError(f"{where}: the Hub did not answer a Range request with a range")
            for chunk in response.iter_bytes(CHUNK):
                if done + len(chunk) > end:
                    raise HubError(f"{where}: the Hub sent more than the range asked for")
                os.pwrite(fd, chunk, done)
                done += len(chunk)
                meter.add(len(chunk))
        if done != end:
            raise HubError(
                f"{where}: the Hub sent {done - first} bytes of a {end - first}-byte range"
            )

    _retrying(once)


def _read_range(pinned: PinnedRepo, name: str, token: str | None, first: int, last: int) -> bytes:
    return _retrying(lambda: _read_range_once(pinned, name, token, first, last))


def _read_range_once(
    pinned: PinnedRepo, name: str, token: str | None, first: int, last: int
) -> bytes:
    where = f"hf://{pinned.repo}@{pinned.sha}/{name}"
    with _range_get(pinned, name, token, first, last) as response:
        data = bytes(response.read())
    if len(data) != last - first + 1:
        raise HubError(
            f"{where}: the Hub sent {len(data)} bytes for a {last - first + 1}-byte range"
        )
    return data


@contextmanager
def _range_get(
    pinned: PinnedRepo, name: str, token: str | None, first: int, last: int
) -> Iterator[Any]:
    """The streamed answer to a GET of bytes first..last (inclusive) of the file; the client's
    errors translated (hub_errors) while it is open."""
    with hub_errors(f"hf://{pinned.repo}@{pinned.sha}/{name}"):
        headers = build_hf_headers(token=token or False)
        headers["Range"] = f"bytes={first}-{last}"
        url = hf_hub_url(pinned.repo, name, revision=pinned.sha)
        with get_session().stream("GET", url, headers=headers, follow_redirects=True) as response:
            if response.is_error:
                response.read()  # the error's details are in the body
            hf_raise_for_status(response)
            yield response


class _Meter:
    """Download progress across files, at most every 0.2 s, and the cancel check."""

    def __init__(self, sink: ProgressSink | None, should_cancel: Callable[[], bool] | None) -> None:
        self.sink, self.should_cancel = sink, should_cancel
        self.done = self.total = 0
        self._reported = 0.0

    def check(self) -> None:
        if self.should_cancel is not None and self.should_cancel():
            raise MergeCanceled("canceled while downloading")

    def add(self, n: int) -> None:
        self.done += n
        self.check()
        if time.monotonic() - self._reported >= 0.2:
            self.report()

    def report(self) -> None:
        self._reported = time.monotonic()
        if self.sink is not None:
            self.sink(min(self.done, self.total), self.total)

    def tqdm_class(self) -> Any:
        meter = self

        class Counting(tqdm):  # type: ignore[misc, type-arg]
            """The client's progress bar, silent, counting into the job's progress."""

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                kwargs["disable"] = True
                super().__init__(*args, **kwargs)

            def update(self, n: float | None = 1) -> bool | None:
                meter.add(int(n or 0))
                return None

        return Counting
