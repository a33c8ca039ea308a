"""The API process's freezer: modules imported after start-up (a first merge's engine) leave
the garbage collector's generations, so full passes stop walking them. In a fresh interpreter
(freezing is process-wide: not in the test process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import gc, sys, time
    from service.collector import LongLivedFreezer

    def tracked(cls):  # in a generation a collection walks (gc.get_objects omits frozen ones)
        return any(o is cls for o in gc.get_objects())

    freezer = LongLivedFreezer(interval_s=0.05)
    freezer.start()
    assert not tracked(LongLivedFreezer), "not frozen at start"
    assert "xml.dom.minidom" not in sys.modules
    import xml.dom.minidom
    node = xml.dom.minidom.Node
    assert tracked(node), "a class just imported is in the youngest generations"
    deadline = time.monotonic() + 30
    while tracked(node):  # the freezer's thread, not this one, freezes it
        assert time.monotonic() < deadline, "never frozen"
        time.sleep(0.05)
    freezer.stop()
    assert not freezer.freeze_if_imported(), "nothing imported since: no freeze"
    import xml.sax.saxutils
    assert freezer.freeze_if_imported()
    assert not tracked(xml.sax.saxutils.XMLGenerator)
    print("ok")
    """
)


def test_modules_imported_after_start_are_frozen() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
