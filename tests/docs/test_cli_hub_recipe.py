"""docs/cli.md's recipe with Hub sources runs as written against the suite's Hub-compatible
server: the page's repositories hold the example experts, and only the token and the commit the
page names are replaced by the server's. The dry run pins and plans, the merge publishes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.docs.reference_hook import ROOT
from tests.service.test_hub_api import upload

PAGE = ROOT / "docs" / "cli.md"
TOKEN = "hf_docs_token"


def hub_block() -> str:
    section = PAGE.read_text().split("## A recipe with Hub sources", 1)[1]
    match = re.search(r"```bash\n(.*?)\n```", section, re.DOTALL)
    assert match, "the section has a bash block"
    return match.group(1)


def test_the_hub_recipe_runs_as_written(hub: Any, examples: Path, tmp_path: Path) -> None:
    block = hub_block()
    token = re.search(r"HF_TOKEN=(\S+)", block)
    commit = re.search(r"hf://my-org/llama-swahili@([0-9a-f]{40})", block)
    assert token and commit
    hub.add_token(TOKEN, user="me", read=["my-org/*"], write=["my-org/*"])
    upload(hub, "my-org/llama-math", examples / "math", private=True)
    swahili = upload(hub, "my-org/llama-swahili", examples / "swh", private=True)
    script = block.replace(token.group(1), TOKEN).replace(commit.group(1), swahili)
    env = hub.client_env(tmp_path / "hf")
    env |= {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "LAYERSWAP_CACHE_DIR": str(tmp_path / "cache")}  # fmt: skip
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    math = hub.head("my-org/llama-math")
    assert done.stderr.count(f"my-org/llama-math@main -> commit {math}") == 2  # dry run, merge
    assert done.stderr.count(f"my-org/llama-swahili@{swahili} -> commit {swahili}") == 2
    plan = dict(re.findall(r"^(\d+) +(\w+) ", done.stdout, re.MULTILINE))  # the dry run's table
    assert plan == {"0": "language", "1": "language", "2": "task", "3": "task", "4": "task",
                    "5": "language"}  # fmt: skip
    assert "published to " in done.stdout
    published = hub.files("my-org/swahili-math")
    assert hub.is_private("my-org/swahili-math")
    assert {"model.safetensors", "config.json", "layerswap.json", "README.md"} <= set(published)
    assert (
        published["model.safetensors"]
        == (tmp_path / "swahili-math" / "model.safetensors").read_bytes()
    )
