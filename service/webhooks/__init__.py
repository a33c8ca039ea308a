"""Webhooks: signed (Standard Webhooks) events from a durable outbox, delivered with retries."""
