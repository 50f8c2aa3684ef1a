"""``tensordb quota``: byte quotas per tenant (a scope glob over collection names).

``set GLOB SIZE`` gives a tenant a quota (``10GiB``, ``500MiB`` or bytes; binary
units, so ``500MB`` is read as 500 MiB), ``list``
shows each with what its collections store now, ``drop GLOB`` ends one. A commit that
would take a tenant past its quota is StoreFull naming it (docs/operations.md,
"Quotas"). Part of the CLI application layer: registered on ``tensordb.cli.app`` when
that module loads.
"""

from __future__ import annotations

from typing import Annotated

import humanfriendly
import typer
from rich.markup import escape
from rich.table import Table

from ._display import TABLE_STYLE, human_bytes
from .cli import _console, _open, app
from .errors import InvalidInput

__all__ = ["quota_app"]

quota_app = typer.Typer(no_args_is_help=True,
                        help="Byte quotas per tenant: the collections a scope glob matches.")
app.add_typer(quota_app, name="quota")

_Scope = Annotated[str, typer.Argument(metavar="GLOB", help="The tenant: a glob of '*' and "
                                       "'?' over collection names ('team-a/*').")]


def _size(text: str) -> int:
    try:
        return int(humanfriendly.parse_size(text, binary=True))
    except humanfriendly.InvalidSize:
        raise InvalidInput(f"a quota is a size (10GiB, 500MiB, or bytes), not {text!r}"
                           ) from None


@quota_app.command("set")
def quota_set_command(ctx: typer.Context, scope: _Scope, size: Annotated[str, typer.Argument(
        metavar="SIZE", help="The most its collections may store together: 10GiB, "
        "500MiB, or bytes (binary: 500MB is read as 500MiB).")]) -> None:
    """Give a tenant a quota (replacing the one it has)."""
    max_bytes = _size(size)
    with _open(ctx) as db:
        db.set_quota(scope, max_bytes)
    _console(stderr=True).print(f"quota on {escape(repr(scope))}: {human_bytes(max_bytes)}")


@quota_app.command("list")
def quota_list_command(ctx: typer.Context) -> None:
    """Every quota, with what its tenant's collections store now."""
    with _open(ctx) as db:
        rows = db.quotas()
    table = Table(**TABLE_STYLE)
    table.add_column("scope", overflow="fold")
    for col in ("quota", "stored", "used"):
        table.add_column(col, justify="right", no_wrap=True)
    for q in rows:
        share = f"{100 * q.used_bytes / q.max_bytes:.1f} %" if q.max_bytes else "-"
        table.add_row(escape(q.scope), human_bytes(q.max_bytes), human_bytes(q.used_bytes),
                      share)
    _console().print(table if rows else "no quotas")


@quota_app.command("drop")
def quota_drop_command(ctx: typer.Context, scope: _Scope) -> None:
    """End a tenant's quota."""
    with _open(ctx) as db:
        db.drop_quota(scope)
