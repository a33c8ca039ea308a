"""Verifying the webhooks Layerswap sends (Standard Webhooks signatures)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

__all__ = ["WebhookVerificationError", "verify_webhook"]


def verify_webhook(secret: str, body: bytes | str, headers: Mapping[str, str]) -> dict[str, Any]:
    """The event if `body` was signed with `secret` (`whsec_…`) less than 5 minutes ago;
    raises WebhookVerificationError otherwise. Pass the raw body, before any JSON parsing."""
    return dict(Webhook(secret).verify(body, dict(headers)))
