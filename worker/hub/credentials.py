"""Named credentials: a request says `credential: team-a`; the token lives only here, read from
the process's configuration (LAYERSWAP_HUB_CREDENTIALS), and is handed to the client per call.
It is never stored, queued, logged or returned."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import SecretStr

from worker.hub.errors import UnknownCredential


def token_for(name: str | None, credentials: Mapping[str, SecretStr]) -> str | None:
    """The token of credential `name`; None (anonymous) when no credential is named."""
    if name is None:
        return None
    secret = credentials.get(name)
    if secret is None:
        known = ", ".join(sorted(credentials)) or "none are configured"
        raise UnknownCredential(
            f"credential: no credential named {name!r} on this server ({known})",
            details={"field": "credential"},
        )
    return secret.get_secret_value()
