"""Publishing a merge output with the sha256s the merge computed, through the real
huggingface_hub client, to the suite's Hub-compatible server (which checks every LFS upload
against the sha256 it was announced with)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from core.hub.errors import HubRejected
from core.hub.publish import publish
from engine.recipe import HubDestination

TOKEN = "hf_publisher_0123456789abcdef"


def make_output(directory: Path) -> dict[str, str]:
    """A small output directory (one LFS file, two regular ones); its files' sha256s."""
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(os.urandom(3 * 1024 * 1024))
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "README.md").write_text("# merged\n")
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


@pytest.fixture
def writer(hub: Any) -> Any:
    hub.add_token(TOKEN, user="team", write=["team/*"])
    return hub


def test_the_merge_digests_announce_the_upload(writer: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    digests = make_output(out)
    published = publish(
        out, HubDestination(repo="team/merged"), token=TOKEN, job_id="j1", digests=digests
    )
    assert published.created
    files = writer.files("team/merged")
    for name, digest in digests.items():
        assert files[name] == (out / name).read_bytes()
        assert hashlib.sha256(files[name]).hexdigest() == digest
    assert writer.head("team/merged") == published.commit


def test_an_output_changed_since_the_merge_is_not_published(writer: Any, tmp_path: Path) -> None:
    """The digests are what the upload announces (the file is not hashed again), so a weight
    file whose bytes no longer match the merge's sha256 is refused by the Hub, and the
    destination gets no commit."""
    out = tmp_path / "out"
    digests = make_output(out)
    with (out / "model.safetensors").open("r+b") as f:
        f.write(b"\x00" * 16)  # e.g. corrupted on disk after the merge wrote it
    with pytest.raises(HubRejected, match=r"model\.safetensors.*does not match its sha256"):
        publish(out, HubDestination(repo="team/merged"), token=TOKEN, job_id="j2", digests=digests)
    assert [c.title for c in writer.commits("team/merged")] == ["initial commit"]
