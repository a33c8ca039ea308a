"""SteppedLM: an lm-eval model that hands its requests to the real one a chunk at a time.

lm-eval offers no hooks for progress or cancellation, and its request cache is only written
when a whole request type is done (plus whatever partial results the model reports). Between
chunks this wrapper stores each result in the cache and commits it (so a re-queued attempt
resumes where this one stopped: what was reported done is on disk), reports progress, and
raises when the job is canceled or past its deadline. lm-eval's CachingLM sits outside this
wrapper, so only requests the cache could not answer reach it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from lm_eval.api.model import LM

# (done, total) requests of the current request type
ProgressSink = Callable[[int, int], None]


class Stop(Exception):
    """The job was canceled or its time ran out; lm-eval is unwound without a result."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason  # "canceled" | "timeout"


class SteppedLM(LM):  # type: ignore[misc]  # lm-eval ships no type information
    def __init__(
        self,
        inner: LM,
        *,
        chunk: int,
        on_progress: ProgressSink | None = None,
        should_cancel: Callable[[], bool] | None = None,
        deadline: float | None = None,  # time.monotonic() value
    ) -> None:
        super().__init__()
        self.inner = inner
        self.chunk = max(1, chunk)
        self.on_progress = on_progress
        self.should_cancel = should_cancel
        self.deadline = deadline
        self.ran: dict[str, int] = {}  # requests the model answered, by type (not the cache)

    # What lm-eval asks of a model besides the three request types.
    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def rank(self) -> int:
        return int(self.inner.rank)

    @property
    def world_size(self) -> int:
        return int(self.inner.world_size)

    @property
    def tokenizer_name(self) -> str:
        return str(self.inner.tokenizer_name)

    def apply_chat_template(self, chat_history: Any, add_generation_prompt: bool = True) -> Any:
        return self.inner.apply_chat_template(chat_history, add_generation_prompt)

    def chat_template(self, chat_template: Any = False) -> Any:
        return self.inner.chat_template(chat_template)

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[Any]:
        return self._stepped("loglikelihood", requests)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[Any]:
        return self._stepped("loglikelihood_rolling", requests)

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[Any]:
        return self._stepped("generate_until", requests)

    def _stepped(self, kind: str, requests: list[Any]) -> list[Any]:
        results: list[Any] = []
        total = len(requests)
        self._report(0, total)
        for start in range(0, total, self.chunk):
            self._check()
            part = requests[start : start + self.chunk]
            answers = getattr(self.inner, kind)(part, disable_tqdm=True)
            for request, answer in zip(part, answers, strict=True):
                self.cache_hook.add_partial(kind, request.args, answer)
            self._commit_cache()
            results.extend(answers)
            self.ran[kind] = self.ran.get(kind, 0) + len(answers)
            self._report(len(results), total)
        return results

    def _commit_cache(self) -> None:
        cache = getattr(self.cache_hook, "dbdict", None)
        if cache is not None:
            cache.commit(blocking=True)

    def _report(self, done: int, total: int) -> None:
        if self.on_progress is not None:
            self.on_progress(done, total)

    def _check(self) -> None:
        if self.should_cancel is not None and self.should_cancel():
            raise Stop("canceled")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise Stop("timeout")
