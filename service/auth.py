"""API keys: `lsk_<random>`, shown once, stored only as sha256; each belongs to a tenant.

Each API process remembers the keys it has looked up (KeyCache) for KEY_CACHE_S, so a request
costs a dictionary lookup rather than a database read on a thread: a revoked key is refused by
every API process at most KEY_CACHE_S after the revocation is committed."""

from __future__ import annotations

import asyncio
import hashlib
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select, update

from core.db.models import ApiKey, Tenant, as_utc, utcnow
from core.db.session import Database
from core.errors import InvalidRequest, NotFound, Unauthorized
from core.jobs import new_id

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


def bearer_key(authorization: str | None) -> str:
    """The API key an Authorization header sends; Unauthorized when it sends none."""
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.startswith(PREFIX):
        raise Unauthorized("send an API key: Authorization: Bearer lsk_...")
    return key


def tenant_for(db: Database, authorization: str | None) -> str:
    """The tenant of the header's key, read from the database now."""
    return tenant_of_hash(db, hash_key(bearer_key(authorization)))


def tenant_of_hash(db: Database, key_hash: str) -> str:
    with db.session() as session:
        found = session.scalars(
            select(ApiKey).where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))
        ).first()
    if found is None:
        raise Unauthorized("unknown or revoked API key")
    return found.tenant_id


# How long one API process trusts a key it looked up: the bound on how soon a revocation takes
# effect. Counted from when the lookup began (it may read the database as late as that, but
# never earlier), so a key revoked at T is refused by every request that arrives after T +
# KEY_CACHE_S, in every process, whatever each one has remembered. At one lookup per key per
# second, a process polled thousands of times a second barely reads the keys table.
KEY_CACHE_S = 1.0
KEY_CACHE_ENTRIES = 10_000  # valid keys remembered; past that, the expired ones are dropped


@dataclass
class _Lookup:
    began: float  # by the cache's clock
    tenant: asyncio.Future[str]


class KeyCache:
    """Key hash -> tenant, each for `ttl` seconds after the lookup that found it began; for one
    event loop (its requests only: not thread-safe). Unknown and revoked keys are not
    remembered: each of their requests is looked up, so a key works as soon as it is created.
    Concurrent requests with one key share one lookup."""

    def __init__(
        self,
        lookup: Callable[[str], Awaitable[str]],
        *,
        ttl: float = KEY_CACHE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lookup = lookup  # key hash -> tenant (raises Unauthorized)
        self.ttl = ttl
        self.clock = clock
        self._found: dict[str, tuple[str, float]] = {}  # hash -> (tenant, trusted until)
        self._looking: dict[str, _Lookup] = {}

    async def tenant(self, authorization: str | None) -> str:
        key_hash = hash_key(bearer_key(authorization))
        now = self.clock()
        found = self._found.get(key_hash)
        if found is not None and now < found[1]:
            return found[0]
        looking = self._looking.get(key_hash)
        if looking is None or now >= looking.began + self.ttl:  # too old to vouch for now
            looking = self._start(key_hash, now)
        return await asyncio.shield(looking.tenant)

    def _start(self, key_hash: str, now: float) -> _Lookup:
        looking = _Lookup(now, asyncio.ensure_future(self.lookup(key_hash)))
        self._looking[key_hash] = looking
        looking.tenant.add_done_callback(lambda done: self._done(key_hash, looking, done))
        return looking

    def _done(self, key_hash: str, looking: _Lookup, done: asyncio.Future[str]) -> None:
        if self._looking.get(key_hash) is looking:
            del self._looking[key_hash]
        if done.cancelled() or done.exception() is not None:
            self._found.pop(key_hash, None)  # refused (or unknown): nothing vouches for it now
            return
        if len(self._found) >= KEY_CACHE_ENTRIES:
            now = self.clock()
            self._found = {h: f for h, f in self._found.items() if now < f[1]}
        if len(self._found) < KEY_CACHE_ENTRIES:
            self._found[key_hash] = (done.result(), looking.began + self.ttl)


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
