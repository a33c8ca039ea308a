"""What an evaluation runs: tasks and lm-eval settings. Defaults are the paper's MGSM setting
(8-shot, greedy decoding)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

TASK_NAME = r"^[A-Za-z0-9_.\-]{1,100}$"


class EvaluationSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tasks: list[str] = Field(min_length=1, max_length=16)
    num_fewshot: int | None = Field(8, ge=0, le=64)  # None: each task's own default
    limit: int | None = Field(None, ge=1, le=100_000)  # documents per task (None: all)
    batch_size: int = Field(8, ge=1, le=256)
    max_gen_toks: int = Field(256, ge=1, le=4096)
    backend: Literal["hf", "vllm"] = "hf"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    apply_chat_template: bool = False
    seed: int = Field(1234, ge=0, le=2**31 - 1)

    @field_validator("tasks")
    @classmethod
    def _task_names(cls, tasks: list[str]) -> list[str]:
        for name in tasks:
            if not re.fullmatch(TASK_NAME, name):
                raise ValueError(f"{name!r} is not a task name (letters, digits, _ . -)")
        if len(set(tasks)) != len(tasks):
            raise ValueError("a task is listed twice")
        return tasks

    def settings_key(self) -> dict[str, object]:
        """Everything but the task list that changes a score (reuse is decided per task)."""
        return self.model_dump(exclude={"tasks", "batch_size"})
