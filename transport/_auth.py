"""Token authentication and scoped access for the node server: a bearer token in the
``authorization`` header of every call, compared in constant time.

Two kinds of token open a node that has one. The cluster's own (``--token``): nodes
carry it to each other, and it has the ``node`` role (read anything, pull, metrics;
commit nothing). And the scoped tokens of the catalog (``tensordb token create``,
``tensordb.catalog.TokenStore``): a role (read, write, admin) on the collection and KV
namespace names a glob matches. ``Authenticator`` tells which a request carries, and
every handler checks what it is asked against it (``check_access``).

Servers bind 127.0.0.1 unless told otherwise, and a non-loopback bind needs a token
(``require_token_for``): on a shared network, anyone who can reach the port could
otherwise read every tensor the node holds. A server refuses to start with a weak token
(``check_token``: shorter than 16 characters, or blank), and a request with two
``authorization`` headers is refused. The token may come from a file (``--token-file``,
$TENSORDB_TOKEN_FILE), so that it does not show in the command line of the process. The middleware runs in the serving process
(``tensordb serve``), on Flight's threads; the helpers in every process that calls a node.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Sequence

import pyarrow.flight as fl

from tensordb.catalog import NODE_ROLE, Grant, TokenStore
from tensordb.config import TOKEN_FILE_ENV, env_token, read_token_file
from tensordb.errors import InvalidInput, Unauthorized

__all__ = ["Authenticated", "Authenticator", "GRANT_TTL", "check_access", "TokenMiddlewareFactory", "auth_headers", "resolve_token", "is_loopback", "unauthorized",
           "require_token_for", "check_token", "TOKEN_ENV", "TOKEN_FILE_ENV",
           "MIN_TOKEN_LENGTH"]

#: where the node server and its clients read the token when no flag gives it
TOKEN_ENV = "TENSORDB_TOKEN"
#: the shortest token a server accepts: a guessable token protects nothing
MIN_TOKEN_LENGTH = 16
_HEADER = "authorization"
_log = logging.getLogger("tensordb.transport")


def resolve_token(token: str | None, token_file: str | os.PathLike[str] | None = None
                  ) -> str | None:
    """The token given, else the one in ``token_file``, else $TENSORDB_TOKEN, else the
    file $TENSORDB_TOKEN_FILE names, else None (an empty string counts as none)."""
    if token is not None and token_file is not None:
        raise InvalidInput("give a token or a token file, not both")
    if token_file is not None:
        return read_token_file(token_file)
    return token or (env_token() if token is None else None)


def check_token(token: str) -> None:
    """Refuse a token a server should not start with (InvalidInput, never echoing it):
    shorter than MIN_TOKEN_LENGTH, blank at either end, with characters an HTTP header
    cannot carry (printable ASCII only), or in the form of the catalog's scoped tokens
    (``tdb_...``)."""
    if not isinstance(token, str) or len(token) < MIN_TOKEN_LENGTH:
        raise InvalidInput(f"the token is too weak: it needs at least {MIN_TOKEN_LENGTH} "
                           f"characters (a random one: python -c 'import secrets; "
                           f"print(secrets.token_urlsafe(32))')")
    if token.strip() != token or not (token.isascii() and token.isprintable()):
        raise InvalidInput("the token must be printable ASCII with no whitespace at either "
                           "end (a header carries it)")
    if token.startswith("tdb_"):  # the Authenticator would take it for the node role
        raise InvalidInput("that is a scoped token of the catalog ('tensordb token create'): "
                           "a node's own token must be another secret, or every holder of "
                           "the scoped token would have the node role")


def auth_headers(token: str | None) -> list[tuple[bytes, bytes]]:
    """The call headers a client sends: the bearer token, if it has one."""
    return [(_HEADER.encode(), f"Bearer {token}".encode())] if token else []


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and names that resolve only to them ('localhost')."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def require_token_for(host: str, token: str | None) -> None:
    """Refuse a bind on a non-loopback address without a token (InvalidInput)."""
    if not token and not is_loopback(host):
        raise InvalidInput(f"refusing to serve on {host!r} without a token: give --token-file "
                           f"(or --token), or set ${TOKEN_FILE_ENV} or ${TOKEN_ENV} (only "
                           f"loopback addresses may go without one)")


#: seconds a token's grant (or its refusal) is kept before the catalog is asked again:
#: a revoked token stops working within this long
GRANT_TTL = 5.0
_CACHE_MAX = 4096


class Authenticator:
    """Who a request's bearer token is: the cluster's own token (``node``: the node
    role, every name) or a live token of the catalog's ``TokenStore`` (its role and
    scope). Shared by the Flight middleware, the data plane and the metrics endpoint of
    one node server, on any of their threads.

    Catalog lookups are cached for ``ttl`` seconds (refusals too, so a client retrying
    a wrong token does not hammer the catalog), at most _CACHE_MAX entries; a catalog
    that does not answer refuses the token rather than letting it through."""

    def __init__(self, node_token: str, tokens: TokenStore | None = None, *,
                 ttl: float = GRANT_TTL) -> None:
        self._node_token = node_token.encode()
        self._tokens = tokens
        self._ttl = ttl
        self._cache: dict[bytes, tuple[float, Grant | None]] = {}
        self._lock = threading.Lock()

    def grant(self, token: str | bytes | None) -> Grant | None:
        """What a bare token (no ``Bearer``) allows; None when it is nobody's."""
        if token is None:
            return None
        raw = token if isinstance(token, bytes) else token.encode("utf-8", "replace")
        if hmac.compare_digest(raw, self._node_token):
            return _NODE_GRANT
        if self._tokens is None or not raw.startswith(b"tdb_"):
            return None
        key = hashlib.sha256(raw).digest()  # the cache never holds a secret
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        try:
            got = self._tokens.grant(raw.decode("ascii", "replace"))
        except Exception as exc:  # noqa: BLE001 - refused, never let through
            _log.warning("could not look a token up in the catalog: %s", exc)
            return None
        with self._lock:
            while len(self._cache) >= _CACHE_MAX:  # the oldest lookups go first
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = (now + self._ttl, got)
        return got

    def header_grant(self, values: Sequence[str | bytes]) -> Grant | None:
        """What the ``authorization`` values of one request allow: exactly one
        ``Bearer <token>`` header, else nobody."""
        if len(values) != 1:
            return None
        got = values[0] if isinstance(values[0], bytes) else values[0].encode()
        if not got.startswith(b"Bearer "):
            return None
        return self.grant(got[len(b"Bearer "):])


