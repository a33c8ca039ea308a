"""Webhook signing secrets at rest: encrypted with Fernet. The keys come from
LAYERSWAP_WEBHOOK_SECRET_KEYS, newest first (MultiFernet: the first encrypts, every one
decrypts, so a key is rotated by listing a new one in front of it). Without that setting the
service makes a key in its data directory on first start (mode 0600), so the embedded default
needs nothing set; API processes on several hosts must share one key through the setting.

At start-up every stored secret is checked: one still in plaintext (written before secrets
were encrypted) is encrypted, one under an older key is re-encrypted under the newest, and one
that no key opens stops the start with a message saying which key to set, instead of failing
each delivery later."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from sqlalchemy import select, update

from core.db.models import Tenant, WebhookEndpoint
from core.db.session import Database
from core.settings import Settings

log = logging.getLogger("layerswap.webhooks")

KEY_FILE = "webhook-secrets.key"
PLAINTEXT_PREFIX = "whsec_"  # how every secret the service makes begins; tokens never do
SETTING = "LAYERSWAP_WEBHOOK_SECRET_KEYS"
MAKE_KEY = (
    "python -c 'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())'"
)


class SecretKeyError(RuntimeError):
    """The keys are not keys, or cannot decrypt the stored secrets; the message says what to
    set."""


@dataclass(frozen=True)
class SecretBox:
    keys: tuple[Fernet, ...]  # newest first
    source: str  # where the keys came from, for messages

    def encrypt(self, secret: str) -> str:
        return self.keys[0].encrypt(secret.encode()).decode()

    def decrypt(self, stored: str) -> str:
        if stored.startswith(PLAINTEXT_PREFIX):
            return stored  # written before encryption, by a process not yet upgraded
        try:
            return MultiFernet(list(self.keys)).decrypt(stored.encode()).decode()
        except InvalidToken:
            raise SecretKeyError(
                f"a stored webhook secret cannot be decrypted with the keys from {self.source}; "
                f"set {SETTING} to the key that encrypted it (after the newest)"
            ) from None

    def current(self, stored: str) -> bool:
        """Encrypted under the newest key (else it is re-encrypted at start-up)."""
        try:
            self.keys[0].decrypt(stored.encode())
        except InvalidToken:
            return False
        return True


_boxes: dict[tuple[str, ...], SecretBox] = {}
_lock = threading.Lock()


def box_for(settings: Settings) -> SecretBox:
    """The keys of `settings`, read once per process; raises SecretKeyError for a value that
    is not a Fernet key."""
    configured = tuple(k.get_secret_value() for k in settings.webhook_secret_keys)
    path = (settings.data_dir / KEY_FILE).absolute()
    cache_key = configured or ("file", str(path))
    with _lock:
        if cache_key not in _boxes:
            if configured:
                _boxes[cache_key] = SecretBox(_fernets(configured, SETTING), SETTING)
            else:
                source = f"the key file {path}"
                _boxes[cache_key] = SecretBox(_fernets((_key_file(path),), source), source)
        return _boxes[cache_key]


def _fernets(keys: tuple[str, ...], source: str) -> tuple[Fernet, ...]:
    fernets = []
    for number, key in enumerate(keys, 1):
        try:
            fernets.append(Fernet(key.strip().encode()))
        except ValueError:
            raise SecretKeyError(
                f"{source}: key {number} is not a Fernet key (32 url-safe base64-encoded bytes; "
                f"make one with {MAKE_KEY})"
            ) from None
    return tuple(fernets)


def _key_file(path: Path) -> str:
    """The data directory's key, made on first start. Written under another name and linked
    into place, so processes starting together agree on one key and never read half of one."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        draft = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        descriptor = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as out:
            out.write(Fernet.generate_key() + b"\n")
            out.flush()
            os.fsync(out.fileno())
        with contextlib.suppress(FileExistsError):  # another process made it first: theirs
            os.link(draft, path)
        draft.unlink()
    return path.read_text().strip()


def prepare(db: Database, box: SecretBox) -> None:
    """At start-up: encrypt plaintext secrets, re-encrypt those under older keys, and refuse
    to start when a stored secret cannot be decrypted."""
    unreadable = 0
    for table, column in ((WebhookEndpoint, "secret"), (WebhookEndpoint, "previous_secret"),
                          (Tenant, "webhook_secret")):  # fmt: skip
        unreadable += _upgrade_column(db, box, table, column)
    if unreadable:
        raise SecretKeyError(
            f"{unreadable} stored webhook signing secret(s) cannot be decrypted with the keys "
            f"from {box.source}: set {SETTING} to the key that encrypted them (newest key first, "
            "older ones after it)"
        )


def _upgrade_column(db: Database, box: SecretBox, table: Any, name: str) -> int:
    """Bring one column's secrets under the newest key; returns how many no key decrypts.
    Each write is a compare-and-set, so processes starting together do not clash."""
    column = getattr(table, name)
    with db.session() as session:
        rows = session.execute(select(table.id, column).where(column.is_not(None))).all()
    unreadable = 0
    for row_id, stored in rows:
        if not stored.startswith(PLAINTEXT_PREFIX) and box.current(stored):
            continue
        try:
            secret = box.decrypt(stored)
        except SecretKeyError:
            unreadable += 1
            continue
        with db.session() as session:
            session.execute(
                update(table)
                .where(table.id == row_id, column == stored)
                .values({name: box.encrypt(secret)})
            )
    return unreadable
