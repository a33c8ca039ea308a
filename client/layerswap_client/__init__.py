"""Python client for the Layerswap model-merging service: sync and async, typed, retrying on
429/503 with Retry-After, an Idempotency-Key on every POST, and webhook verification."""

from layerswap_client.async_client import AsyncClient
from layerswap_client.client import Client
from layerswap_client.errors import LayerswapError, WaitTimeout
from layerswap_client.models import (
    Artifact,
    Event,
    Job,
    Method,
    Sweep,
    WebhookDelivery,
    WebhookEndpoint,
)
from layerswap_client.webhooks import WebhookVerificationError, verify_webhook

__all__ = [
    "Artifact",
    "AsyncClient",
    "Client",
    "Event",
    "Job",
    "LayerswapError",
    "Method",
    "Sweep",
    "WaitTimeout",
    "WebhookDelivery",
    "WebhookEndpoint",
    "WebhookVerificationError",
    "verify_webhook",
]
