"""API keys: `lsk_<random>`, shown once, stored only as sha256; each belongs to a tenant."""

from __future__ import annotations

import hashlib
import re
import secrets

from sqlalchemy import select

from service.db.models import ApiKey, Tenant
from service.db.session import Database
from service.errors import InvalidRequest, Unauthorized
from service.jobs import new_id

PREFIX = "lsk_"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


TENANT_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


def create_key(db: Database, tenant: str) -> str:
    """A new key for `tenant` (created if new); tenant names become directory names."""
    if not TENANT_PATTERN.match(tenant):
        raise InvalidRequest(
            f"tenant: {tenant!r} must be 1-64 letters, digits, '_' or '-', not starting with "
            "'_' or '-'",
            details={"field": "tenant"},
        )
    key = PREFIX + secrets.token_urlsafe(32)
    with db.session() as session:
        if session.get(Tenant, tenant) is None:
            session.add(Tenant(id=tenant))
            session.flush()
        session.add(ApiKey(id=new_id(), tenant_id=tenant, key_hash=hash_key(key)))
    return key


def tenant_for(db: Database, authorization: str | None) -> str:
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.startswith(PREFIX):
        raise Unauthorized("send an API key: Authorization: Bearer lsk_...")
    with db.session() as session:
        found = session.scalars(
            select(ApiKey).where(ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None))
        ).first()
    if found is None:
        raise Unauthorized("unknown or revoked API key")
    return found.tenant_id
