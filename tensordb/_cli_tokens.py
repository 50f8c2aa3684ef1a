"""``tensordb token``: the scoped access tokens of the node servers' network API.

``create`` prints a new token on stdout (and nothing else there, so that a script can
keep it: ``TOKEN=$(tensordb token create --role read --scope 'team-a/*')``); the catalog
keeps only its hash. ``list`` shows every token without its secret, ``revoke`` ends one
(node servers stop taking it within ``transport.GRANT_TTL`` seconds). Part of the CLI
application layer: registered on ``tensordb.cli.app`` when that module loads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from .catalog import ROLES, TokenStore, ensure_schema, make_engine
from .cli import _console, _where, app
from .errors import NodeUnavailable

__all__ = ["token_app"]

token_app = typer.Typer(no_args_is_help=True,
                        help="Scoped access tokens of the node servers (kept hashed in the "
                        "catalog).")
app.add_typer(token_app, name="token")

_Catalog = Annotated[str | None, typer.Option(
    "--catalog", metavar="URL", help="The catalog the tokens live in (default: the global "
    "--catalog, else the embedded store's).", show_default=False)]


@contextmanager
def _tokens(ctx: typer.Context, catalog: str | None) -> Iterator[TokenStore]:
    w = _where(ctx)
    cfg = w.config() if catalog is None else type(w)(w.home, catalog, w.node,
                                                      w.data_dir).config()
    engine: Engine = make_engine(cfg.catalog_url, synchronous=cfg.sqlite_synchronous)
    try:
        ensure_schema(engine)
        yield TokenStore(engine)
    except OperationalError as exc:
        url = engine.url.render_as_string(hide_password=True)
        raise NodeUnavailable(f"the catalog at {url} does not answer: {exc.orig}") from exc
    finally:
        engine.dispose()


@token_app.command("create")
def token_create_command(
    ctx: typer.Context,
    role: Annotated[str, typer.Option(help=f"What the token may do: {', '.join(ROLES)}.")],
    scope: Annotated[str, typer.Option(
        metavar="GLOB", help="The collections and KV namespaces it covers, a glob "
        "('team-a/*'; '*': all).")],
    note: Annotated[str | None, typer.Option(help="A note kept beside it (who has it).",
                                             show_default=False)] = None,
    catalog: _Catalog = None,
) -> None:
    """Make a token and print it (only now: the catalog keeps its hash)."""
    with _tokens(ctx, catalog) as store:
        tid, token = store.create(role, scope, note)
    print(token, flush=True)
    _console(stderr=True).print(f"token {tid}: {role} on {escape(repr(scope))}")


@token_app.command("list")
def token_list_command(ctx: typer.Context, catalog: _Catalog = None) -> None:
    """Every token's id, role, scope, note and state (no secret)."""
    with _tokens(ctx, catalog) as store:
        rows = store.list()
    table = Table("id", "role", "scope", "note", "created", "revoked")
    for r in rows:
        table.add_row(r.id, r.role, escape(r.scope), escape(r.note or ""),
                      f"{r.created_at:%Y-%m-%d %H:%M}",
                      f"{r.revoked_at:%Y-%m-%d %H:%M}" if r.revoked_at else "")
    _console().print(table)


@token_app.command("revoke")
def token_revoke_command(
    ctx: typer.Context,
    token_id: Annotated[str, typer.Argument(metavar="ID", help="The token's id (or the "
                                            "whole token).")],
    catalog: _Catalog = None,
) -> None:
    """Revoke a token: node servers refuse it within a few seconds."""
    with _tokens(ctx, catalog) as store:
        store.revoke(token_id)
    _console(stderr=True).print("revoked")
