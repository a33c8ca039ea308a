"""FakeHub: a Hugging Face Hub-compatible HTTP server for tests.

The real ``huggingface_hub`` client (2.4, with ``HF_HUB_DISABLE_XET=1``) runs against it
unpatched: model info, tree listing, refs, commits, ``hf_hub_download`` (HEAD/GET/Range),
``snapshot_download``, ``create_repo``, ``create_branch`` and ``create_commit``/``upload_folder``
with regular and LFS files (preupload, LFS batch, PUT upload, verify, NDJSON commit honouring
``parentCommit``), copies and deletions. Not implemented: dataset/space repos, tags, pull
requests, Xet, multipart LFS, pagination (everything comes in one page), CDN redirects (LFS
files are served directly, with the Hub's X-Linked-Etag/X-Linked-Size headers).

State lives in memory (repos, commits, branches, tokens) plus content-addressed blobs in a temporary
directory, so ``stop()`` then ``start()`` serves the same data on the same port.

Access rules (set with :meth:`FakeHub.add_token`):

* a token has a user name and two lists of repo-id patterns (``fnmatch``: ``"org/*"``, ``"*"``):
  ``read`` and ``write`` (write implies read);
* public repos are readable by anyone; private repos only with a token whose patterns match
  (otherwise ``RepoNotFound``: 401 without a token, 404 with one, as the Hub does);
* gated repos show their metadata to anyone, but file content needs a matching token
  (otherwise ``GatedRepo``: 401 without a token, 403 with one);
* writing (create repo in a namespace, branches, preupload, LFS, commit) needs a ``write`` match;
* a token that was never added gets 401 "Invalid credentials in Authorization header".

``huggingface_hub`` reads its environment (``HF_ENDPOINT``, ``HF_HUB_DISABLE_XET``,
``HF_HUB_OFFLINE``, cache paths) once, at import, and the root ``tests/conftest.py`` fixes them for
the whole test process. So to give the client other settings (a token, a cache, an endpoint), run it
in a fresh interpreter: :meth:`FakeHub.client_env` gives its
environment (usable for ``subprocess``), :class:`ClientProcess` runs functions in such a process.
"""

from __future__ import annotations

import asyncio
import base64
import fnmatch
import hashlib
import itertools
import json
import logging
import multiprocessing
import os
import re
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, ParamSpec, TypeVar
from urllib.parse import parse_qs, unquote

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

LFS_THRESHOLD = 10 * 1024 * 1024  # the Hub stores files from 10 MB on as LFS
_CHUNK = 1024 * 1024
_LFS_PATTERNS = (
    "*.bin",
    "*.ckpt",
    "*.gguf",
    "*.h5",
    "*.msgpack",
    "*.npy",
    "*.npz",
    "*.onnx",
    "*.pt",
    "*.pth",
    "*.safetensors",
    "*.tar.*",
    "*.zip",
)
DEFAULT_GITATTRIBUTES = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in _LFS_PATTERNS)
_INVALID_TOKEN = "Invalid credentials in Authorization header"

Gated = Literal[False, "auto", "manual"]
UploadFault = Literal["error", "drop"]
CommitFault = Literal["error", "drop", "lost_response"]
AuthState = Literal["none", "known", "unknown"]


# --------------------------------------------------------------------------------------------
# Data model
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FileEntry:
    """One file of a commit: a content-addressed blob plus what git shows for it."""

    sha256: str
    size: int
    lfs: bool
    git_oid: str  # sha1 of the git blob; for an LFS file, of its pointer file
    pointer_size: int = 0  # size of the LFS pointer file (LFS files only)


@dataclass(frozen=True)
class Commit:
    """An immutable snapshot: path -> file, with its parent and message."""

    oid: str
    parent: str | None
    title: str
    description: str
    author: str
    date: datetime
    files: Mapping[str, FileEntry]


@dataclass(frozen=True)
class LoggedRequest:
    """One request as the server saw it.

    ``auth``: no Authorization header, a configured token (then ``token`` is it) or an unknown one.
    ``range``: the Range header. ``status``: the status sent (0 if none). ``fault``: the injected
    fault it got, if any: "rate_limit", "outage", "error", "drop", "lost_response", "cut" or
    "hold".
    """

    method: str
    path: str
    query: str
    range: str | None
    auth: AuthState
    token: str | None
    status: int
    fault: str | None


class HubError(Exception):
    """An error answered the way the Hub does: status, X-Error-Code and X-Error-Message."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(f"{status} {code or ''} {message}".strip())
        self.status = status
        self.message = message
        self.code = code
        self.headers = dict(headers or {})

    def to_response(self) -> Response:
        headers = {"X-Error-Message": self.message, **self.headers}
        if self.code is not None:
            headers["X-Error-Code"] = self.code
        return JSONResponse({"error": self.message}, status_code=self.status, headers=headers)


@dataclass
class _Repo:
    repo_id: str
    private: bool
    gated: Gated
    created_at: datetime
    branches: dict[str, str] = field(default_factory=dict)
    commits: dict[str, Commit] = field(default_factory=dict)
    lfs_objects: set[str] = field(default_factory=set)  # sha256s uploaded to this repo


@dataclass(frozen=True)
class _Token:
    value: str
    user: str
    read: tuple[str, ...]
    write: tuple[str, ...]

    def can_write(self, repo_id: str) -> bool:
        return any(fnmatch.fnmatchcase(repo_id, p) for p in self.write)

    def can_read(self, repo_id: str) -> bool:
        return self.can_write(repo_id) or any(fnmatch.fnmatchcase(repo_id, p) for p in self.read)


def _now() -> datetime:
    return datetime.now(UTC)


def _iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def _git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _lfs_pointer(sha256: str, size: int) -> bytes:
    return (
        f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()
    )


def _lfs_patterns(gitattributes: str) -> list[str]:
    return [
        line.split()[0]
        for line in gitattributes.splitlines()
        if line.strip() and not line.startswith("#") and "filter=lfs" in line.split()[1:]
    ]


def _matches(path: str, pattern: str) -> bool:
    target = path if "/" in pattern else path.rsplit("/", 1)[-1]
    return fnmatch.fnmatchcase(target, pattern)


def wants_lfs(path: str, size: int, sample: bytes, patterns: Iterable[str]) -> bool:
    """The Hub's rule: LFS if .gitattributes says so, if 10 MB or more, or if binary."""
    return size >= LFS_THRESHOLD or b"\0" in sample or any(_matches(path, p) for p in patterns)


