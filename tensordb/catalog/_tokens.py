"""Scoped access tokens of the node servers' network API, kept in the catalog.

A token is ``tdb_<id>_<secret>``: ``id`` (16 hex digits) is its public part, the row's
key; ``secret`` (43 URL-safe characters, 256 random bits) is printed once, when the
token is made, and only its SHA-256 is stored. A secret of 256 random bits needs no slow
password hash: nobody can guess it, and the stored hash gives nothing back. A lookup
reads one row by ``id`` and compares the hashes in constant time.

A token carries a **role** and a **scope**. The scope is a glob (``fnmatch``, case
sensitive; ``*`` also matches ``/``) over the names of collections and KV namespaces:
``team-a/*`` covers ``team-a/x`` and ``team-a/kv``, never ``team-b/x``. The roles:

=========  ======================================================================
role       may, on names in its scope
=========  ======================================================================
``read``   read versions, list them, read KV blocks and segment bytes
``write``  what ``read`` may, and commit versions and have a node pull replicas
``admin``  what ``write`` may, and read the node's metrics and console
``node``   (the cluster's own token, never stored here) what nodes ask of each other:
           read anything, pull, metrics; it commits nothing
=========  ======================================================================

These rows govern only the network API. A process on the store's host that opens the
catalog and the store's files directly is governed by their file permissions, as the
threat model (docs/security.md) says.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Engine, insert, select, update

from ..errors import InvalidInput, NotFound
from ._common import now_utc
from ._sql import write_conn
from .schema import access_tokens

__all__ = ["ACTIONS", "ROLES", "NODE_ROLE", "Grant", "TokenInfo", "TokenStore", "check_scope"]

#: the roles a stored token may have, least first
ROLES = ("read", "write", "admin")
#: the role of the cluster's own token (``--token``): what nodes ask of each other
NODE_ROLE = "node"
#: what a request may do, and the roles that may do it
ACTIONS: dict[str, frozenset[str]] = {
    "read": frozenset({"read", "write", "admin", NODE_ROLE}),
    "write": frozenset({"write", "admin"}),
    "pull": frozenset({"write", "admin", NODE_ROLE}),
    "admin": frozenset({"admin", NODE_ROLE}),
}
_TOKEN = re.compile(r"tdb_([0-9a-f]{16})_([A-Za-z0-9_-]{43})")


@dataclass(frozen=True, slots=True)
class Grant:
    """What one token allows: ``role`` on the names ``scope`` matches."""

    role: str
    scope: str
    token_id: str | None = None  # None: the cluster's own token

    def may(self, action: str) -> bool:
        """Whether this role may ``action`` at all (on some name)."""
        return self.role in ACTIONS[action]

    def covers(self, name: str) -> bool:
        """Whether ``name`` (a collection or KV namespace) lies in the scope."""
        return self.scope == "*" or fnmatch.fnmatchcase(name, self.scope)

    def allows(self, action: str, name: str) -> bool:
        """Whether this token may ``action`` ('read', 'write', 'pull', 'admin') on
        ``name``."""
        return self.may(action) and self.covers(name)


@dataclass(frozen=True, slots=True)
class TokenInfo:
    """One stored token, without its secret."""

    id: str
    role: str
    scope: str
    note: str | None
    created_at: datetime
    revoked_at: datetime | None


def check_scope(scope: object) -> str:
    """``scope`` if it is a usable glob (1-255 printable ASCII characters), else
    InvalidInput."""
    if not isinstance(scope, str) or not 0 < len(scope) <= 255 or not scope.isascii() \
            or not scope.isprintable() or scope.strip() != scope:
        raise InvalidInput(f"a token's scope is a glob of 1-255 printable ASCII characters "
                           f"with no blank at either end (team-a/*), not {scope!r}")
    return scope


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class TokenStore:
    """The catalog's access tokens: make, look up, revoke, list. Any process with the
    catalog may call it, from any thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def create(self, role: str, scope: str, note: str | None = None) -> tuple[str, str]:
        """Make a token of ``role`` on ``scope``; returns (its id, the token). The token
        is shown here only: the catalog keeps its hash."""
        if role not in ROLES:
            raise InvalidInput(f"a token's role is one of {', '.join(ROLES)}, not {role!r}")
        check_scope(scope)
        if note is not None and (not isinstance(note, str) or len(note) > 1000):
            raise InvalidInput("a token's note is text of at most 1000 characters")
        tid, secret = secrets.token_hex(8), secrets.token_urlsafe(32)
        with write_conn(self.engine) as conn:
            conn.execute(insert(access_tokens).values(
                id=tid, secret_hash=_hash(secret), role=role, scope=scope, note=note,
                created_at=now_utc(), revoked_at=None))
        return tid, f"tdb_{tid}_{secret}"

    def grant(self, token: str) -> Grant | None:
        """What ``token`` allows, or None when it is no live token of this catalog
        (malformed, unknown, wrong secret or revoked). One row read by key."""
        m = _TOKEN.fullmatch(token) if isinstance(token, str) else None
        if m is None:
            return None
        tid, secret = m.groups()
        with self.engine.connect() as conn:
            row = conn.execute(select(access_tokens.c.secret_hash, access_tokens.c.role,
                                      access_tokens.c.scope, access_tokens.c.revoked_at)
                               .where(access_tokens.c.id == tid)).first()
        if row is None or not hmac.compare_digest(row.secret_hash, _hash(secret)) \
                or row.revoked_at is not None or row.role not in ROLES:
            return None
        return Grant(row.role, row.scope, tid)

    def revoke(self, token_id: str) -> None:
        """Revoke the token ``token_id`` (its id, or the whole token). Idempotent for a
        revoked token; NotFound for an unknown one."""
        m = _TOKEN.fullmatch(token_id) if isinstance(token_id, str) else None
        tid = m.group(1) if m else token_id
        with write_conn(self.engine) as conn:
            got = conn.execute(select(access_tokens.c.revoked_at)
                               .where(access_tokens.c.id == tid)).first()
            if got is None:
                raise NotFound(f"no token with id {str(tid)[:40]!r} in this catalog")
            if got.revoked_at is None:
                conn.execute(update(access_tokens).where(access_tokens.c.id == tid)
                             .values(revoked_at=now_utc()))

    def list(self) -> list[TokenInfo]:
        """Every token, revoked ones included, oldest first."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(access_tokens).order_by(
                access_tokens.c.created_at, access_tokens.c.id)).all()
        return [TokenInfo(r.id, r.role, r.scope, r.note, r.created_at, r.revoked_at)
                for r in rows]
