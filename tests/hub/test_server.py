"""The real ``huggingface_hub`` client against FakeHub.

``huggingface_hub`` reads ``HF_ENDPOINT``, ``HF_HUB_DISABLE_XET``, ``HF_HUB_OFFLINE`` and its
cache paths once, at import, and ``tests/conftest.py`` fixes them for the whole test process.
So the client runs in one spawned interpreter per module (``ClientProcess``) whose environment is
``FakeHub.client_env(...)``; the ``client_*`` functions below run there and return plain data.
This process only imports ``huggingface_hub.errors`` (which reads no setting) for the exceptions.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import httpx2
import pytest
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from tests.hub.server import ClientProcess, FakeHub

WRITER = "hf_writer"  # may write (and read) everything under org/
READER = "hf_reader"  # may read org/private and org/gated
OTHER = "hf_other"  # a valid token without any grant
BIG = 11 * 1024 * 1024  # above the 10 MB LFS threshold


# --- run in the client process ---------------------------------------------------------------


def client_upload_folder(repo_id: str, folder: str, message: str, token: str = WRITER) -> str:
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, exist_ok=True)
    return api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=message).oid


def client_commit(
    repo_id: str, files: dict[str, bytes], message: str, parent_commit: str | None = None
) -> str:
    from huggingface_hub import CommitOperationAdd, HfApi

    operations = [CommitOperationAdd(path, data) for path, data in files.items()]
    info = HfApi(token=WRITER).create_commit(
        repo_id, operations, commit_message=message, parent_commit=parent_commit
    )
    return info.oid


def client_tree(repo_id: str, revision: str) -> dict[str, tuple[str, int] | None]:
    """Path -> (lfs sha256, size) or None for a regular file."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    tree = HfApi().list_repo_tree(repo_id, revision=revision, recursive=True)
    return {
        f.path: (f.lfs.sha256, f.lfs.size) if f.lfs else None
        for f in tree
        if isinstance(f, RepoFile)
    }


def client_model_info(
    repo_id: str, revision: str | None = None, token: str | None = None
) -> dict[str, object]:
    from huggingface_hub import HfApi

    info = HfApi(token=token).model_info(repo_id, revision=revision)
    names = [s.rfilename for s in info.siblings or []]
    return {"sha": info.sha, "siblings": names, "private": info.private, "gated": info.gated}


def client_download(
    repo_id: str, filename: str, cache_dir: str, revision: str = "main", token: str | None = None
) -> bytes:
    from huggingface_hub import hf_hub_download

    path = hf_hub_download(
        repo_id, filename, revision=revision, cache_dir=cache_dir, token=token or False
    )
    return Path(path).read_bytes()


def client_snapshot(repo_id: str, cache_dir: str, allow_patterns: list[str]) -> list[str]:
    from huggingface_hub import snapshot_download

    root = Path(snapshot_download(repo_id, cache_dir=cache_dir, allow_patterns=allow_patterns))
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def client_refs_and_history(
    repo_id: str, branch: str, start: str
) -> tuple[dict[str, str], list[str]]:
    from huggingface_hub import HfApi

    api = HfApi(token=WRITER)
    api.create_branch(repo_id, branch=branch, revision=start)
    refs = {ref.name: ref.target_commit for ref in api.list_repo_refs(repo_id).branches}
    return refs, [c.title for c in api.list_repo_commits(repo_id, revision=branch)]


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[FakeHub]:
    with FakeHub() as hub:
        yield hub


@pytest.fixture(scope="module")
def client(server: FakeHub, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClientProcess]:
    with ClientProcess(server.client_env(tmp_path_factory.mktemp("hf_home"))) as process:
        yield process


@pytest.fixture
def hub(server: FakeHub) -> FakeHub:
    """The module's server, emptied, with the three tokens."""
    server.reset()
    server.add_token(WRITER, user="alice", write=["org/*"])
    server.add_token(READER, user="bob", read=["org/private", "org/gated"])
    server.add_token(OTHER, user="eve")
    return server


@pytest.fixture
def cache(tmp_path: Path) -> str:
    return str(tmp_path / "cache")


def _resolves(hub: FakeHub, method: str, repo_id: str) -> list[str]:
    """Files requested by ``method`` on /resolve, in order."""
    prefix = f"/{repo_id}/resolve/"
    return [
        r.path.split("/", 5)[-1]
        for r in hub.requests
        if r.method == method and r.path.startswith(prefix)
    ]


# --- tests ------------------------------------------------------------------------------------