def _check_path(path: str) -> str:
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise HubError(400, f"Invalid path in repo: {path!r}")
    return path


# --------------------------------------------------------------------------------------------
# Storage: repos, commits, blobs, tokens (thread-safe; shared by the HTTP thread and tests)
# --------------------------------------------------------------------------------------------


class _Store:
    def __init__(self, root: Path) -> None:
        self.lock = threading.RLock()
        self.repos: dict[str, _Repo] = {}
        self.tokens: dict[str, _Token] = {}
        self.bytes_served: Counter[tuple[str, str]] = Counter()
        self._blobs = root / "blobs"
        self._blobs.mkdir(parents=True, exist_ok=True)
        self._nonce = itertools.count()

    def clear(self) -> None:
        with self.lock:
            self.repos.clear()
            self.tokens.clear()
            self.bytes_served.clear()

    # blobs -------------------------------------------------------------------------------
    def blob_path(self, sha256: str) -> Path:
        return self._blobs / sha256

    def has_blob(self, sha256: str) -> bool:
        return self.blob_path(sha256).exists()

    def put_blob(self, data: bytes) -> str:
        sha256 = hashlib.sha256(data).hexdigest()
        path = self.blob_path(sha256)
        if not path.exists():
            tmp = path.with_name(f"{sha256}.{threading.get_ident()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return sha256

    def read_blob(self, sha256: str) -> bytes:
        return self.blob_path(sha256).read_bytes()

    # files -------------------------------------------------------------------------------
    def lfs_patterns(self, files: Mapping[str, FileEntry]) -> list[str]:
        entry = files.get(".gitattributes")
        return _lfs_patterns(self.read_blob(entry.sha256).decode()) if entry else []

    def add_file(self, data: bytes, *, lfs: bool) -> FileEntry:
        sha256 = self.put_blob(data)
        if not lfs:
            return FileEntry(sha256, len(data), False, _git_blob_oid(data))
        return self.lfs_entry(sha256, len(data))

    @staticmethod
    def lfs_entry(sha256: str, size: int) -> FileEntry:
        pointer = _lfs_pointer(sha256, size)
        return FileEntry(sha256, size, True, _git_blob_oid(pointer), len(pointer))

    # repos -------------------------------------------------------------------------------
    def repo(self, repo_id: str) -> _Repo:
        with self.lock:
            repo = self.repos.get(repo_id)
        if repo is None:
            raise HubError(404, "Repository not found", "RepoNotFound")
        return repo

    def create_repo(self, repo_id: str, *, private: bool, gated: Gated, author: str) -> _Repo:
        with self.lock:
            if repo_id in self.repos:
                raise HubError(409, "You already created this model repo")
            repo = _Repo(repo_id, private, gated, _now())
            self.repos[repo_id] = repo
            attributes = self.add_file(DEFAULT_GITATTRIBUTES.encode(), lfs=False)
            self.add_commit(
                repo, "main", {".gitattributes": attributes}, "initial commit", "", author
            )
            return repo

    def resolve(self, repo: _Repo, revision: str) -> Commit:
        with self.lock:
            oid = repo.branches.get(revision) or (revision if revision in repo.commits else None)
            if oid is None:
                raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
            return repo.commits[oid]

    def add_commit(
        self,
        repo: _Repo,
        branch: str,
        files: Mapping[str, FileEntry],
        title: str,
        description: str,
        author: str,
    ) -> Commit:
        with self.lock:
            parent = repo.branches.get(branch)
            date = _now()
            tree = sorted((p, e.git_oid) for p, e in files.items())
            nonce = next(self._nonce)  # two identical commits still get two ids
            identity = [repo.repo_id, parent, tree, title, description, author, _iso(date), nonce]
            oid = hashlib.sha1(json.dumps(identity).encode()).hexdigest()
            commit = Commit(oid, parent, title, description, author, date, dict(files))
            repo.commits[oid] = commit
            repo.branches[branch] = oid
            repo.lfs_objects.update(e.sha256 for e in files.values() if e.lfs)
            return commit

    def history(self, repo: _Repo, revision: str) -> list[Commit]:
        with self.lock:
            commit: Commit | None = self.resolve(repo, revision)
            chain: list[Commit] = []
            while commit is not None:
                chain.append(commit)
                commit = repo.commits[commit.parent] if commit.parent else None
            return chain


# --------------------------------------------------------------------------------------------
# Fault injection
# --------------------------------------------------------------------------------------------


@dataclass
class UploadHold:
    """An LFS upload the hub keeps waiting: ``reached`` is set when it arrives; after
    ``release()`` its connection is dropped, so that upload never lands."""

    reached: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        self.released.set()


class _Faults:
    """One-shot faults, each consumed by the next request it applies to."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rate_limited = 0
        self._retry_after = 1
        self._uploads: list[UploadFault] = []
        self._commits: list[CommitFault] = []
        self._downloads: list[int] = []
        self._outages: list[int] = []
        self._holds: list[UploadHold] = []

    def clear(self) -> None:
        with self._lock:
            for hold in self._holds:
                hold.release()
            self._holds.clear()
            self._rate_limited = 0
            self._outages.clear()
            self._uploads.clear()
            self._commits.clear()
            self._downloads.clear()

    def rate_limit(self, n: int, retry_after: int) -> None:
        with self._lock:
            self._rate_limited, self._retry_after = n, retry_after

    def add_uploads(self, mode: UploadFault, n: int) -> None:
        with self._lock:
            self._uploads.extend([mode] * n)

    def add_commits(self, mode: CommitFault, n: int) -> None:
        with self._lock:
            self._commits.extend([mode] * n)

    def add_downloads(self, after_bytes: int, n: int) -> None:
        with self._lock:
            self._downloads.extend([after_bytes] * n)

    def take_rate_limit(self) -> int | None:
        """The Retry-After to answer with, or None if this request is not rate-limited."""
        with self._lock:
            if self._rate_limited <= 0:
                return None
            self._rate_limited -= 1
            return self._retry_after

    def add_hold(self, hold: UploadHold) -> None:
        with self._lock:
            self._holds.append(hold)

    def take_hold(self) -> UploadHold | None:
        with self._lock:
            return self._holds.pop(0) if self._holds else None

    def take_upload(self) -> UploadFault | None:
        with self._lock:
            return self._uploads.pop(0) if self._uploads else None

    def take_commit(self) -> CommitFault | None:
        with self._lock:
            return self._commits.pop(0) if self._commits else None

    def take_download(self) -> int | None:
        with self._lock:
            return self._downloads.pop(0) if self._downloads else None

    def add_outage(self, status: int, n: int) -> None:
        with self._lock:
            self._outages.extend([status] * n)

    def take_outage(self) -> int | None:
        with self._lock:
            return self._outages.pop(0) if self._outages else None


class _DropConnection(Exception):
    """Raised inside the app after the response started: uvicorn then closes the socket."""


class _QuietDrops(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], _DropConnection))


def _install_quiet_drops() -> None:
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _QuietDrops) for f in logger.filters):
        logger.addFilter(_QuietDrops())


class _Dropped(Response):
    """Announces a body, sends none of it and closes the connection (a killed server)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-length", str(_CHUNK).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        raise _DropConnection


class _BlobResponse(Response):
    """Streams a byte range of a blob, counting what is sent; ``cut_after`` drops it midway."""

    def __init__(
        self,
        path: Path,
        span: tuple[int, int],
        status: int,
        headers: Mapping[str, str],
        *,
        head: bool,
        on_sent: Callable[[int], None],
        cut_after: int | None,
    ) -> None:
        super().__init__(status_code=status, headers=dict(headers))
        self._path, self._span, self._head = path, span, head
        self._on_sent, self._cut_after = on_sent, cut_after

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        if not self._head:
            await self._stream(send)
        await send({"type": "http.response.body", "body": b""})

    async def _stream(self, send: Send) -> None:
        start, end = self._span
        length = end - start + 1
        remaining = length if self._cut_after is None else min(length, self._cut_after)
        with self._path.open("rb") as blob:
            blob.seek(start)
            while remaining > 0:
                chunk = blob.read(min(_CHUNK, remaining))
                self._on_sent(len(chunk))  # counted first: the client may return right after
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                remaining -= len(chunk)
        if self._cut_after is not None and self._cut_after < length:
            raise _DropConnection


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(first, last) byte of a single ``bytes=`` range, None to send everything."""
    match = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", header or "")
    if match is None or match.groups() == ("", ""):
        return None
    first, last = match.groups()
    if first:
        start, end = int(first), min(int(last), size - 1) if last else size - 1
    else:
        start, end = max(size - int(last), 0), size - 1
    if start >= size or start > end or (not first and int(last) == 0):
        raise HubError(
            416, "Requested Range Not Satisfiable", headers={"Content-Range": f"bytes */{size}"}
        )
    return start, end


# --------------------------------------------------------------------------------------------
# JSON shapes the client parses
# --------------------------------------------------------------------------------------------


def _file_json(path: str, entry: FileEntry) -> dict[str, Any]:
    item: dict[str, Any] = {"type": "file", "oid": entry.git_oid, "size": entry.size, "path": path}
    if entry.lfs:
        item["lfs"] = {"oid": entry.sha256, "size": entry.size, "pointerSize": entry.pointer_size}
    return item


def _directories(files: Iterable[str]) -> set[str]:
    return {path.rsplit("/", n)[0] for path in files for n in range(1, path.count("/") + 1)}


def _dir_json(path: str, files: Mapping[str, FileEntry]) -> dict[str, Any]:
    inside = sorted((p, e.git_oid) for p, e in files.items() if p.startswith(f"{path}/"))
    oid = hashlib.sha1(json.dumps(inside).encode()).hexdigest()
    return {"type": "directory", "oid": oid, "size": 0, "path": path}


def _tree_json(files: Mapping[str, FileEntry], base: str, recursive: bool) -> list[dict[str, Any]]:
    directories = _directories(files)
    if base and base not in directories:
        raise HubError(404, f"Entry not found: {base}", "EntryNotFound")
    prefix = f"{base}/" if base else ""

    def listed(path: str) -> bool:
        return path.startswith(prefix) and (recursive or "/" not in path[len(prefix) :])

    items = [_dir_json(d, files) for d in sorted(directories) if listed(d)]
    return items + [_file_json(p, e) for p, e in sorted(files.items()) if listed(p)]


def _sibling_json(path: str, entry: FileEntry, blobs: bool) -> dict[str, Any]:
    if not blobs:
        return {"rfilename": path}
    item: dict[str, Any] = {"rfilename": path, "size": entry.size, "blobId": entry.git_oid}
    if entry.lfs:
        item["lfs"] = {
            "size": entry.size,
            "sha256": entry.sha256,
            "pointerSize": entry.pointer_size,
        }
    return item


def _model_info_json(repo: _Repo, commit: Commit, blobs: bool) -> dict[str, Any]:
    return {
        "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
        "id": repo.repo_id,
        "modelId": repo.repo_id,
        "author": repo.repo_id.split("/")[0],
        "sha": commit.oid,
        "lastModified": _iso(commit.date),
        "createdAt": _iso(repo.created_at),
        "private": repo.private,
        "gated": repo.gated,
        "disabled": False,
        "downloads": 0,
        "likes": 0,
        "tags": [],
        "siblings": [_sibling_json(p, e, blobs) for p, e in sorted(commit.files.items())],
        "usedStorage": sum(e.size for e in commit.files.values()),
    }


def _commit_json(commit: Commit) -> dict[str, Any]:
    return {
        "id": commit.oid,
        "title": commit.title,
        "message": commit.description,
        "date": _iso(commit.date),
        "authors": [{"user": commit.author, "avatar": None}],
    }


def _ref_json(kind: str, name: str, oid: str) -> dict[str, str]:
    return {"name": name, "ref": f"refs/{kind}/{name}", "targetCommit": oid}


# --------------------------------------------------------------------------------------------
# HTTP application
# --------------------------------------------------------------------------------------------


@dataclass
class _Call:
    request: Request
    params: dict[str, str]
    token: _Token | None
    fault: str | None = None

    @property
    def repo_id(self) -> str:
        return self.params["repo"]

    @property
    def anonymous(self) -> bool:
        return self.token is None


Handler = Callable[[_Call], Awaitable[Response]]
_REPO = r"(?P<repo>[^/]+/[^/]+?)"
_REV = r"(?P<rev>[^/]+)"


@dataclass(frozen=True)
class _Route:
    methods: frozenset[str]
    pattern: re.Pattern[str]
    handler: Handler
    housekeeping: bool = False  # never rate-limited nor refused for a bad token


async def _json_body(request: Request) -> Any:
    body = await request.body()
    try:
        return json.loads(body) if body else {}
    except json.JSONDecodeError as exc:
        raise HubError(400, f"Invalid JSON body: {exc}") from exc


class _HubApp:
    """The ASGI application: routes on the raw (still percent-encoded) path, like the Hub."""

    def __init__(
        self, store: _Store, faults: _Faults, base_url: Callable[[], str], lfs_verify: bool
    ) -> None:
        self._store, self._faults, self._base_url = store, faults, base_url
        self.lfs_verify = lfs_verify
        self.log: list[LoggedRequest] = []
        self.log_lock = threading.Lock()
        api = r"/api/models/" + _REPO
        self._routes = [
            self._route("GET", api, self._model_info),
            self._route("GET", rf"{api}/revision/{_REV}", self._model_info),
            self._route("GET", rf"{api}/tree/{_REV}(?:/(?P<path>.+))?", self._tree),
            self._route("GET", rf"{api}/refs", self._refs),
            self._route("GET", rf"{api}/commits/{_REV}", self._commits),
            self._route("POST", rf"{api}/paths-info/{_REV}", self._paths_info),
            self._route("POST DELETE", rf"{api}/branch/(?P<branch>[^/]+)", self._branch),
            self._route("POST", rf"{api}/preupload/{_REV}", self._preupload),
            self._route("POST", rf"{api}/commit/{_REV}", self._commit),
            self._route("POST", r"/api/repos/create", self._create_repo),
            self._route("GET", r"/api/whoami-v2", self._whoami),
            self._route("POST", r"/api/validate-yaml", self._validate_yaml),
            self._route("GET", r"/api/agent-harnesses", self._agent_harnesses, housekeeping=True),
            self._route("POST", rf"/{_REPO}\.git/info/lfs/objects/batch", self._lfs_batch),
            self._route("POST", rf"/{_REPO}\.git/info/lfs/objects/verify", self._lfs_verify),
            self._route("PUT", rf"/_fakehub/lfs/{_REPO}/(?P<oid>[0-9a-f]{{64}})", self._lfs_upload),
            self._route("GET HEAD", rf"/{_REPO}/resolve/{_REV}/(?P<path>.+)", self._resolve),
        ]

    @staticmethod
    def _route(
        methods: str, pattern: str, handler: Handler, *, housekeeping: bool = False
    ) -> _Route:
        return _Route(frozenset(methods.split()), re.compile(pattern), handler, housekeeping)

    # ASGI ---------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        auth, token = self._authenticate(request)
        call = _Call(request, {}, token)
        recorded = False

        async def recording_send(message: Message) -> None:
            # Logged before the client can see the answer, so tests never miss the last request.
            nonlocal recorded
            if message["type"] == "http.response.start" and not recorded:
                recorded = True
                self._record(request, auth, token, message["status"], call.fault)
            await send(message)

        try:
            response = await self._respond(call, auth)
            await response(scope, receive, recording_send)
        finally:
            if not recorded:
                self._record(request, auth, token, 0, call.fault)

    def _authenticate(self, request: Request) -> tuple[AuthState, _Token | None]:
        header = request.headers.get("authorization")
        if not header:
            return "none", None
        value = header.removeprefix("Bearer ").strip()
        with self._store.lock:
            token = self._store.tokens.get(value)
        return ("known", token) if token else ("unknown", None)

    def _record(
        self,
        request: Request,
        auth: AuthState,
        token: _Token | None,
        status: int,
        fault: str | None,
    ) -> None:
        entry = LoggedRequest(
            method=request.method,
            path=request.url.path,
            query=request.url.query,
            range=request.headers.get("range"),
            auth=auth,
            token=token.value if token else None,
            status=status,
            fault=fault,
        )
        with self.log_lock:
            self.log.append(entry)

    async def _respond(self, call: _Call, auth: AuthState) -> Response:
        raw_path = call.request.scope.get("raw_path") or call.request.scope["path"].encode()
        path = raw_path.decode("latin-1").split("?", 1)[0]
        route, params = self._match(call.request.method, path)
        housekeeping = route is not None and route.housekeeping
        if auth == "unknown" and not housekeeping:
            return HubError(401, _INVALID_TOKEN).to_response()
        if not housekeeping and (status := self._faults.take_outage()) is not None:
            call.fault = "outage"
            return HubError(status, f"Service unavailable (injected {status})").to_response()
        if not housekeeping and (retry_after := self._faults.take_rate_limit()) is not None:
            call.fault = "rate_limit"
            headers = {"Retry-After": str(retry_after)}
            return HubError(429, "Too Many Requests (injected)", headers=headers).to_response()
        if route is None:
            return HubError(404 if params is None else 405, "Not Found").to_response()
        call.params = params or {}
        try:
            return await route.handler(call)
        except HubError as exc:
            return exc.to_response()

    def _match(self, method: str, path: str) -> tuple[_Route | None, dict[str, str] | None]:
        """The route and its unquoted parameters; (None, {}) if only the method is wrong."""
        path_matched = False
        for route in self._routes:
            match = route.pattern.fullmatch(path)
            if match is None:
                continue
            path_matched = True
            if method in route.methods:
                return route, {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
        return None, ({} if path_matched else None)

    # access -------------------------------------------------------------------------------
    def _readable(self, call: _Call, *, content: bool = False) -> _Repo:
        try:
            repo = self._store.repo(call.repo_id)
        except HubError:
            raise self._not_found(call) from None
        allowed = call.token is not None and call.token.can_read(repo.repo_id)
        if repo.private and not allowed:
            raise self._not_found(call)
        if content and repo.gated and not allowed:
            message = f"Access to model {repo.repo_id} is restricted. You must have access to it."
            raise HubError(401 if call.anonymous else 403, message, "GatedRepo")
        return repo

    def _writable(self, call: _Call) -> _Repo:
        repo = self._readable(call)
        if call.token is None or not call.token.can_write(repo.repo_id):
            message = f"You don't have the rights to write to {repo.repo_id}"
            raise HubError(401 if call.anonymous else 403, message)
        return repo

    @staticmethod
    def _not_found(call: _Call) -> HubError:
        return HubError(401 if call.anonymous else 404, "Repository not found", "RepoNotFound")

    # read endpoints -----------------------------------------------------------------------
    async def _model_info(self, call: _Call) -> Response:
        repo = self._readable(call)
        commit = self._store.resolve(repo, call.params.get("rev", "main"))
        blobs = call.request.query_params.get("blobs", "").lower() in ("1", "true")
        return JSONResponse(_model_info_json(repo, commit, blobs))

    async def _tree(self, call: _Call) -> Response:
        repo = self._readable(call)
        commit = self._store.resolve(repo, call.params["rev"])
        recursive = call.request.query_params.get("recursive", "").lower() in ("1", "true")
        return JSONResponse(
            _tree_json(commit.files, call.params.get("path", "").strip("/"), recursive)
        )

    async def _refs(self, call: _Call) -> Response:
        repo = self._readable(call)
        with self._store.lock:
            branches = [
                _ref_json("heads", name, oid) for name, oid in sorted(repo.branches.items())
            ]
        return JSONResponse({"branches": branches, "converts": [], "tags": [], "pullRequests": []})

    async def _commits(self, call: _Call) -> Response:
        repo = self._readable(call)
        history = self._store.history(repo, call.params["rev"])
        return JSONResponse([_commit_json(c) for c in history])

    async def _paths_info(self, call: _Call) -> Response:
        repo = self._readable(call)
        files = self._store.resolve(repo, call.params["rev"]).files
        form = parse_qs((await call.request.body()).decode())
        directories = _directories(files)
        items = []
        for path in (p.strip("/") for p in form.get("paths", [])):
            if path in files:
                items.append(_file_json(path, files[path]))
            elif path in directories:
                items.append(_dir_json(path, files))
        return JSONResponse(items)

    async def _resolve(self, call: _Call) -> Response:
        repo = self._readable(call, content=True)
        commit = self._store.resolve(repo, call.params["rev"])
        path = call.params["path"]
        entry = commit.files.get(path)
        if entry is None:
            headers = {"X-Repo-Commit": commit.oid}
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound", headers)
        span = _parse_range(call.request.headers.get("range"), entry.size)
        first, last = span or (0, entry.size - 1)
        headers = {
            "X-Repo-Commit": commit.oid,
            "ETag": f'"{entry.sha256 if entry.lfs else entry.git_oid}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
            "Content-Length": str(last - first + 1),
        }
        if entry.lfs:
            headers |= {"X-Linked-Etag": f'"{entry.sha256}"', "X-Linked-Size": str(entry.size)}
        if span is not None:
            headers["Content-Range"] = f"bytes {first}-{last}/{entry.size}"
        head = call.request.method == "HEAD"
        cut_after = None if head else self._faults.take_download()
        if cut_after is not None:
            call.fault = "cut"

        def on_sent(n: int) -> None:
            with self._store.lock:
                self._store.bytes_served[(repo.repo_id, path)] += n

        return _BlobResponse(
            self._store.blob_path(entry.sha256),
            (first, last),
            206 if span else 200,
            headers,
            head=head,
            on_sent=on_sent,
            cut_after=cut_after,
        )

    async def _whoami(self, call: _Call) -> Response:
        if call.token is None:
            raise HubError(401, "Invalid username or password.")
        role = "write" if call.token.write else "read"
        auth = {"type": "access_token", "accessToken": {"displayName": "fakehub", "role": role}}
        return JSONResponse({"type": "user", "name": call.token.user, "orgs": [], "auth": auth})

    async def _validate_yaml(self, call: _Call) -> Response:
        return JSONResponse({"errors": [], "warnings": []})

    async def _agent_harnesses(self, call: _Call) -> Response:
        return JSONResponse({"standardEnvVars": [], "harnesses": {}})

    # write endpoints ----------------------------------------------------------------------
    async def _create_repo(self, call: _Call) -> Response:
        body = await _json_body(call.request)
        if call.token is None:
            raise HubError(401, "You must be authenticated to create a repo")
        if (body.get("type") or "model") != "model":
            raise HubError(400, "FakeHub only hosts model repos")
        repo_id = f"{body.get('organization') or call.token.user}/{body['name']}"
        if not call.token.can_write(repo_id):
            raise HubError(403, f"You don't have the rights to create a model under {repo_id}")
        private = body.get("visibility") == "private" or body.get("private") is True
        url = f"{self._base_url()}/{repo_id}"
        try:
            self._store.create_repo(repo_id, private=private, gated=False, author=call.token.user)
        except HubError as exc:
            return JSONResponse({"error": exc.message, "url": url}, status_code=exc.status)
        return JSONResponse({"url": url, "name": repo_id, "id": repo_id})

    async def _branch(self, call: _Call) -> Response:
        repo = self._writable(call)
        branch = call.params["branch"]
        body = await _json_body(call.request)
        with self._store.lock:
            if call.request.method == "DELETE":
                if repo.branches.pop(branch, None) is None:
                    raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
                return JSONResponse({})
            start = self._store.resolve(repo, body.get("startingPoint") or "main")
            if branch in repo.branches:
                raise HubError(409, f"Reference already exists: refs/heads/{branch}")
            repo.branches[branch] = start.oid
        return JSONResponse({})

    async def _preupload(self, call: _Call) -> Response:
        repo = self._writable(call)
        commit = self._store.resolve(repo, call.params["rev"])
        patterns = self._store.lfs_patterns(commit.files)
        body = await _json_body(call.request)
        answers = []
        for item in body.get("files", []):
            path, size = _check_path(item["path"]), int(item["size"])
            lfs = wants_lfs(path, size, base64.b64decode(item.get("sample", "")), patterns)
            answer: dict[str, Any] = {
                "path": path,
                "uploadMode": "lfs" if lfs else "regular",
                "shouldIgnore": False,
            }
            if (existing := commit.files.get(path)) is not None:
                answer["oid"] = existing.sha256 if existing.lfs else existing.git_oid
            answers.append(answer)
        return JSONResponse({"files": answers, "commitOid": commit.oid})

    async def _lfs_batch(self, call: _Call) -> Response:
        repo = self._writable(call)
        body = await _json_body(call.request)
        if body.get("operation") != "upload":
            raise HubError(400, "FakeHub's LFS batch endpoint only handles uploads")
        objects = [
            self._batch_object(repo, str(o["oid"]), int(o["size"])) for o in body.get("objects", [])
        ]
        return JSONResponse({"transfer": "basic", "objects": objects, "hash_algo": "sha256"})

    def _batch_object(self, repo: _Repo, oid: str, size: int) -> dict[str, Any]:
        item: dict[str, Any] = {"oid": oid, "size": size}
        with self._store.lock:
            present = oid in repo.lfs_objects and self._store.has_blob(oid)
        if present:
            return item  # no actions: "already uploaded"
        base = self._base_url()
        actions: dict[str, Any] = {"upload": {"href": f"{base}/_fakehub/lfs/{repo.repo_id}/{oid}"}}
        if self.lfs_verify:
            actions["verify"] = {"href": f"{base}/{repo.repo_id}.git/info/lfs/objects/verify"}
        return item | {"authenticated": True, "actions": actions}

    async def _lfs_upload(self, call: _Call) -> Response:
        repo = self._store.repo(call.repo_id)  # a pre-signed URL: no token needed
        oid = call.params["oid"]
        if (hold := self._faults.take_hold()) is not None:
            call.fault = "hold"
            hold.reached.set()
            # Held until the test releases it: a thread's Event, polled so the loop serves others.
            while not hold.released.is_set():
                await asyncio.sleep(0.02)
            return _Dropped()
        fault = self._faults.take_upload()
        if fault is not None:
            call.fault = fault
            if fault == "error":
                raise HubError(500, "Injected upload failure")
            return await self._drop_mid_upload(call.request)
        data = await call.request.body()
        if hashlib.sha256(data).hexdigest() != oid:
            raise HubError(400, "Uploaded content does not match its sha256")
        self._store.put_blob(data)
        with self._store.lock:
            repo.lfs_objects.add(oid)
        return Response(status_code=200, headers={"ETag": f'"{hashlib.md5(data).hexdigest()}"'})

    @staticmethod
    async def _drop_mid_upload(request: Request) -> Response:
        """Read about half of the upload, then the connection "dies"."""
        expected = int(request.headers.get("content-length", "0"))
        received = 0
        async for chunk in request.stream():
            received += len(chunk)
            if received * 2 >= expected:
                break
        return _Dropped()

    async def _lfs_verify(self, call: _Call) -> Response:
        repo = self._writable(call)
        body = await _json_body(call.request)
        with self._store.lock:
            present = body.get("oid") in repo.lfs_objects
        if not present:
            raise HubError(404, f"LFS object {body.get('oid')} was not uploaded")
        return JSONResponse({"success": True})

    async def _commit(self, call: _Call) -> Response:
        repo = self._writable(call)
        branch = call.params["rev"]
        if call.request.query_params.get("create_pr"):
            raise HubError(400, "FakeHub does not support pull requests")
        body = await call.request.body()
        lines: list[dict[str, Any]] = [
            json.loads(line) for line in body.splitlines() if line.strip()
        ]
        header: dict[str, Any] = next((x["value"] for x in lines if x.get("key") == "header"), {})
        fault = self._faults.take_commit()
        call.fault = fault
        if fault == "error":
            raise HubError(500, "Injected commit failure")
        if fault == "drop":
            return _Dropped()
        commit = self._apply_commit(repo, branch, header, lines, call.token)
        if fault == "lost_response":
            return _Dropped()
        url = f"{self._base_url()}/{repo.repo_id}/commit/{commit.oid}"
        return JSONResponse(
            {"success": True, "commitOid": commit.oid, "commitUrl": url, "hookOutput": ""}
        )

    def _apply_commit(
        self,
        repo: _Repo,
        branch: str,
        header: Mapping[str, Any],
        lines: list[dict[str, Any]],
        token: _Token | None,
    ) -> Commit:
        with self._store.lock:
            if branch not in repo.branches:
                raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
            head = repo.commits[repo.branches[branch]]
            parent = header.get("parentCommit")
            if parent and not head.oid.startswith(parent.lower()):
                raise HubError(412, "A commit has happened since. Please refresh and try again.")
            files = dict(head.files)
            for line in lines:
                self._apply_operation(repo, files, line.get("key", ""), line.get("value", {}))
            author = token.user if token else "anonymous"
            title, description = header.get("summary") or "Update", header.get("description") or ""
            return self._store.add_commit(repo, branch, files, title, description, author)

    def _apply_operation(
        self, repo: _Repo, files: dict[str, FileEntry], key: str, value: Mapping[str, Any]
    ) -> None:
        if key == "header":
            return
        path = _check_path(str(value.get("path", "")).strip("/"))
        if key == "file":
            files[path] = self._store.add_file(base64.b64decode(value["content"]), lfs=False)
        elif key == "lfsFile":
            oid = str(value["oid"])
            if oid not in repo.lfs_objects or not self._store.has_blob(oid):
                raise HubError(400, f"LFS object {oid} for {path} was never uploaded")
            files[path] = self._store.lfs_entry(oid, self._store.blob_path(oid).stat().st_size)
        elif key == "deletedFile":
            if files.pop(path, None) is None:
                raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
        elif key == "deletedFolder":
            for name in [p for p in files if p.startswith(f"{path}/")]:
                del files[name]
        else:
            raise HubError(400, f"Unknown commit operation {key!r}")


# --------------------------------------------------------------------------------------------
# Public facade
# --------------------------------------------------------------------------------------------


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


class FakeHub:
    """A Hub-compatible server on 127.0.0.1 in a background thread, with test helpers.

    Lifecycle: ``start()`` (binds a free port the first time, the same port afterwards), ``stop()``
    (the port refuses connections; data is kept), ``close()`` (stop and delete the data), and use as
    a context manager. ``reset()`` forgets repos, tokens, faults and the request log.

    Helpers (Python, not HTTP): ``create_repo``, ``commit``, ``create_branch``, ``move_branch``,
    ``update_repo``, ``head``, ``branches``, ``files``, ``file``, ``entries``, ``commits``,
    ``add_token``. Observation: ``requests``, ``clear_requests``, ``bytes_served``.
    Faults: ``rate_limit``, ``fail_uploads``, ``hold_upload``, ``fail_commits``,
    ``fail_requests``, ``fail_downloads``.
    """

    def __init__(self, *, port: int = 0, lfs_verify: bool = True) -> None:
        self._host = "127.0.0.1"
        self._port = port
        self._tmp = tempfile.TemporaryDirectory(prefix="fakehub-")
        self._store = _Store(Path(self._tmp.name))
        self._faults = _Faults()
        self._app = _HubApp(self._store, self._faults, lambda: self.url, lfs_verify)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    # lifecycle ----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The endpoint, e.g. ``http://127.0.0.1:54321`` (what ``HF_ENDPOINT`` must be)."""
        if not self._port:
            raise RuntimeError("FakeHub has no port until started")
        return f"http://{self._host}:{self._port}"

    @property
    def port(self) -> int:
        return self._port

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> FakeHub:
        if self._server is not None:
            return self
        _install_quiet_drops()
        sock = _bind(self._host, self._port)
        self._port = sock.getsockname()[1]
        config = uvicorn.Config(
            self._app,
            log_config=None,
            log_level=None,
            access_log=False,
            lifespan="off",
            timeout_keep_alive=60,
            timeout_graceful_shutdown=2,
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.name = f"fakehub-{self._port}"
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                sock.close()
                raise RuntimeError(f"FakeHub failed to start on port {self._port}")
            time.sleep(0.01)
        self._server, self._thread = server, thread
        return self

    def stop(self) -> None:
        """Stop serving (connections are refused); repos and blobs are kept for ``start()``."""
        if self._server is None or self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout=15)
        self._server, self._thread = None, None

    def close(self) -> None:
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def reset(self) -> None:
        """Forget every repo, token, fault, log entry and counter (the server keeps running)."""
        self._store.clear()
        self._faults.clear()
        self.clear_requests()

    # client environment -------------------------------------------------------------------
    def client_env(
        self, home: str | Path, *, token: str | None = None, base: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        """A complete environment for a process running ``huggingface_hub`` against this hub.

        ``base`` (default ``os.environ``) is copied; Hub settings are overridden (``HF_ENDPOINT``,
        ``HF_HUB_DISABLE_XET=1``, ``HF_HUB_OFFLINE=0``, ``HF_HOME``/``HF_HUB_CACHE`` under
        ``home``, telemetry/progress bars off) and any Hub token removed, then ``HF_TOKEN`` set
        if ``token`` is given.
        """
        env = dict(os.environ if base is None else base)
        for name in list(env):
            if (
                name.startswith(("HF_", "HUGGINGFACE_", "HUGGING_FACE_"))
                or name == "TRANSFORMERS_OFFLINE"
            ):
                del env[name]
        home = Path(home)
        no_proxy = ",".join(filter(None, [env.get("NO_PROXY"), "127.0.0.1", "localhost"]))
        env |= {
            "HF_ENDPOINT": self.url,
            "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_OFFLINE": "0",
            "HF_HOME": str(home),
            "HF_HUB_CACHE": str(home / "hub"),
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "HF_HUB_DISABLE_UPDATE_CHECK": "1",
            "NO_PROXY": no_proxy,
            "no_proxy": no_proxy,
        }
        if token is not None:
            env["HF_TOKEN"] = token
        return env

    # access -------------------------------------------------------------------------------
    def add_token(
        self, token: str, *, user: str = "user", read: Iterable[str] = (), write: Iterable[str] = ()
    ) -> None:
        """Accept ``token`` (as ``user``). ``read``/``write``: repo-id patterns (fnmatch) it may
        read when private or gated / write (write implies read). Re-adding replaces it."""
        with self._store.lock:
            self._store.tokens[token] = _Token(token, user, tuple(read), tuple(write))

    # repos --------------------------------------------------------------------------------
    def create_repo(
        self, repo_id: str, *, private: bool = False, gated: bool | Gated = False
    ) -> str:
        """Create a repo with the Hub's "initial commit" (a .gitattributes); return its sha."""
        repo = self._store.create_repo(
            repo_id, private=private, gated=self._gated(gated), author="fakehub"
        )
        return repo.branches["main"]

    def update_repo(
        self, repo_id: str, *, private: bool | None = None, gated: bool | Gated | None = None
    ) -> None:
        repo = self._store.repo(repo_id)
        with self._store.lock:
            repo.private = repo.private if private is None else private
            repo.gated = repo.gated if gated is None else self._gated(gated)

    @staticmethod
    def _gated(gated: bool | Gated) -> Gated:
        return "manual" if gated is True else gated

    def commit(
        self,
        repo_id: str,
        files: Mapping[str, bytes | None],
        *,
        branch: str = "main",
        message: str = "Update files",
        description: str = "",
        author: str = "fakehub",
    ) -> str:
        """Commit ``files`` (path -> content, None deletes) on top of ``branch``; return the sha.
        Files become LFS by the Hub's rule (.gitattributes pattern, >= 10 MB or binary)."""
        repo = self._store.repo(repo_id)
        with self._store.lock:
            if branch not in repo.branches:
                raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
            tree = dict(self._store.resolve(repo, branch).files)
            patterns = self._store.lfs_patterns(tree)
            for path, data in files.items():
                if data is None:
                    del tree[path]
                else:
                    lfs = wants_lfs(path, len(data), data[:512], patterns)
                    tree[_check_path(path)] = self._store.add_file(data, lfs=lfs)
            return self._store.add_commit(repo, branch, tree, message, description, author).oid

    def create_branch(self, repo_id: str, branch: str, *, revision: str = "main") -> str:
        """Create ``branch`` at ``revision`` (a branch or a commit sha); return the sha."""
        repo = self._store.repo(repo_id)
        with self._store.lock:
            if branch in repo.branches:
                raise HubError(409, f"Reference already exists: refs/heads/{branch}")
            repo.branches[branch] = self._store.resolve(repo, revision).oid
            return repo.branches[branch]

    def move_branch(self, repo_id: str, branch: str, revision: str) -> None:
        """Point ``branch`` (which must exist) at ``revision``, e.g. an older commit."""
        repo = self._store.repo(repo_id)
        with self._store.lock:
            if branch not in repo.branches:
                raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
            repo.branches[branch] = self._store.resolve(repo, revision).oid

    def head(self, repo_id: str, branch: str = "main") -> str:
        return self._store.resolve(self._store.repo(repo_id), branch).oid

    def is_private(self, repo_id: str) -> bool:
        with self._store.lock:
            return self._store.repo(repo_id).private

    def branches(self, repo_id: str) -> dict[str, str]:
        repo = self._store.repo(repo_id)
        with self._store.lock:
            return dict(repo.branches)

    def entries(self, repo_id: str, revision: str = "main") -> dict[str, FileEntry]:
        """Path -> FileEntry (sha256, size, lfs, git oid) at ``revision``."""
        return dict(self._store.resolve(self._store.repo(repo_id), revision).files)

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """Path -> content of every file at ``revision``."""
        return {
            p: self._store.read_blob(e.sha256) for p, e in self.entries(repo_id, revision).items()
        }

    def file(self, repo_id: str, path: str, revision: str = "main") -> bytes:
        return self._store.read_blob(self.entries(repo_id, revision)[path].sha256)

    def commits(self, repo_id: str, revision: str = "main") -> list[Commit]:
        """The history reachable from ``revision``, newest first (the initial commit last)."""
        return self._store.history(self._store.repo(repo_id), revision)

    # observation --------------------------------------------------------------------------
    @property
    def requests(self) -> list[LoggedRequest]:
        """Every request received so far, in order (a copy)."""
        with self._app.log_lock:
            return list(self._app.log)

    def clear_requests(self) -> None:
        with self._app.log_lock:
            self._app.log.clear()

    def bytes_served(self, repo_id: str, path: str) -> int:
        """Body bytes sent for ``path`` by GET /resolve (all revisions, ranges, cut responses)."""
        with self._store.lock:
            return self._store.bytes_served[(repo_id, path)]

    # faults -------------------------------------------------------------------------------
    def rate_limit(self, n: int = 1, *, retry_after: int = 1) -> None:
        """The next ``n`` requests get 429 with ``Retry-After: retry_after``."""
        self._faults.rate_limit(n, retry_after)

    def fail_uploads(self, n: int = 1, *, mode: UploadFault = "drop") -> None:
        """The next ``n`` LFS PUT uploads fail: "drop" reads half the body then closes the
        connection; "error" answers 500. (The client retries both, after 1 s, 2 s, ...)"""
        self._faults.add_uploads(mode, n)

    def hold_upload(self) -> UploadHold:
        """The next LFS PUT upload waits, unanswered, until the returned hold is released (then
        its connection is dropped): a publish that is deterministically mid-upload."""
        hold = UploadHold()
        self._faults.add_hold(hold)
        return hold

    def fail_commits(self, n: int = 1, *, mode: CommitFault = "error") -> None:
        """The next ``n`` commit POSTs fail: "error" (500, nothing committed), "drop" (connection
        closed, nothing committed), "lost_response" (committed, then the connection is closed)."""
        self._faults.add_commits(mode, n)

    def fail_requests(self, n: int = 1, *, status: int = 503) -> None:
        """The next ``n`` API or file requests answer ``status`` (an outage: 500, 502, 503)."""
        self._faults.add_outage(status, n)

    def fail_downloads(self, n: int = 1, *, after_bytes: int = 0) -> None:
        """The next ``n`` GET /resolve responses are cut after ``after_bytes`` body bytes."""
        self._faults.add_downloads(after_bytes, n)


# --------------------------------------------------------------------------------------------
# Running the client in a fresh interpreter
# --------------------------------------------------------------------------------------------

P = ParamSpec("P")
T = TypeVar("T")


def _enter_client_env(env: Mapping[str, str]) -> None:
    """Worker initializer: install the environment before anything imports huggingface_hub."""
    if "huggingface_hub" in sys.modules:
        raise RuntimeError("huggingface_hub was imported before its environment was set")
    os.environ.clear()
    os.environ.update(env)


class ClientProcess:
    """One spawned interpreter whose environment is ``env`` (see :meth:`FakeHub.client_env`).

    ``call(fn, *args)`` runs ``fn`` there and returns its result or raises its exception
    (``huggingface_hub`` errors pickle). ``fn`` must be a module-level function; its module may
    import ``huggingface_hub`` at the top: the child installs ``env`` before it unpickles ``fn``.
    """

    def __init__(self, env: Mapping[str, str], *, timeout: float = 120) -> None:
        self._timeout = timeout
        self._pool = ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_enter_client_env,
            initargs=(dict(env),),
        )

    def call(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._pool.submit(fn, *args, **kwargs).result(timeout=self._timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> ClientProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
