"""Named credentials, owned by tenants: a request says `credential: team-a`; the token lives only
here, read from the process's configuration (LAYERSWAP_HUB_CREDENTIALS, `{"<tenant>":
{"<name>": "hf_..."}}`), and is handed to the client per call. A tenant can use only its own
names. Tokens are never stored, queued, logged or returned, and errors never list names."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import SecretStr

from core.hub.errors import UnknownCredential

Credentials = Mapping[str, Mapping[str, SecretStr]]  # tenant -> credential name -> token


def token_for(
    name: str | None, *, tenant: str, credentials: Credentials, field: str = "credential"
) -> str | None:
    """The token of `tenant`'s credential `name`; None (anonymous) when no credential is named.
    Another tenant's name and a name nobody has give the same error: nothing is revealed."""
    if name is None:
        return None
    secret = credentials.get(tenant, {}).get(name)
    if secret is None:
        raise UnknownCredential(
            f"{field}: this tenant has no Hub credential named {name!r}",
            details={"field": field},
        )
    return secret.get_secret_value()
