"""Print the cost contracts' counts at both sizes: what tests/test_costs.py asserts,
as a table (the same measurements, made by the same helpers).

Run:  .venv/bin/python tools/cost_table.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import test_costs as T  # noqa: E402  (the contracts' own helpers)
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402


def row(table: Table, promise: str, test: str, small: T.Cost, big: T.Cost,
        counters: list[str]) -> None:
    def figures(c: T.Cost) -> str:
        vals = {"statements": len(T.runs(c.statements)), "VM steps": c.vm_steps,
                "faults": c.faults}
        return ", ".join(f"{k} {vals[k] if k in vals else c[k]:,}" for k in counters)

    table.add_row(promise, figures(small), figures(big), test)


def main() -> int:
    table = Table(title=f"cost contracts: counts at {T.SMALL:,} and {T.BIG:,} tensors")
    for col in ("promise", f"at {T.SMALL:,}", f"at {T.BIG:,}", "test (tests/test_costs.py)"):
        table.add_column(col)
    work = Path(tempfile.mkdtemp(prefix="tensordb-costs-"))
    db = T.store_of((T.SMALL, T.BIG), work / "store")
    try:
        def queued(d: Any, n: int) -> None:
            T.one_change(d, n, -2.0)
            T.drain(d)

        s, b = T.both(db, queued)
        row(table, "1-change commit + what it queues", "..._and_what_it_queues_...", s, b,
            ["statements", "VM steps", "rows_built", "bytes_copied", "manifest_rows_packed",
             "names_built"])
        T.open_touch_one(db, T.SMALL)
        T.open_touch_one(db, T.BIG)
        s, b = T.both(db, T.open_touch_one)
        row(table, "open + state_dict() + one tensor", "test_open_state_dict_and_one_...",
            s, b, ["statements", "VM steps", "rows_built", "names_built"])
        s, b = T.both(db, lambda d, n: d.history(f"c{n}"))
        row(table, "history", "test_history_costs_its_versions_...", s, b,
            ["statements", "VM steps", "commits_built"])

        def gc(d: Any, n: int) -> None:
            d.drop_versions(f"c{n}", keep_last=1)
            d.gc()

        db.gc()
        s, b = T.both(db, gc)
        row(table, "gc of the versions before the head", "test_gc_costs_what_it_drops", s, b,
            ["statements", "VM steps", "rows_built"])
    finally:
        T.remove_store(db)
    Console(width=160).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
