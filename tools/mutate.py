"""Mutation testing of the modules that keep tensordb's promises (``make mutate``).

Each *mutant* is one small change to one line of a module (a comparison flipped, ``and``
for ``or``, a ``raise`` dropped, a constant changed, ...). A mutant is *killed* when the
tests chosen for its module fail (or hang past the timeout), and *survives* when they
pass: a change of behaviour no test notices. The score of a module is killed / mutants.

Mutants run in a scratch git worktree (``.mutate/``), one at a time, so the checkout is
never touched; each runs only its module's tests (``TARGETS`` below), stopping at the
first failure. Run by hand, not in CI: every mutant of every target (some 500) takes
about three hours on a shared 2-core host; ``--sample 10`` over all but _groups, half an
hour.

    python tools/mutate.py                      # every target
    python tools/mutate.py --module tensordb/catalog/_groups.py --limit 20
    python tools/mutate.py --sample 20          # 20 mutants a module, evenly spread
    python tools/mutate.py --list               # the mutants, without running them

Writes ``.mutate/report.json`` (every mutant: module, line, change, outcome) and prints
the score per module and every survivor.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRATCH = ROOT / ".mutate"

#: module -> (functions to mutate (empty: all), the tests that must notice). The functions
#: are those that keep a promise; the tests, the fewest that cover them (one catalog
#: backend where the code under test does not depend on it), so that a run of every
#: target but _groups fits in about 45 minutes of one core.
TARGETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # commits and conflicts (both backends: the commit has a PostgreSQL path of its own)
    "tensordb/catalog/_versions.py": (
        ("_check_conflict", "_close_rows", "publish_in"),
        ("tests/test_client.py", "tests/test_shards.py", "-k",
         "conflict or delete or commit")),
    # group commits: tiling, parts, aborts
    "tensordb/catalog/_groups.py": (
        ("check_tiling", "box_copies", "_commit_part", "_publish", "join", "reap"),
        ("tests/test_shards.py",)),
    # checksums and verification
    "tensordb/client/_read.py": (
        ("refuse", "checked_bytes", "_check_extent", "read_into"),
        ("tests/test_client.py", "tests/test_shards.py", "tests/test_integrity.py", "-k",
         "(corrupt or verify or flip or read_into or slice or marked) and not postgres")),
    "transport/_pull.py": (
        ("feed", "complete", "split_ranges"),
        ("tests/test_transport_pull.py",)),
    # KV: the facade over the native index (first writer wins, pins, eviction, spill and
    # leases are in storage_engine/kv/, which this tool does not mutate: its Python callers are)
    "storage_engine/_kv.py": (
        ("put_batch", "_slice_end", "get", "read_into", "flush", "_native", "check_keys"),
        ("tests/test_kv.py", "tests/test_kv_batch.py", "-k",
         "first or pin or evict or writer or full or corrupt or batch or spill or disk")),
    # auth
    "transport/_auth.py": ((), ("tests/test_transport.py", "tests/test_hardening.py",
                                "tests/test_transport_pull.py", "-k",
                                "(token or auth or unauthorized or bad_settings) "
                                "and not postgres")),
    # safetensors validation (the header, its entries, their extents)
    "tensordb/client/_safetensors_format.py": (
        ("_read_raw_header", "_parse_entry", "_parse_header", "_check_extents",
         "_element_bytes", "_is_count"),
        ("tests/test_safetensors.py", "-k", "not postgres")),
    # query binding: parameters checked and bound, never pasted
    "query/_plan.py": (
        ("param", "value", "_check_value", "check_params"),
        ("tests/test_query.py", "-k",
         "parameters or injection or errors or where or result_types")),
}


@dataclass
class Mutant:
    module: str
    index: int
    line: int
    change: str
    outcome: str = "not run"  # killed / survived / timeout / not run
    seconds: float = 0.0


_FLIP = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.GtE, ast.GtE: ast.Lt,
         ast.Gt: ast.LtE, ast.LtE: ast.Gt, ast.In: ast.NotIn, ast.NotIn: ast.In,
         ast.Is: ast.IsNot, ast.IsNot: ast.Is}
_BIN = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult}


class _Mutator(ast.NodeTransformer):
    """Counts the mutation points of a tree; with ``target`` set, applies that one."""

    def __init__(self, functions: tuple[str, ...], target: int | None = None) -> None:
        self.functions = functions
        self.target = target
        self.points: list[tuple[int, str]] = []
        self._inside = 0

    def _point(self, node: ast.AST, change: str) -> bool:
        self.points.append((getattr(node, "lineno", 0), change))
        return len(self.points) - 1 == self.target

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        chosen = not self.functions or node.name in self.functions
        self._inside += chosen
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            node.body = [body[0], *[self.visit(b) for b in body[1:]]]  # not the docstring
        else:
            node.body = [self.visit(b) for b in body]
        self._inside -= chosen
        return node

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        if self._inside:
            for i, op in enumerate(node.ops):
                flip = _FLIP.get(type(op))
                if flip is not None and self._point(
                        node, f"{type(op).__name__} -> {flip.__name__}"):
                    node.ops[i] = flip()
        return node

    def visit_BoolOp(self, node: ast.BoolOp) -> ast.AST:
        self.generic_visit(node)
        if self._inside:
            other = ast.Or if isinstance(node.op, ast.And) else ast.And
            if self._point(node, f"{type(node.op).__name__} -> {other.__name__}"):
                node.op = other()
        return node

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        self.generic_visit(node)
        if self._inside and isinstance(node.op, ast.Not) and self._point(node, "drop not"):
            return node.operand
        return node

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        swap = _BIN.get(type(node.op))
        if self._inside and swap is not None and self._point(
                node, f"{type(node.op).__name__} -> {swap.__name__}"):
            node.op = swap()
        return node

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        if self._inside:
            v = node.value
            if isinstance(v, bool):
                if self._point(node, f"{v} -> {not v}"):
                    return ast.copy_location(ast.Constant(not v), node)
            elif isinstance(v, int) and self._point(node, f"{v} -> {v + 1}"):
                return ast.copy_location(ast.Constant(v + 1), node)
        return node

    def visit_Raise(self, node: ast.Raise) -> ast.AST:
        self.generic_visit(node)
        if self._inside and node.exc is not None and self._point(node, "drop raise"):
            return ast.copy_location(ast.Pass(), node)
        return node


def mutants(module: str, functions: tuple[str, ...]) -> list[Mutant]:
    tree = ast.parse((ROOT / module).read_text())
    m = _Mutator(functions)
    m.visit(tree)
    return [Mutant(module, i, line, change) for i, (line, change) in enumerate(m.points)]


def mutated_source(module: str, functions: tuple[str, ...], index: int) -> str:
    tree = ast.parse((ROOT / module).read_text())
    tree = _Mutator(functions, index).visit(tree)
    ast.fix_missing_locations(tree)
    return ast.unparse(tree)


def _scratch() -> Path:
    """A worktree of the committed HEAD (commit what you want tested), with the native
    module beside its source."""
    work = SCRATCH / "tree"
    if not work.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(work), "HEAD"], cwd=ROOT,
                       check=True, capture_output=True)
    for so in (ROOT / "storage_engine").glob("_stream*.so"):
        (work / "storage_engine" / so.name).write_bytes(so.read_bytes())
    return work


def _run(work: Path, tests: tuple[str, ...], timeout: float) -> str:
    env = {**os.environ, "PYTHONPATH": str(work), "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p",
                               "no:cacheprovider", *tests], cwd=work, env=env,
                              capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout"
    return "survived" if proc.returncode == 0 else "killed"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--module", action="append", help="only these modules (repeatable)")
    ap.add_argument("--limit", type=int, default=0, help="at most this many mutants each")
    ap.add_argument("--sample", type=int, default=0,
                    help="at most this many mutants each, spread evenly over the module "
                         "(a score to estimate in less time; --limit takes the first)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant")
    ap.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    args = ap.parse_args(argv)
    chosen = {m: TARGETS[m] for m in (args.module or TARGETS)}
    todo: list[Mutant] = []
    for module, (functions, _) in chosen.items():
        found = mutants(module, functions)
        if args.sample and len(found) > args.sample:
            found = [found[i * len(found) // args.sample] for i in range(args.sample)]
        todo.extend(found[: args.limit] if args.limit else found)
    if args.list:
        for m in todo:
            print(f"{m.module}:{m.line}  {m.change}")
        print(f"{len(todo)} mutants")
        return 0
    work = _scratch()
    try:
        baseline = {m: _run(work, tests, args.timeout) for m, (_, tests) in chosen.items()}
        broken = [m for m, outcome in baseline.items() if outcome != "survived"]
        if broken:
            print(f"the tests of {broken} fail without any mutant: fix them first")
            return 2
        for i, m in enumerate(todo, 1):
            functions, tests = chosen[m.module]
            path = work / m.module
            original = path.read_text()
            path.write_text(mutated_source(m.module, functions, m.index))
            t0 = time.monotonic()
            try:
                m.outcome = _run(work, tests, args.timeout)
            finally:
                path.write_text(original)
            m.seconds = round(time.monotonic() - t0, 1)
            print(f"[{i}/{len(todo)}] {m.module}:{m.line} {m.change}: {m.outcome} "
                  f"({m.seconds} s)", flush=True)
    finally:
        (SCRATCH / "report.json").write_text(json.dumps([asdict(m) for m in todo], indent=1))
    print("\nscore per module (killed, with timeouts, of the mutants run):")
    for module in chosen:
        mine = [m for m in todo if m.module == module]
        killed = sum(m.outcome in ("killed", "timeout") for m in mine)
        print(f"  {module}: {killed}/{len(mine)}"
              + (f" = {killed / len(mine):.0%}" if mine else ""))
    survivors = [m for m in todo if m.outcome == "survived"]
    print(f"\n{len(survivors)} survivors:")
    for m in survivors:
        print(f"  {m.module}:{m.line}  {m.change}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
