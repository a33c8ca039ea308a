"""API keys: `lsk_<random>`, shown once, stored only as sha256; each belongs to a tenant."""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select, update

from service.db.models import ApiKey, Tenant, as_utc, utcnow
from service.db.session import Database
from service.errors import InvalidRequest, NotFound, Unauthorized
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


@dataclass(frozen=True)
class KeyInfo:
    """What may be shown about a key: never the secret, nor its hash."""

    id: str
    tenant: str
    created_at: datetime
    revoked_at: datetime | None


def _info(key: ApiKey) -> KeyInfo:
    revoked = as_utc(key.revoked_at) if key.revoked_at else None
    return KeyInfo(key.id, key.tenant_id, as_utc(key.created_at), revoked)


def list_keys(db: Database, *, tenant: str | None = None) -> list[KeyInfo]:
    """Oldest first; of one tenant, or of all."""
    query = select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)
    if tenant is not None:
        query = query.where(ApiKey.tenant_id == tenant)
    with db.session() as session:
        return [_info(key) for key in session.scalars(query)]


def revoke_key(db: Database, key: str) -> tuple[KeyInfo, bool]:
    """Revoke by id, or by the secret itself (`lsk_...`, for a leaked key whose id is not at
    hand). Returns the key and whether this call revoked it (False: it already was).
    Raises NotFound for an unknown key."""
    match = ApiKey.key_hash == hash_key(key) if key.startswith(PREFIX) else ApiKey.id == key
    with db.session() as session:
        found = session.scalars(select(ApiKey).where(match)).first()
        if found is None:
            what = "no API key is that key" if key.startswith(PREFIX) else f"no API key {key!r}"
            raise NotFound(what, details={"field": "key_id"})
        # Compare-and-set: of two concurrent revokes, one reports it was already done.
        revoked = session.execute(
            update(ApiKey)
            .where(ApiKey.id == found.id, ApiKey.revoked_at.is_(None))
            .values(revoked_at=utcnow())
        )
        session.flush()
        session.refresh(found)
        return _info(found), getattr(revoked, "rowcount", 0) == 1
