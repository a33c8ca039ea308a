"""mergekit-yaml's command, run again and again in one process of .venv-bench's Python, so that
the parity tests pay its start-up (torch, transformers: seconds) once instead of per config.

One request per line on stdin, `{"config": path, "out": path}` and optionally `"args"` (more of
mergekit-yaml's options); one reply per line on the descriptor given as the only argument,
`{"ok": true}` or `{"ok": false, "error": traceback}`.
mergekit's own output goes to stderr. Its per-thread cache of model loaders is emptied before
each run, so that a run sees the files as they are then, as a fresh process would.
"""

import json
import os
import sys
import traceback

from mergekit.io.tasks import LoaderCache
from mergekit.scripts.run_yaml import main


def serve(replies: int) -> None:
    sys.stdout = sys.stderr  # anything mergekit prints stays off the reply channel
    with os.fdopen(replies, "w", buffering=1) as out:
        for line in sys.stdin:
            request = json.loads(line)
            LoaderCache.loaders.clear()
            try:
                main.main(
                    args=[
                        request["config"],
                        request["out"],
                        "--allow-crimes",
                        *request.get("args", []),
                    ],
                    standalone_mode=False,
                )
                reply = {"ok": True}
            except BaseException:  # any failure is the test's to report
                reply = {"ok": False, "error": traceback.format_exc()[-3000:]}
            out.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    serve(int(sys.argv[1]))
