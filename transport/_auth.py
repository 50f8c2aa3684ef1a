"""Token authentication for the node server: a bearer token in the ``authorization``
header of every call, compared in constant time.

Servers bind 127.0.0.1 unless told otherwise, and a non-loopback bind needs a token
(``require_token_for``): on a shared network, anyone who can reach the port could
otherwise read every tensor the node holds. The middleware runs in the serving process
(``tensordb serve``), on Flight's threads; the helpers in every process that calls a node.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import socket

import pyarrow.flight as fl

from tensordb.errors import InvalidInput, Unauthorized

__all__ = ["TokenMiddlewareFactory", "auth_headers", "resolve_token", "is_loopback", "unauthorized",
           "require_token_for", "TOKEN_ENV"]

#: where the node server and its clients read the token when no flag gives it
TOKEN_ENV = "TENSORDB_TOKEN"
_HEADER = "authorization"


def resolve_token(token: str | None) -> str | None:
    """The token given, else $TENSORDB_TOKEN, else None (an empty string counts as none)."""
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    return token or None


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
        raise InvalidInput(f"refusing to serve on {host!r} without a token: give --token or "
                           f"set ${TOKEN_ENV} (only loopback addresses may go without one)")


class _Accepted(fl.ServerMiddleware):
    """The call carried the token; nothing to add to it."""


class TokenMiddlewareFactory(fl.ServerMiddlewareFactory):
    """Refuses (Unauthenticated) every call whose bearer token is not the server's."""

    def __init__(self, token: str) -> None:
        super().__init__()
        self._expected = f"Bearer {token}".encode()

    def start_call(self, info: fl.CallInfo, headers: dict[str, list[str | bytes]]
                   ) -> fl.ServerMiddleware:
        for value in headers.get(_HEADER, []):
            got = value if isinstance(value, bytes) else value.encode()
            if hmac.compare_digest(got, self._expected):
                return _Accepted()
        raise fl.FlightUnauthenticatedError("this node requires its token "
                                            "(authorization: Bearer ...)")


def unauthorized(node: str, address: str) -> Unauthorized:
    """The error a client raises when a node refuses its token."""
    return Unauthorized(f"node {node!r} at {address} refused the request: missing or wrong "
                        f"token (give token= to connect, or set ${TOKEN_ENV})", node=node)
