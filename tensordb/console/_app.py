"""The console's web app (Starlette): its pages, its charts' data, and its sign-in.

Every route but the sign-in and the static files needs a token when the console has
an ``Authenticator``: the node's own token, or a scoped token of the catalog (any role:
the console only reads). A browser signs in once (``/login``, a form or the
``?token=`` link the console prints); the console keeps the token server-side and
gives the browser a random session id in an HttpOnly, SameSite=Strict cookie, so the
token never sits in the browser. The token is checked again on every request (the
Authenticator caches its grant for a few seconds), so a revoked token's session ends
within that time. Scripts call the JSON routes with the same cookie, or with
``authorization: Bearer <token>``.

Pages are Jinja2 templates (autoescaped); charts are drawn in the browser by Chart.js
(``static/``, vendored from its npm package: ``static/VENDORED``), from ``/api/kv``.
No inline script: the Content-Security-Policy allows only the console's own files.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from tensordb._display import human_bytes, shape_text
from tensordb.catalog import Grant
from tensordb.errors import InvalidInput, NotFound, QueryError, TensorDBError, Unauthorized

from . import _data as data
from ._series import KVSeries

if TYPE_CHECKING:
    from tensordb.client import Database
    from transport import Authenticator

__all__ = ["LOOPBACK_NAMES", "SESSION_COOKIE", "SESSION_TTL", "make_app"]

#: the Host names a console without tokens answers (beside the address it is bound to)
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")

_HERE = Path(__file__).parent
#: the cookie a signed-in browser carries: a random session id, never the token
SESSION_COOKIE = "tensordb_console"
#: seconds a browser session lasts without being used again
SESSION_TTL = 12 * 3600.0
_SESSIONS_MAX = 1024
_PUBLIC = ("/login", "/static/")
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_STATUS = {NotFound: 404, InvalidInput: 400, QueryError: 400, Unauthorized: 403}
_PAGES = (("collections", "Collections"), ("tiers", "Tiers"), ("kv", "KV cache"),
          ("nodes", "Nodes"), ("policies", "Policies"), ("query", "Query"))


class _Sessions:
    """Session id -> (token, last use); at most _SESSIONS_MAX, the stalest dropped."""

    def __init__(self) -> None:
        self._by_id: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def open(self, token: str) -> str:
        sid = secrets.token_urlsafe(32)
        now = time.monotonic()
        with self._lock:
            if len(self._by_id) >= _SESSIONS_MAX:
                stalest = min(self._by_id, key=lambda k: self._by_id[k][1])
                del self._by_id[stalest]
            self._by_id[sid] = (token, now)
        return sid

    def token(self, sid: str) -> str | None:
        now = time.monotonic()
        with self._lock:
            got = self._by_id.get(sid)
            if got is None:
                return None
            if now - got[1] > SESSION_TTL:
                del self._by_id[sid]
                return None
            self._by_id[sid] = (got[0], now)
            return got[0]

    def close(self, sid: str) -> None:
        with self._lock:
            self._by_id.pop(sid, None)


class _Guard(BaseHTTPMiddleware):
    """Who the request is (``request.state.grant``), and the security headers."""

    def __init__(self, app: Any, auth: Authenticator | None, sessions: _Sessions) -> None:
        super().__init__(app)
        self._auth = auth
        self._sessions = sessions

    async def dispatch(self, request: Request,
                       call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        request.state.grant = None
        path = request.url.path
        if self._auth is not None and not path.startswith(_PUBLIC):
            grant = self._grant(request)
            if grant is None:
                if path.startswith("/api/"):
                    return _secured(JSONResponse(
                        {"error": "Unauthorized", "message": "this console needs a token"},
                        401, headers={"WWW-Authenticate": "Bearer"}))
                target = path + (f"?{request.url.query}" if request.url.query else "")
                return _secured(RedirectResponse(f"/login?next={quote(target)}", 303))
            request.state.grant = grant
        return _secured(await call_next(request))

    def _grant(self, request: Request) -> Grant | None:
        assert self._auth is not None
        values = request.headers.getlist("authorization")
        if values:
            return self._auth.header_grant(values)
        sid = request.cookies.get(SESSION_COOKIE)
        token = self._sessions.token(sid) if sid else None
        return self._auth.grant(token) if token else None


def _secured(response: Response) -> Response:
    for k, v in _HEADERS.items():
        response.headers.setdefault(k, v)
    return response


def _status(exc: TensorDBError) -> int:
    return next((s for cls, s in _STATUS.items() if isinstance(exc, cls)), 500)


def _safe_next(target: str | None) -> str:
    """A redirect target on this console only (a path, never another host)."""
    if not target or not target.startswith("/") or target.startswith("//") \
            or "\\" in target or any(ord(ch) < 0x20 for ch in target):
        return "/"  # a browser reads "/\\host" as "//host"
    parts = urlsplit(target)
    return "/" if parts.scheme or parts.netloc else target


class _Console:
    """The endpoints of one console: the store, its sign-in, its templates."""

    def __init__(self, db: Database, auth: Authenticator | None, series: KVSeries,
                 secure: bool) -> None:
        self.db, self.auth, self.series, self.secure = db, auth, series, secure
        self.sessions = _Sessions()
        self.templates = Jinja2Templates(directory=str(_HERE / "templates"))
        env = self.templates.env
        env.filters["bytes"] = lambda n: human_bytes(int(n or 0))
        env.filters["shape"] = lambda s: shape_text([int(x) for x in s.split(",")] if s else [])
        env.filters["pct"] = lambda x: "-" if x is None else f"{100 * x:.1f} %"
        env.filters["when"] = _utc
        env.globals.update(pages=_PAGES, node=db.config.node, signed=auth is not None)

    def render(self, request: Request, template: str, current: str, status: int = 200,
               **values: Any) -> Response:
        grant: Grant | None = request.state.grant
        return self.templates.TemplateResponse(
            request, template, {"page": current, "grant": grant, **values},
            status_code=status)

    def page(self, template: str, current: str,
             build: Callable[[Request, Grant | None], data.Page]
             ) -> Callable[[Request], Response]:
        """An endpoint rendering ``template`` with what ``build`` reads; a TensorDBError
        is the error page with its status."""
        def endpoint(request: Request) -> Response:
            try:
                got = build(request, request.state.grant)
            except TensorDBError as exc:
                return self.render(request, "error.html", current, _status(exc),
                                   error=type(exc).__name__, message=str(exc))
            return self.render(request, template, current, withheld=got.withheld,
                               **got.values)
        return endpoint

    def query(self, request: Request) -> Response:
        text = request.query_params.get("q", "")
        try:
            if len(text) > 10_000:
                raise InvalidInput(f"a statement is at most 10,000 characters, not "
                                   f"{len(text)}")
            got = data.query_page(self.db, request.state.grant, text)
        except TensorDBError as exc:
            return self.render(request, "query.html", "query", _status(exc), text=text,
                               columns=[], rows=[], withheld=None, error=type(exc).__name__,
                               message=str(exc))
        return self.render(request, "query.html", "query", withheld=got.withheld,
                           error=None, **got.values)

    def kv_series(self, request: Request) -> Response:
        try:
            name = _arg(request, "name")
            if not data.visible(request.state.grant, name):
                raise NotFound(f"no KV namespace {name!r}")
        except TensorDBError as exc:
            return JSONResponse({"error": type(exc).__name__, "message": str(exc)},
                                _status(exc))
        return JSONResponse({"name": name, "interval": self.series.interval,
                             **self.series.series(name)})

    async def login(self, request: Request) -> Response:
        nxt = _safe_next(request.query_params.get("next"))
        token: str | None = request.query_params.get("token")
        if request.method == "POST":
            form = await request.form()
            value = form.get("token")
            token = value if isinstance(value, str) else None
            nxt = _safe_next(str(form.get("next") or "/"))
        if self.auth is None:
            return RedirectResponse(nxt, 303)
        if token is None:
            return self.render(request, "login.html", "login", next=nxt, failed=False)
        if self.auth.grant(token.strip()) is None:
            return self.render(request, "login.html", "login", 401, next=nxt, failed=True)
        response = RedirectResponse(nxt, 303)
        response.set_cookie(SESSION_COOKIE, self.sessions.open(token.strip()), httponly=True,
                            samesite="strict", secure=self.secure, path="/")
        return response

    def logout(self, request: Request) -> Response:
        sid = request.cookies.get(SESSION_COOKIE)
        if sid:
            self.sessions.close(sid)
        response = RedirectResponse("/login", 303)
        response.delete_cookie(SESSION_COOKIE, path="/")
        return response


def _utc(t: datetime | None) -> str:
    """A catalog time as UTC text (the catalog keeps UTC; a naive value is UTC too)."""
    if t is None:
        return "-"
    t = t.replace(tzinfo=timezone.utc) if t.tzinfo is None else t.astimezone(timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M:%S UTC")


def _arg(request: Request, key: str) -> str:
    value = request.query_params.get(key)
    if not value:
        raise InvalidInput(f"this page needs ?{key}=")
    return value


def _int_arg(request: Request, key: str, default: int | None = None) -> int:
    value = request.query_params.get(key)
    if value is None and default is not None:
        return default
    try:
        return int(value or "")
    except ValueError:
        raise InvalidInput(f"?{key}= must be an integer, not {value!r}") from None


def make_app(db: Database, auth: Authenticator | None, series: KVSeries, *,
             secure: bool = False, hosts: Sequence[str] = ()) -> Starlette:
    """The console of ``db``: pages and charts behind ``auth`` (None: no sign-in, a
    console on loopback beside a node without a token, which then answers only
    requests addressed to a loopback name or one of ``hosts``). ``secure``: served over
    TLS (the session cookie is then Secure)."""
    c = _Console(db, auth, series, secure)
    routes = [
        Route("/", lambda request: RedirectResponse("/collections", 303)),
        Route("/login", c.login, methods=["GET", "POST"]),
        Route("/logout", c.logout),
        Route("/collections", c.page("collections.html", "collections",
                                     lambda r, g: data.collections_page(db, g))),
        Route("/collection", c.page("collection.html", "collections",
                                    lambda r, g: data.collection_page(db, g, _arg(r, "name")))),
        Route("/version", c.page("version.html", "collections",
                                 lambda r, g: data.version_page(
                                     db, g, _arg(r, "name"), _int_arg(r, "v"),
                                     _int_arg(r, "offset", 0)))),
        Route("/tiers", c.page("tiers.html", "tiers", lambda r, g: data.tiers_page(db, g))),
        Route("/kv", c.page("kv.html", "kv", lambda r, g: data.kv_page(db, g))),
        Route("/nodes", c.page("nodes.html", "nodes", lambda r, g: data.nodes_page(db, g))),
        Route("/policies", c.page("policies.html", "policies",
                                  lambda r, g: data.policies_page(db, g))),
        Route("/query", c.query),
        Route("/api/kv", c.kv_series),
        Mount("/static", StaticFiles(directory=str(_HERE / "static")), name="static"),
    ]
    middleware = [Middleware(_Guard, auth=auth, sessions=c.sessions)]
    if auth is None:  # open on loopback: no other site's name may reach it (DNS rebinding)
        middleware.insert(0, Middleware(TrustedHostMiddleware,
                                        allowed_hosts=[*LOOPBACK_NAMES, *hosts]))
    return Starlette(routes=routes, middleware=middleware)
