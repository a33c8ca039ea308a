"""Publish a merge output to a Hub repository: one commit, exactly once.

The output directory is complete and immutable by the time it is published (the merge renamed
it into place). Publishing first looks at the destination branch: if its head already holds
exactly these files (a previous attempt committed, then died before recording it, or the
response was lost), that commit is the result and nothing is pushed. Otherwise the files are
uploaded, then one commit is made with `parent_commit` = the head seen, so a concurrent writer
is detected rather than overwritten. LFS uploads that were cut off are resumed by the next try:
the Hub keeps what it already has, and nothing is visible until the commit; `before_commit`,
called between the uploads and the commit, may still stop it there (a job canceled meanwhile).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from huggingface_hub import CommitOperationAdd, HfApi, constants

from core.hub.errors import HubError, hub_errors, retrying
from engine.io.digests import file_sha256
from engine.recipe import HubDestination

T = TypeVar("T")
log = logging.getLogger("layerswap.hub")


@dataclass(frozen=True)
class Published:
    repo: str
    branch: str
    commit: str
    url: str
    created: bool  # False when an earlier attempt's commit was found and reused

    def to_dict(self) -> dict[str, Any]:
        return {"repo": self.repo, "branch": self.branch, "commit": self.commit, "url": self.url}


def publish(
    out_dir: Path,
    dest: HubDestination,
    *,
    token: str | None,
    job_id: str,
    digests: dict[str, str] | None = None,
    before_commit: Callable[[], None] = lambda: None,
) -> Published:
    """Commit every file of `out_dir` to `dest` (creating the repository and branch if
    needed). Transient failures are retried; each retry starts by checking the branch head.
    `before_commit` is called once the files are uploaded, before the commit makes them
    visible (or before an earlier attempt's commit is taken as the result); what it raises
    ends the publishing with nothing committed."""
    return _retrying(
        lambda: _publish_once(
            out_dir, dest, token=token, job_id=job_id, digests=digests or {},
            before_commit=before_commit,
        ),
        f"publishing job {job_id}",
    )  # fmt: skip


def _retrying(attempt: Callable[[], T], what: str) -> T:
    """Each try must start by reading the branch head, so a retry never commits twice."""
    return retrying(attempt, what=what, first_pause_s=1.0)


def _publish_once(
    out_dir: Path,
    dest: HubDestination,
    *,
    token: str | None,
    job_id: str,
    digests: dict[str, str],
    before_commit: Callable[[], None],
) -> Published:
    api = HfApi(token=token or False)
    where = f"hf://{dest.repo}@{dest.branch}"
    with hub_errors(where):
        api.create_repo(dest.repo, private=dest.private, exist_ok=True)
        if dest.branch != "main":
            api.create_branch(dest.repo, branch=dest.branch, exist_ok=True)
        head = api.model_info(dest.repo, revision=dest.branch, files_metadata=True)
    if _holds(head, out_dir, digests):
        before_commit()
        log.info("job %s: %s already holds this output (commit %s)", job_id, where, head.sha)
        return Published(
            dest.repo, dest.branch, str(head.sha), _commit_url(dest.repo, str(head.sha)), False
        )
    additions = _additions(out_dir, digests)
    with hub_errors(where):
        api.preupload_lfs_files(dest.repo, additions, revision=dest.branch)  # nothing visible
    before_commit()
    with hub_errors(where):
        info = api.create_commit(
            repo_id=dest.repo,
            operations=additions,
            revision=dest.branch,
            commit_message=f"Layerswap merge job {job_id}",
            commit_description="Merged by Layerswap; see README.md and layerswap.json.",
            parent_commit=head.sha,
        )
    commit = str(getattr(info, "oid", "") or "")
    if not commit:
        raise HubError(f"{where}: the Hub did not return a commit id")
    return Published(dest.repo, dest.branch, commit, str(info.commit_url), True)


def _additions(out_dir: Path, digests: dict[str, str]) -> list[Any]:
    """One addition per file of `out_dir`. Each carries the sha256 the merge computed while
    writing it, where known, so the client does not read a multi-GB file again to hash it
    before the upload (an LFS upload is announced by its sha256). The Hub checks the bytes it
    receives against it: an output changed since the merge fails to upload."""
    additions = []
    for path in sorted(p for p in out_dir.iterdir() if p.is_file()):
        addition = CommitOperationAdd(path_in_repo=path.name, path_or_fileobj=str(path))
        if (digest := digests.get(path.name)) is not None:
            addition.upload_info.sha256 = bytes.fromhex(digest)
        additions.append(addition)
    return additions


def _holds(head: Any, out_dir: Path, digests: dict[str, str]) -> bool:
    """Does the branch head hold exactly the files of `out_dir` (besides .gitattributes)?
    `digests`: sha256s already known (the merge's own), so big files are not read again."""
    remote = {s.rfilename: s for s in head.siblings or [] if s.rfilename != ".gitattributes"}
    local = {p.name: p for p in out_dir.iterdir() if p.is_file()}
    if set(remote) != set(local):
        return False
    for name, path in local.items():
        sibling = remote[name]
        if sibling.lfs is not None:
            if sibling.lfs.sha256 != (digests.get(name) or file_sha256(path)):
                return False
        elif sibling.blob_id != _git_blob_id(path):
            return False
    return True


def _git_blob_id(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def _commit_url(repo: str, commit: str) -> str:
    return f"{constants.ENDPOINT}/{repo}/commit/{commit}"


def publish_card(
    out_dir: Path, repo: str, branch: str, names: list[str], *, token: str | None, message: str
) -> str | None:
    """Commit `names` (files of `out_dir`, e.g. an updated README.md) to `repo`@`branch`, unless
    the branch already holds them byte for byte: a retried job adds no second commit. The new
    commit id, or None when there was nothing to commit."""
    api = HfApi(token=token or False)
    where = f"hf://{repo}@{branch}"

    def commit_once() -> str | None:
        with hub_errors(where):
            head = api.model_info(repo, revision=branch, files_metadata=True)
            remote = {s.rfilename: s.blob_id for s in head.siblings or []}
            changed = [n for n in names if remote.get(n) != _git_blob_id(out_dir / n)]
            if not changed:
                return None
            info = api.create_commit(
                repo_id=repo,
                revision=branch,
                operations=[
                    CommitOperationAdd(path_in_repo=n, path_or_fileobj=str(out_dir / n))
                    for n in changed
                ],
                commit_message=message,
                parent_commit=head.sha,
            )
        return str(getattr(info, "oid", "") or "") or None

    return _retrying(commit_once, where)
