"""Typed views of the service's answers. Unknown fields are kept (extra="allow"), so a newer
service never breaks an older client."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict

TERMINAL = frozenset({"succeeded", "failed", "canceled"})


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class Progress(_Model):
    unit: str = "bytes"
    done: int = 0
    total: int = 0
    fraction: float | None = None


class Output(_Model):
    artifact_id: str
    name: str | None = None
    location: str | None = None
    files: list[dict[str, str]] = []
    published: list[dict[str, Any]] = []


class Job(_Model):
    """A merge, evaluation or analysis job."""

    id: str
    kind: str
    status: str
    stage: str | None = None
    attempts: int = 0
    progress: Progress | None = None
    created_at: datetime
    finished_at: datetime | None = None
    error: dict[str, Any] | None = None
    request: dict[str, Any] = {}
    result: dict[str, Any] | None = None
    output: Output | None = None

    @property
    def done(self) -> bool:
        return self.status in TERMINAL


class Event(_Model):
    id: int
    type: str
    data: dict[str, Any] = {}
    created_at: datetime | None = None


class Sweep(_Model):
    id: str
    status: str
    created_at: datetime
    finished_at: datetime | None = None
    request: dict[str, Any] = {}
    result: dict[str, Any] | None = None
    progress: dict[str, Any] = {}
    trials: list[dict[str, Any]] | None = None

    @property
    def done(self) -> bool:
        return self.status in TERMINAL


class Artifact(_Model):
    id: str
    kind: str | None = None
    location: str | None = None
    content_digest: str | None = None
    files: dict[str, str] | list[Any] = {}


class Method(_Model):
    """A merge method as GET /v1/methods describes it: its params as JSON Schema (each with
    `type_name`, `varies_by_layer`, `per_model`, `bounds`), and the mergekit methods it answers
    to (None: none)."""

    method: str
    summary: str = ""
    formula: str = ""
    needs_base: bool = False
    params: dict[str, Any] = {}
    required: list[str] = []
    mergekit: dict[str, Any] | None = None


class WebhookEndpoint(_Model):
    id: str
    url: str
    events: list[str]
    description: str = ""
    status: str = "enabled"
    secret: str | None = None  # only when created or rotated
    previous_secret_expires_at: datetime | None = None  # until then the old secret signs too


class WebhookDelivery(_Model):
    id: str
    webhook_id: str
    type: str
    status: str
    attempts: list[dict[str, Any]] = []