def test_upload_folder_puts_large_binaries_in_lfs(
    hub: FakeHub, client: ClientProcess, tmp_path: Path
) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    weights = os.urandom(BIG)
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "config.json").write_text('{"num_hidden_layers": 2}')
    (folder / "tokenizer").mkdir()
    (folder / "tokenizer" / "tokenizer.json").write_text('{"version": "1.0"}')

    oid = client.call(client_upload_folder, "org/model", str(folder), "Add merged model")

    commits = hub.commits("org/model")
    assert [c.title for c in commits] == ["Add merged model", "initial commit"]
    assert commits[0].oid == oid == hub.head("org/model")
    assert hub.files("org/model") == {
        ".gitattributes": hub.file("org/model", ".gitattributes"),
        "config.json": b'{"num_hidden_layers": 2}',
        "model.safetensors": weights,
        "tokenizer/tokenizer.json": b'{"version": "1.0"}',
    }
    tree = client.call(client_tree, "org/model", "main")
    assert tree["model.safetensors"] == (hub.entries("org/model")["model.safetensors"].sha256, BIG)
    assert tree["config.json"] is None and tree["tokenizer/tokenizer.json"] is None
    assert client.call(client_model_info, "org/model", "main")["sha"] == oid
    puts = [r for r in hub.requests if r.method == "PUT"]
    assert len(puts) == 1 and puts[0].path.startswith("/_fakehub/lfs/org/model/")
    commit_posts = [r for r in hub.requests if r.path == "/api/models/org/model/commit/main"]
    assert [(r.status, r.token) for r in commit_posts] == [(200, WRITER)]


def test_uploading_an_unchanged_folder_makes_no_commit(
    hub: FakeHub, client: ClientProcess, tmp_path: Path
) -> None:
    (tmp_path / "adapter.safetensors").write_bytes(b"\x01\x02" * 100)  # LFS by .gitattributes
    (tmp_path / "config.json").write_text("{}")
    first = client.call(client_upload_folder, "org/small", str(tmp_path), "v1")
    assert hub.entries("org/small")["adapter.safetensors"].lfs
    hub.clear_requests()

    again = client.call(client_upload_folder, "org/small", str(tmp_path), "v1 again")

    assert again == first and len(hub.commits("org/small")) == 2
    assert not [r for r in hub.requests if r.method == "PUT" or "/commit/" in r.path]


def test_download_by_branch_and_by_commit_sha(
    hub: FakeHub, client: ClientProcess, cache: str
) -> None:
    hub.create_repo("org/m")
    weights = os.urandom(4096)
    sha = hub.commit("org/m", {"model.safetensors": weights, "config.json": b"{}"})

    assert client.call(client_download, "org/m", "model.safetensors", cache) == weights
    assert client.call(client_download, "org/m", "config.json", cache, revision=sha) == b"{}"
    heads = [r for r in hub.requests if r.method == "HEAD"]
    assert [r.path for r in heads] == [
        "/org/m/resolve/main/model.safetensors",
        f"/org/m/resolve/{sha}/config.json",
    ]
    assert hub.bytes_served("org/m", "model.safetensors") == len(weights)


def test_resolve_answers_range_requests(hub: FakeHub) -> None:
    hub.create_repo("org/r")
    data = bytes(range(256)) * 64
    sha = hub.commit("org/r", {"model.safetensors": data})
    entry = hub.entries("org/r")["model.safetensors"]
    url = f"{hub.url}/org/r/resolve/main/model.safetensors"

    head = httpx.head(url)
    assert head.headers["X-Repo-Commit"] == sha
    assert head.headers["ETag"] == head.headers["X-Linked-Etag"] == f'"{entry.sha256}"'
    assert head.headers["X-Linked-Size"] == head.headers["Content-Length"] == str(len(data))
    middle = httpx.get(url, headers={"Range": "bytes=100-199"})
    assert middle.status_code == 206 and middle.content == data[100:200]
    assert middle.headers["Content-Range"] == f"bytes 100-199/{len(data)}"
    tail = httpx.get(url, headers={"Range": "bytes=-10"})
    assert tail.status_code == 206 and tail.content == data[-10:]
    beyond = httpx.get(url, headers={"Range": f"bytes={len(data)}-"})
    assert beyond.status_code == 416 and beyond.headers["Content-Range"] == f"bytes */{len(data)}"
    assert [r.range for r in hub.requests if r.method == "GET"] == [
        "bytes=100-199",
        "bytes=-10",
        f"bytes={len(data)}-",
    ]


