"""An error met while the output is written names the output directory, never the hidden
staging directory (`.<name>.staging-…`) the engine writes it in before publishing it."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from engine.errors import DiskFull, OutputError, RecipeError
from engine.io.writer import OutputWriter
from engine.merge import naming_output


def test_a_writer_error_in_the_staging_directory_names_the_output(tmp_path: Path) -> None:
    out = tmp_path / "gen1"
    staging = tmp_path / ".gen1.staging-job-a1-0123456789ab"
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"in the way")  # the writer creates, never opens
    with pytest.raises(OutputError) as info:
        OutputWriter(staging, [("model.safetensors", b"", 8)], durable=False, direct=False)
    assert str(staging / "model.safetensors") in info.value.message  # as the writer says it

    named = naming_output(info.value, staging, out)
    assert isinstance(named, OutputError) and named.code == "output_error"
    assert str(out / "model.safetensors") in named.message
    assert ".staging-" not in named.message and "/." not in named.message
    assert str(named) == named.message
    assert pickle.loads(pickle.dumps(named)).message == named.message  # crosses processes


def test_a_path_in_the_details_names_the_output_too(tmp_path: Path) -> None:
    out = tmp_path / "gen1"
    staging = tmp_path / ".gen1.staging-0123456789ab"
    full = DiskFull.at(staging / "generation_config.json", "the output's files")
    named = naming_output(full, staging, out)
    expected = str(out / "generation_config.json")
    assert isinstance(named, DiskFull) and named.remedy == full.remedy
    assert named.details == {"path": expected} and named.message.endswith(f"({expected})")
    assert full.details["path"] == str(staging / "generation_config.json")  # not changed


def test_an_error_naming_no_staging_file_is_the_same_error(tmp_path: Path) -> None:
    error = RecipeError.for_field("params.bottom", "must be at least 0")
    assert naming_output(error, tmp_path / ".out.staging-x", tmp_path / "out") is error
