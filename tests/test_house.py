"""The shape of the code, checked by the suite itself (docs/architecture.md, "The layers"):
what import-linter cannot see.

- the lower layers load without the client facade above them (the lazy package faces);
- no module reaches another module's private attributes (``db._tiers``): each room of a
  package uses what its neighbours publish;
- the client's runtime imports have no cycle (type-only imports may);
- no module of the five packages is over 700 lines.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tensordb", "storage_engine", "query", "transport", "engine_bindings")
MAX_LINES = 700
#: the private names of namedtuple's API (public by its own documentation)
NAMEDTUPLE_API = {"_make", "_replace", "_asdict", "_fields", "_field_defaults"}


def _modules() -> Iterator[Path]:
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


@pytest.mark.parametrize("module", ["tensordb.errors", "tensordb.config", "tensordb.catalog",
                                    "tensordb.arrow", "query", "transport", "tensordb"])
def test_a_lower_layer_loads_without_the_client_facade(module: str) -> None:
    code = (f"import sys, {module}\n"
            "print(sorted(m for m in sys.modules if m.startswith('tensordb.client')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.strip()
    assert out == "[]", f"import {module} loaded {out}"


def test_the_package_faces_load_their_names_on_first_use() -> None:
    code = ("import sys, tensordb, query, transport\n"
            "heavy = ('pyarrow.flight', 'lark', 'tensordb.client')\n"
            "print([m for m in heavy if m in sys.modules])\n"
            "assert tensordb.Database.__module__ == 'tensordb.client._database'\n"
            "assert transport.FlightTransport and query.parse\n"
            "print([m for m in heavy if m in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.split("\n")
    assert out[0] == "[]"
    assert out[1] == "['pyarrow.flight', 'lark', 'tensordb.client']"


def test_an_unknown_name_of_a_face_is_an_attribute_error() -> None:
    import tensordb

    with pytest.raises(AttributeError, match="no attribute 'Databse'"):
        _ = tensordb.Databse  # type: ignore[attr-defined]


def _defined_names(tree: ast.Module) -> set[str]:
    """Every private name a module defines: functions, classes, their methods and
    class attributes, attributes it assigns on any object, module globals."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.isidentifier():
            names.add(node.value)  # __slots__ entries, getattr/setattr names
    return {n for n in names if n.startswith("_")}


def _reaches(path: Path) -> Iterator[str]:
    tree = _tree(path)
    own = _defined_names(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        attr, base = node.attr, node.value
        if not attr.startswith("_") or attr.startswith("__") or attr in NAMEDTUPLE_API:
            continue
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            continue
        if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) \
                and base.func.id == "super":
            continue
        if attr in own:  # the module's own private state, of another object of its own
            continue
        yield f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"


def test_no_module_reaches_another_modules_private_attributes() -> None:
    found = [r for p in _modules() for r in _reaches(p)]
    assert found == [], "\n".join(found)


def test_the_reach_check_finds_a_reach() -> None:
    """The check above can fail: a module reading a private attribute it does not
    define is found; one reading its own is not."""
    probe = ROOT / "tensordb" / "client" / "_probe_reach.py"
    try:
        probe.write_text("def f(db):\n    return db._tiers\n\n\nclass A:\n"
                         "    def __init__(self):\n        self._x = 1\n\n"
                         "    def same(self, other):\n        return other._x\n")
        assert [r.split(": ")[1] for r in _reaches(probe)] == ["db._tiers"]
    finally:
        probe.unlink()


def _runtime_imports(path: Path, package: str) -> set[str]:
    """The modules of ``package`` that ``path`` imports when it runs: every import
    (module level or in a function) outside ``if TYPE_CHECKING:`` blocks."""
    tree = _tree(path)
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(n) for b in node.body for n in ast.walk(b))
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                out.add(f"{package}.{node.module}")
            elif node.level == 1:
                out.update(f"{package}.{a.name}" for a in node.names)
            elif node.level == 0 and node.module and node.module.startswith(package + "."):
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith(package + "."))
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)) is not None:
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def _client_graph() -> dict[str, set[str]]:
    package = "tensordb.client"
    return {f"{package}.{p.stem}": _runtime_imports(p, package)
            for p in sorted((ROOT / "tensordb" / "client").glob("_*.py"))}


def test_the_clients_runtime_imports_have_no_cycle() -> None:
    graph = _client_graph()
    assert len(graph) > 10 and any(graph.values())
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_check_finds_a_cycle() -> None:
    graph = _client_graph()
    graph["tensordb.client._inputs"] = graph["tensordb.client._inputs"] | {
        "tensordb.client._database"}
    found = _cycle(graph)
    assert found is not None and found[0] == found[-1]


def test_no_module_is_over_700_lines() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
             for p in _modules()}
    assert len(sizes) > 100
    over = {p: n for p, n in sizes.items() if n > MAX_LINES}
    assert over == {}, over


_CLOCKS = ("monotonic()", "perf_counter()", "time.time()")


def _timed_asserts(path: Path) -> Iterator[str]:
    """Tests asserting on a clock reading without the ``deadline`` marker."""
    for node in ast.walk(_tree(path)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                or not node.name.startswith("test_"):
            continue
        if any("mark.deadline" in ast.unparse(d) for d in node.decorator_list):
            continue
        for a in ast.walk(node):
            if isinstance(a, ast.Assert) and any(c in ast.unparse(a.test) for c in _CLOCKS):
                yield f"{path.relative_to(ROOT)}:{a.lineno}: {node.name}"


def test_every_assertion_on_a_clock_is_a_marked_deadline_check() -> None:
    """docs/testing.md: no speed is asserted in a unit test; a test checking that a
    timeout is honoured says so (``@pytest.mark.deadline``, a bound of 3x or more)."""
    tests = sorted((ROOT / "tests").rglob("test_*.py"))
    assert len(tests) > 40
    found = [t for p in tests for t in _timed_asserts(p)]
    assert found == [], "\n".join(found)
    marked = [p for p in tests if "mark.deadline" in p.read_text(encoding="utf-8")]
    assert len(marked) >= 4  # the check sees the marked ones
