"""Rich renderings shared by the command line and the demo: sizes, times, a history."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from rich import box
from rich.markup import escape
from rich.table import Table

__all__ = ["TABLE_STYLE", "cell_text", "history_table", "human_bytes", "result_table",
           "shape_text", "when_text"]

#: the look of every table the CLI prints
TABLE_STYLE: dict[str, Any] = {"box": box.SIMPLE_HEAD, "show_edge": False, "pad_edge": False,
                               "collapse_padding": True}


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def when_text(t: datetime) -> str:
    if t.tzinfo is None:  # SQLite hands back the stored UTC time without its zone
        t = t.replace(tzinfo=timezone.utc)
    return t.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def history_table(commits: Sequence[Any], tags: dict[str, int] | None = None,
                  title: str | None = None) -> Table:
    """A rich table of commits (newest first, as ``Database.history`` returns them)."""
    by_version: dict[int, list[str]] = {}
    for name, v in (tags or {}).items():
        by_version.setdefault(v, []).append(name)
    table = Table(title=title, title_justify="left", **TABLE_STYLE)
    table.add_column("version", justify="right", no_wrap=True, min_width=7)
    table.add_column("created", no_wrap=True, min_width=19)
    table.add_column("message", overflow="fold", ratio=1, min_width=10)
    table.add_column("tensors", justify="right", no_wrap=True, min_width=7)
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("written", justify="right", no_wrap=True)
    if by_version:
        table.add_column("tags", overflow="fold", min_width=4)
    for c in commits:
        row = [str(c.version), when_text(c.created_at), escape(c.message or ""), str(c.tensors),
               human_bytes(c.nbytes), f"{c.written} / {human_bytes(c.written_nbytes)}"]
        if by_version:
            row.append(escape(", ".join(sorted(by_version.get(c.version, [])))))
        table.add_row(*row)
    return table


def shape_text(shape: Sequence[int]) -> str:
    """(4, 3), or (4,) for one dimension, as Python writes a tuple."""
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def cell_text(value: object) -> str:
    """One value of a query result as table text (NULL, local times, short floats)."""
    if value is None:
        return "NULL"
    if isinstance(value, datetime):
        return when_text(value)
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".") if abs(value) < 1e15 else repr(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return escape(str(value))


def result_table(result: Any, title: str | None = None) -> Table:
    """A rich table of a query result (a pyarrow.Table)."""
    table = Table(title=title, title_justify="left", **TABLE_STYLE)
    for field in result.schema:
        numeric = str(field.type).startswith(("int", "uint", "double", "float"))
        table.add_column(escape(field.name), justify="right" if numeric else "left",
                         overflow="fold")
    for row in zip(*(col.to_pylist() for col in result.columns), strict=True):
        table.add_row(*(cell_text(v) for v in row))
    return table