def test_a_cut_download_is_resumed_with_a_range(
    hub: FakeHub, client: ClientProcess, cache: str
) -> None:
    """The client keeps only whole 10 MiB read chunks: it resumes from the last chunk boundary."""
    mib = 1024 * 1024
    hub.create_repo("org/cut")
    weights = os.urandom(12 * mib)
    hub.commit("org/cut", {"model.safetensors": weights})
    hub.fail_downloads(1, after_bytes=11 * mib)

    assert client.call(client_download, "org/cut", "model.safetensors", cache) == weights
    gets = [r for r in hub.requests if r.method == "GET"]
    assert [(r.range, r.fault) for r in gets] == [(None, "cut"), (f"bytes={10 * mib}-", None)]
    assert hub.bytes_served("org/cut", "model.safetensors") == 11 * mib + 2 * mib


def test_moving_a_branch_changes_main_but_not_old_commits(
    hub: FakeHub, client: ClientProcess, cache: str
) -> None:
    hub.create_repo("org/moving")
    v1 = hub.commit("org/moving", {"config.json": b'{"v": 1}'}, message="v1")
    assert client.call(client_download, "org/moving", "config.json", cache) == b'{"v": 1}'
    v2 = hub.commit("org/moving", {"config.json": b'{"v": 2}'}, message="v2")

    assert client.call(client_download, "org/moving", "config.json", cache) == b'{"v": 2}'
    assert (
        client.call(client_download, "org/moving", "config.json", cache, revision=v1) == b'{"v": 1}'
    )
    hub.move_branch("org/moving", "main", v1)
    assert client.call(client_model_info, "org/moving", "main")["sha"] == v1
    assert client.call(client_download, "org/moving", "config.json", cache) == b'{"v": 1}'
    assert (
        client.call(client_download, "org/moving", "config.json", cache, revision=v2) == b'{"v": 2}'
    )


def test_snapshot_download_fetches_only_allowed_files(
    hub: FakeHub, client: ClientProcess, cache: str
) -> None:
    hub.create_repo("org/snap")
    files = {
        "model.safetensors": b"\0" * 64,
        "config.json": b"{}",
        "sub/extra.json": b"[]",
        "README.md": b"hi",
    }
    hub.commit("org/snap", files)

    assert client.call(client_snapshot, "org/snap", cache, ["*.json"]) == [
        "config.json",
        "sub/extra.json",
    ]
    assert sorted(_resolves(hub, "GET", "org/snap")) == ["config.json", "sub/extra.json"]
    assert hub.bytes_served("org/snap", "model.safetensors") == 0


def test_private_repo_needs_a_token_with_access(
    hub: FakeHub, client: ClientProcess, cache: str
) -> None:
    hub.create_repo("org/private", private=True)
    hub.commit("org/private", {"config.json": b"{}"})

    for token in (None, OTHER):
        with pytest.raises(RepositoryNotFoundError):
            client.call(client_model_info, "org/private", token=token)
        with pytest.raises(RepositoryNotFoundError):
            client.call(client_download, "org/private", "config.json", cache, token=token)
    with pytest.raises(HfHubHTTPError) as unknown:
        client.call(client_model_info, "org/private", token="hf_never_issued")
    assert unknown.value.response.status_code == 401
    assert not isinstance(unknown.value, RepositoryNotFoundError)

    assert client.call(client_model_info, "org/private", token=READER)["private"] is True
    assert client.call(client_download, "org/private", "config.json", cache, token=READER) == b"{}"
    seen = [(r.auth, r.token, r.status) for r in hub.requests if r.path.startswith("/api/models/")]
    assert seen == [
        ("none", None, 401),
        ("known", OTHER, 404),
        ("unknown", None, 401),
        ("known", READER, 200),
    ]


def test_gated_repo_needs_a_grant(hub: FakeHub, client: ClientProcess, cache: str) -> None:
    hub.create_repo("org/gated", gated=True)
    hub.commit("org/gated", {"config.json": b"{}"})

    assert client.call(client_model_info, "org/gated")["gated"] == "manual"
    for token in (None, OTHER):
        with pytest.raises(GatedRepoError):
            client.call(client_download, "org/gated", "config.json", cache, token=token)
    assert client.call(client_download, "org/gated", "config.json", cache, token=READER) == b"{}"


def test_unknown_revision_and_missing_file(hub: FakeHub, client: ClientProcess, cache: str) -> None:
    hub.create_repo("org/m")

    with pytest.raises(RevisionNotFoundError):
        client.call(client_model_info, "org/m", "no-such-branch")
    with pytest.raises(RevisionNotFoundError):
        client.call(client_download, "org/m", ".gitattributes", cache, revision="0" * 40)
    with pytest.raises(EntryNotFoundError):
        client.call(client_download, "org/m", "missing.json", cache)
    with pytest.raises(RepositoryNotFoundError):
        client.call(client_download, "org/absent", "config.json", cache)


