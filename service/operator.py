"""The operator's credential: what may read figures that span every tenant (/metrics).

A tenant's API key must not: the job counts by kind and status, merged bytes and queue ages are
the whole service's, other tenants' activity included. Prometheus scrapers send a fixed bearer
token, so the operator's is one setting (LAYERSWAP_METRICS_TOKEN), compared in constant time.
"""

from __future__ import annotations

import hmac

from pydantic import SecretStr

from core.errors import Forbidden, Unauthorized
from service.auth import PREFIX


def check_operator(token: SecretStr | None, authorization: str | None) -> None:
    """Raises unless `authorization` is `Bearer <token>`. An API key (told apart by its prefix,
    not looked up, so the answer says nothing of whether it is valid) is a 403."""
    scheme, _, sent = (authorization or "").partition(" ")
    bearer = scheme.lower() == "bearer" and bool(sent)
    if bearer and sent.startswith(PREFIX):
        raise Forbidden(
            "a tenant's API key cannot read the service's metrics (they count every tenant's "
            "jobs); scrape them with the operator token (LAYERSWAP_METRICS_TOKEN)"
        )
    if token is None:
        raise Unauthorized(
            "the metrics need the operator token, and this service has none "
            "(LAYERSWAP_METRICS_TOKEN)"
        )
    expected = token.get_secret_value().encode()
    if not bearer or not hmac.compare_digest(sent.encode(), expected):
        raise Unauthorized(
            "send the operator token: Authorization: Bearer <LAYERSWAP_METRICS_TOKEN>"
        )
