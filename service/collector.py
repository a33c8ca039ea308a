"""The API process and the garbage collector: what lives as long as the process is frozen out of
the collector's full passes, so that a full pass walks only what requests made.

A full pass stops every thread, requests included, for as long as it takes to walk the
generation: with the imported libraries in it, 0.15-0.2 s (torch) or 10-40 ms (numpy under
load), every few seconds under polling. So the process freezes what is alive once started, and
again whenever modules were imported since: the in-process executor's first merge imports the
engine (numpy, and torch for computed tensors) long after start-up.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading

log = logging.getLogger("layerswap.collector")


class LongLivedFreezer:
    """Freezes at `start`, then checks every `interval_s` on a thread of its own whether modules
    were imported since the last freeze, and if so freezes again. What is alive at that moment
    besides the new modules is frozen too: objects a request holds are still freed when their
    last reference goes, but reference cycles among them stay until the process ends, which a
    freeze after each import (a few in a process's life) bounds."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self._modules = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="layerswap-gc", daemon=True)

    def start(self) -> None:
        self.freeze_if_imported()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def freeze_if_imported(self) -> bool:
        """Freeze if modules were imported since the last freeze (or none was done yet)."""
        modules = len(sys.modules)
        if modules == self._modules:
            return False
        gc.collect(1)  # the young generations' garbage, not frozen for good (a few ms)
        gc.freeze()
        log.debug("froze %d objects (%d modules)", gc.get_freeze_count(), modules)
        self._modules = modules
        return True

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.freeze_if_imported()