def test_rate_limiting(hub: FakeHub, client: ClientProcess, cache: str) -> None:
    """model_info does not retry a 429. hf_hub_download retries its HEAD once at once, then
    backs off for Retry-After + 1 s."""
    hub.create_repo("org/busy")
    hub.rate_limit(1)
    with pytest.raises(HfHubHTTPError) as limited:
        client.call(client_model_info, "org/busy")
    assert limited.value.response.status_code == 429

    hub.clear_requests()
    hub.rate_limit(2, retry_after=1)
    started = time.monotonic()
    assert client.call(client_download, "org/busy", ".gitattributes", cache).startswith(b"*.bin")
    assert time.monotonic() - started >= 2
    heads = [(r.status, r.fault) for r in hub.requests if r.method == "HEAD"]
    assert heads == [(429, "rate_limit"), (429, "rate_limit"), (200, None)]


def test_outdated_parent_commit_is_refused(hub: FakeHub, client: ClientProcess) -> None:
    initial = hub.create_repo("org/m")
    newer = hub.commit("org/m", {"config.json": b'{"v": 1}'})

    with pytest.raises(HfHubHTTPError) as refused:
        client.call(
            client_commit, "org/m", {"config.json": b'{"v": 2}'}, "stale", parent_commit=initial
        )
    assert refused.value.response.status_code == 412
    assert hub.head("org/m") == newer
    oid = client.call(
        client_commit, "org/m", {"config.json": b'{"v": 2}'}, "fresh", parent_commit=newer
    )
    assert hub.commits("org/m")[0].oid == oid and hub.file("org/m", "config.json") == b'{"v": 2}'


def test_a_killed_lfs_upload_is_retried(hub: FakeHub, client: ClientProcess) -> None:
    hub.create_repo("org/m")
    hub.fail_uploads(1, mode="drop")
    weights = os.urandom(2 * 1024 * 1024)

    client.call(client_commit, "org/m", {"model.safetensors": weights}, "weights")

    puts = [(r.status, r.fault) for r in hub.requests if r.method == "PUT"]
    assert puts == [(200, "drop"), (200, None)]
    assert hub.file("org/m", "model.safetensors") == weights


def test_commit_faults(hub: FakeHub, client: ClientProcess) -> None:
    hub.create_repo("org/m")
    hub.fail_commits(1, mode="error")
    with pytest.raises(HfHubHTTPError) as failed:
        client.call(client_commit, "org/m", {"a.json": b"1"}, "lost")
    assert failed.value.response.status_code == 500 and len(hub.commits("org/m")) == 1

    hub.fail_commits(1, mode="lost_response")
    with pytest.raises(httpx2.RemoteProtocolError):  # committed, but the answer never came
        client.call(client_commit, "org/m", {"a.json": b"2"}, "applied")
    assert [c.title for c in hub.commits("org/m")] == ["applied", "initial commit"]


def test_restart_on_the_same_port_keeps_the_data(
    hub: FakeHub, client: ClientProcess, cache: str
) -> None:
    hub.create_repo("org/m")
    hub.commit("org/m", {"config.json": b"{}", "other.json": b"[]"})
    assert client.call(client_download, "org/m", "config.json", cache) == b"{}"
    url = hub.url
    hub.stop()
    assert client.call(client_download, "org/m", "config.json", cache) == b"{}"  # from the cache

    back = threading.Timer(1.0, hub.start)  # while the client backs off (1 s, 2 s, 4 s, ...)
    back.start()
    try:
        assert client.call(client_download, "org/m", "other.json", cache) == b"[]"
    finally:
        back.join()
    assert hub.url == url and hub.running


def test_branches_refs_and_history(hub: FakeHub, client: ClientProcess) -> None:
    initial = hub.create_repo("org/m")
    first = hub.commit("org/m", {"a.json": b"1"}, message="first")
    hub.commit("org/m", {"a.json": b"2"}, message="second")

    refs, titles = client.call(client_refs_and_history, "org/m", "dev", first)

    assert refs == {"main": hub.head("org/m"), "dev": first}
    assert titles == ["first", "initial commit"]
    assert [c.oid for c in hub.commits("org/m", "dev")] == [first, initial]
    assert hub.file("org/m", "a.json", "dev") == b"1"
