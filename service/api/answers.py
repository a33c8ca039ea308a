"""Answers to GET /v1/<collection>/{id}, made once per version of the job and given again while
its row reads back the same.

Every read still asks the database: one keyed SELECT of the job and its output artifact
(core/job_rows.py, read as service/api/row_reads.py says). When that row equals the row an
answer was made from, the answer (its JSON and ETag) is given again; otherwise it is made anew
from this row. An answer is kept only when the row is all it shows: not when its view reads
other tables (a merge's evaluation, an evaluation's scores) or the clock (a running job's ETA).
Nothing here relies on being told of changes, so no missed notification, other process or hand
edit can make an answer stale."""

from __future__ import annotations

import functools
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from service.schemas import JobView, view_json

KEPT_ANSWERS = 4096  # ~2.5 kB of JSON and a few kB of row each: ~30 MB at most


@dataclass(frozen=True)
class Answer:
    body: bytes  # the JSON sent
    version: bytes  # what the ETag covers: the body less what changes with the clock alone

    @property
    def timeless(self) -> bool:
        """No part of it moves with the clock (no ETA): it may be given again."""
        return self.version is self.body


def answer(view: JobView) -> Answer:
    """A job view's JSON, and its version without the ETA (which moves as time passes: an ETag
    over it would change on every read, and a long poll would never wait)."""
    body = view_json(view)
    progress = view["progress"]
    if progress["eta_s"] is None:  # no ETA (every ended job): one dump
        return Answer(body, body)
    return Answer(body, view_json({**view, "progress": {**progress, "eta_s": None}}))


def etag_of(version: bytes) -> str:
    """Weak: equal versions may differ in their ETA."""
    return 'W/"' + hashlib.blake2b(version, digest_size=12).hexdigest() + '"'


@dataclass(frozen=True)
class Kept:
    row: Sequence[Any]  # what the answer was made from (compared whole)
    answer: Answer
    ended: bool

    @functools.cached_property
    def etag(self) -> str:
        """Made when first asked for: a list page sends its answers without their ETags."""
        return etag_of(self.answer.version)


class KeptAnswers:
    """The last answer per job, for the KEPT_ANSWERS jobs read most recently; any thread."""

    def __init__(self, capacity: int = KEPT_ANSWERS) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[str, Kept] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, job_id: str, row: Sequence[Any]) -> Kept | None:
        """The answer made from a row equal to `row`, if one is kept."""
        with self._lock:
            kept = self._kept.get(job_id)
            if kept is None or kept.row != row:
                return None
            self._kept.move_to_end(job_id)
            return kept

    def put(self, job_id: str, kept: Kept) -> None:
        with self._lock:
            self._kept[job_id] = kept
            self._kept.move_to_end(job_id)
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)

    def __len__(self) -> int:
        return len(self._kept)
