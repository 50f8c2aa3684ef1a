"""Token authentication for the node server: a bearer token in the ``authorization``
header of every call, compared in constant time.

Servers bind 127.0.0.1 unless told otherwise, and a non-loopback bind needs a token
(``require_token_for``): on a shared network, anyone who can reach the port could
otherwise read every tensor the node holds. A server refuses to start with a weak token
(``check_token``: shorter than 16 characters, or blank), and a request with two
``authorization`` headers is refused. The token may come from a file (``--token-file``,
$TENSORDB_TOKEN_FILE), so that it does not show in the command line of the process. The middleware runs in the serving process
(``tensordb serve``), on Flight's threads; the helpers in every process that calls a node.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import socket

import pyarrow.flight as fl

from tensordb.config import TOKEN_FILE_ENV, env_token, read_token_file
from tensordb.errors import InvalidInput, Unauthorized

__all__ = ["TokenMiddlewareFactory", "auth_headers", "resolve_token", "is_loopback", "unauthorized",
           "require_token_for", "check_token", "bearer_ok", "TOKEN_ENV", "TOKEN_FILE_ENV",
           "MIN_TOKEN_LENGTH"]

#: where the node server and its clients read the token when no flag gives it
TOKEN_ENV = "TENSORDB_TOKEN"
#: the shortest token a server accepts: a guessable token protects nothing
MIN_TOKEN_LENGTH = 16
_HEADER = "authorization"


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
    shorter than MIN_TOKEN_LENGTH, blank at either end, or with characters an HTTP
    header cannot carry (printable ASCII only)."""
    if not isinstance(token, str) or len(token) < MIN_TOKEN_LENGTH:
        raise InvalidInput(f"the token is too weak: it needs at least {MIN_TOKEN_LENGTH} "
                           f"characters (a random one: python -c 'import secrets; "
                           f"print(secrets.token_urlsafe(32))')")
    if token.strip() != token or not (token.isascii() and token.isprintable()):
        raise InvalidInput("the token must be printable ASCII with no whitespace at either "
                           "end (a header carries it)")


def bearer_ok(values: list[str | bytes], expected: bytes) -> bool:
    """Whether the ``authorization`` values of one request are exactly one bearer
    token equal to ``expected`` (compared in constant time); two headers are refused."""
    if len(values) != 1:
        return False
    got = values[0] if isinstance(values[0], bytes) else values[0].encode()
    return hmac.compare_digest(got, expected)


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


class _Accepted(fl.ServerMiddleware):
    """The call carried the token; nothing to add to it."""


class TokenMiddlewareFactory(fl.ServerMiddlewareFactory):
    """Refuses (Unauthenticated) every call whose bearer token is not the server's."""

    def __init__(self, token: str) -> None:
        super().__init__()
        self._expected = f"Bearer {token}".encode()

    def start_call(self, info: fl.CallInfo, headers: dict[str, list[str | bytes]]
                   ) -> fl.ServerMiddleware:
        if bearer_ok(headers.get(_HEADER, []), self._expected):
            return _Accepted()
        raise fl.FlightUnauthenticatedError("this node requires its token "
                                            "(one authorization: Bearer ... header)")


def unauthorized(node: str, address: str) -> Unauthorized:
    """The error a client raises when a node refuses its token."""
    return Unauthorized(f"node {node!r} at {address} refused the request: missing or wrong "
                        f"token (give token= to connect, or set ${TOKEN_ENV})", node=node)