_NODE_GRANT = Grant(NODE_ROLE, "*")


class Authenticated(fl.ServerMiddleware):
    """The call carried a token; ``grant`` is what it allows."""

    def __init__(self, grant: Grant) -> None:
        super().__init__()
        self.grant = grant


class TokenMiddlewareFactory(fl.ServerMiddlewareFactory):
    """Refuses (Unauthenticated) every call whose bearer token is nobody's; the
    handlers read the call's grant from its ``Authenticated`` middleware."""

    def __init__(self, auth: Authenticator) -> None:
        super().__init__()
        self.auth = auth

    def start_call(self, info: fl.CallInfo, headers: dict[str, list[str | bytes]]
                   ) -> fl.ServerMiddleware:
        grant = self.auth.header_grant(headers.get(_HEADER, []))
        if grant is not None:
            return Authenticated(grant)
        raise fl.FlightUnauthenticatedError("this node requires a token (one "
                                            "authorization: Bearer ... header)")


def check_access(grant: Grant | None, action: str, names: Iterable[str], node: str,
                 what: str) -> None:
    """Raise Unauthorized unless ``grant`` may ``action`` on every one of ``names``
    (None: the node runs without tokens, and everything is allowed). ``what`` says
    what was asked, for the message; the first name refused is named."""
    if grant is None:
        return
    if not grant.may(action):
        raise Unauthorized(f"a {grant.role} token may not {action} ({what}) on node "
                           f"{node!r}", node=node)
    for name in names:
        if not grant.covers(name):
            raise Unauthorized(f"this token's scope {grant.scope!r} does not cover "
                               f"{name!r} ({what}) on node {node!r}", collection=name,
                               node=node)


def unauthorized(node: str, address: str) -> Unauthorized:
    """The error a client raises when a node refuses its token."""
    return Unauthorized(f"node {node!r} at {address} refused the request: missing or wrong "
                        f"token (give token= to connect, or set ${TOKEN_ENV})", node=node)
