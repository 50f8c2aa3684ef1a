"""Parsed statements: frozen, hashable values that print back as normalised text.

``str(statement)`` is the canonical form of a statement (keywords upper case, strings
quoted with ``''``, names quoted only where they must be): parsing it again gives an
equal statement. Source positions (``pos``: line, column) ride along for error
messages but take no part in equality, so one statement written two ways is one key
in the plan cache.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from ._grammar import RESERVED

__all__ = [
    "Pos",
    "Expr",
    "Column",
    "Literal",
    "Param",
    "Compare",
    "Like",
    "InList",
    "InParam",
    "Between",
    "IsNull",
    "And",
    "Or",
    "Not",
    "Call",
    "Statement",
    "SelectItem",
    "OrderItem",
    "Select",
    "Explain",
    "Snapshot",
    "Replicate",
    "OneCollection",
    "Collections",
    "Commits",
    "Selection",
    "Pin",
    "Unpin",
    "Evict",
    "DropVersions",
    "CreatePolicy",
    "ShowPolicies",
    "DropPolicy",
    "walk",
]

#: (line, column), both from 1
Pos = tuple[int, int]


def _pos() -> Pos | None:
    return field(default=None, compare=False, repr=False)


# -- expressions -------------------------------------------------------------------------
class Expr:
    """A node of a condition or select-list expression."""

    __slots__ = ()
    # every node is a dataclass with this field; declared here so code that takes any
    # Expr may read it (an annotation only: no slot, no class attribute)
    pos: Pos | None

    @property
    def depth(self) -> int:  # overridden by the compound nodes
        return 1

    def __str__(self) -> str:
        return render_expr(self)


@dataclass(frozen=True, slots=True)
class Column(Expr):
    name: str
    pos: Pos | None = _pos()


@dataclass(frozen=True, slots=True)
class Literal(Expr):
    value: None | bool | int | float | str
    pos: Pos | None = _pos()


@dataclass(frozen=True, slots=True)
class Param(Expr):
    """A named bind parameter ``:name``; its value comes with the execution."""

    name: str
    pos: Pos | None = _pos()


Operand = Expr


@dataclass(frozen=True, slots=True)
class Compare(Expr):
    op: str  # '=', '!=', '<', '<=', '>', '>='
    left: Expr
    right: Expr
    pos: Pos | None = _pos()
    depth: int = field(default=1, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Like(Expr):
    operand: Expr
    pattern: Expr
    negated: bool = False
    pos: Pos | None = _pos()
    depth: int = field(default=1, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class InList(Expr):
    operand: Expr
    items: tuple[Expr, ...]
    negated: bool = False
    pos: Pos | None = _pos()
    depth: int = field(default=1, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class InParam(Expr):
    """``x IN :names``: the parameter's value is a list."""

    operand: Expr
    param: Param
    negated: bool = False
    pos: Pos | None = _pos()
    depth: int = field(default=1, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Between(Expr):
    operand: Expr
    low: Expr
    high: Expr
    negated: bool = False
    pos: Pos | None = _pos()
    depth: int = field(default=1, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class IsNull(Expr):
    operand: Expr
    negated: bool = False
    pos: Pos | None = _pos()
    depth: int = field(default=1, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class And(Expr):
    items: tuple[Expr, ...]
    pos: Pos | None = _pos()
    depth: int = field(default=1, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Or(Expr):
    items: tuple[Expr, ...]
    pos: Pos | None = _pos()
    depth: int = field(default=1, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Not(Expr):
    operand: Expr
    pos: Pos | None = _pos()
    depth: int = field(default=1, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Call(Expr):
    """A function call; only the aggregates are known (checked when planned)."""

    name: str  # lower case
    args: tuple[Expr, ...]
    star: bool = False  # count(*)
    distinct: bool = False
    pos: Pos | None = _pos()
    depth: int = field(default=1, compare=False, repr=False)


def children(e: Expr) -> tuple[Expr, ...]:
    if isinstance(e, (Compare,)):
        return (e.left, e.right)
    if isinstance(e, Like):
        return (e.operand, e.pattern)
    if isinstance(e, InList):
        return (e.operand, *e.items)
    if isinstance(e, InParam):
        return (e.operand, e.param)
    if isinstance(e, Between):
        return (e.operand, e.low, e.high)
    if isinstance(e, (IsNull, Not)):
        return (e.operand,)
    if isinstance(e, (And, Or)):
        return e.items
    if isinstance(e, Call):
        return e.args
    return ()


def walk(e: Expr) -> Iterator[Expr]:
    """Every node of ``e``, parents first (depth is bounded by the parser)."""
    yield e
    for c in children(e):
        yield from walk(c)


# -- statements --------------------------------------------------------------------------
class Statement:
    """A parsed statement. ``str()`` gives its normalised text; ``kind`` its verb."""

    __slots__ = ()
    kind = "STATEMENT"

    @property
    def params(self) -> frozenset[str]:
        """The names of the bind parameters the statement uses."""
        return frozenset(_params(self))

    def __str__(self) -> str:
        return render(self)


@dataclass(frozen=True, slots=True)
class SelectItem:
    expr: Expr
    alias: str | None = None


@dataclass(frozen=True, slots=True)
class OrderItem:
    expr: Expr
    descending: bool = False


@dataclass(frozen=True, slots=True)
class Select(Statement):
    items: tuple[SelectItem, ...] | None  # None: SELECT *
    table: str
    where: Expr | None = None
    group_by: tuple[Expr, ...] = ()
    having: Expr | None = None
    order_by: tuple[OrderItem, ...] = ()
    limit: int | Param | None = None
    offset: int | Param | None = None
    distinct: bool = False
    pos: Pos | None = _pos()
    table_pos: Pos | None = _pos()
    kind = "SELECT"


@dataclass(frozen=True, slots=True)
class Explain(Statement):
    statement: Statement
    pos: Pos | None = _pos()
    kind = "EXPLAIN"


Ref = str | Param  # a name given literally or as a parameter


@dataclass(frozen=True, slots=True)
class Snapshot(Statement):
    collection: Ref
    tag: Ref
    version: int | Param | None = None
    pos: Pos | None = _pos()
    kind = "SNAPSHOT"


@dataclass(frozen=True, slots=True)
class Replicate(Statement):
    collection: Ref
    nodes: tuple[Ref, ...]
    version: int | Param | None = None
    pos: Pos | None = _pos()
    kind = "REPLICATE"


@dataclass(frozen=True, slots=True)
class OneCollection:
    """``COLLECTION name [AT VERSION n | AT TAG 'x']``: one version (the head by default)."""

    collection: Ref
    version: int | Param | None = None
    tag: Ref | None = None


@dataclass(frozen=True, slots=True)
class Collections:
    """``COLLECTIONS [WHERE ...]``: the head of each collection the condition selects."""

    where: Expr | None = None


@dataclass(frozen=True, slots=True)
class Commits:
    """``COMMITS [WHERE ...]``: each (collection, version) of the commits table selected."""

    where: Expr | None = None


Selection = OneCollection | Collections | Commits


@dataclass(frozen=True, slots=True)
class Pin(Statement):
    selection: Selection
    tier: Ref | None = None
    pos: Pos | None = _pos()
    kind = "PIN"


@dataclass(frozen=True, slots=True)
class Unpin(Statement):
    selection: Selection
    tier: Ref | None = None
    pos: Pos | None = _pos()
    kind = "UNPIN"


@dataclass(frozen=True, slots=True)
class Evict(Statement):
    selection: Selection
    tier: Ref
    pos: Pos | None = _pos()
    kind = "EVICT"


@dataclass(frozen=True, slots=True)
class DropVersions(Statement):
    collection: Ref
    keep_last: int | Param | None = None
    older_than: Ref | None = None  # an interval such as '7 days'
    pos: Pos | None = _pos()
    kind = "DROP VERSIONS"


@dataclass(frozen=True, slots=True)
class CreatePolicy(Statement):
    name: str
    trigger: str  # 'every', 'cron' or 'commit'
    schedule: str  # the interval, the cron expression or the collection
    statement: Statement
    pos: Pos | None = _pos()
    name_pos: Pos | None = _pos()
    kind = "CREATE POLICY"


@dataclass(frozen=True, slots=True)
class ShowPolicies(Statement):
    pos: Pos | None = _pos()
    kind = "SHOW POLICIES"


@dataclass(frozen=True, slots=True)
class DropPolicy(Statement):
    name: str
    pos: Pos | None = _pos()
    kind = "DROP POLICY"


# -- parameters --------------------------------------------------------------------------
def _params(s: Statement) -> Iterator[str]:
    exprs: list[Expr] = []
    refs: list[object] = []
    if isinstance(s, Select):
        exprs += [i.expr for i in s.items or ()]
        exprs += [e for e in (s.where, s.having) if e is not None]
        exprs += list(s.group_by) + [o.expr for o in s.order_by]
        refs += [s.limit, s.offset]
    elif isinstance(s, Explain):
        yield from _params(s.statement)
    elif isinstance(s, Snapshot):
        refs += [s.collection, s.tag, s.version]
    elif isinstance(s, Replicate):
        refs += [s.collection, s.version, *s.nodes]
    elif isinstance(s, (Pin, Unpin, Evict)):
        refs.append(s.tier)
        sel = s.selection
        if isinstance(sel, OneCollection):
            refs += [sel.collection, sel.version, sel.tag]
        elif sel.where is not None:
            exprs.append(sel.where)
    elif isinstance(s, DropVersions):
        refs += [s.collection, s.keep_last, s.older_than]
    for r in refs:
        if isinstance(r, Param):
            yield r.name
    for e in exprs:
        for node in walk(e):
            if isinstance(node, Param):
                yield node.name


# -- rendering ---------------------------------------------------------------------------
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_CNAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./-]*\Z")


def quote_string(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def quote_name(s: str) -> str:
    """A column, alias or table name: bare where the grammar reads it back as a name."""
    if _NAME_RE.match(s) and s.upper() not in RESERVED:
        return s
    return '"' + s.replace('"', '""') + '"'


def _ref(r: Ref | int) -> str:
    """A collection, tag, node or tier: bare where it can be, else a string."""
    if isinstance(r, Param):
        return ":" + r.name
    if isinstance(r, int):
        return str(r)
    if _CNAME_RE.match(r) and r.upper() not in RESERVED and not r.isdigit():
        return r
    return quote_string(r)


def _literal(v: object) -> str:
    if v is None:
        return "NULL"
    if v is True:
        return "TRUE"
    if v is False:
        return "FALSE"
    if isinstance(v, str):
        return quote_string(v)
    if isinstance(v, float):
        return repr(v)
    return str(v)


_PREC = {Or: 1, And: 2, Not: 3}


def _prec(e: Expr) -> int:
    p = _PREC.get(type(e))
    if p is not None:
        return p
    if isinstance(e, (Compare, Like, InList, InParam, Between, IsNull)):
        return 4
    return 5


def render_expr(e: Expr, parent: int = 0) -> str:
    """The text of ``e``; parenthesised where its parent binds tighter."""
    if isinstance(e, Column):
        text = quote_name(e.name)
    elif isinstance(e, Literal):
        text = _literal(e.value)
    elif isinstance(e, Param):
        text = ":" + e.name
    elif isinstance(e, Or):
        text = " OR ".join(render_expr(i, 1) for i in e.items)
    elif isinstance(e, And):
        text = " AND ".join(render_expr(i, 2) for i in e.items)
    elif isinstance(e, Not):
        text = "NOT " + render_expr(e.operand, 3)
    elif isinstance(e, Compare):
        text = f"{render_expr(e.left, 5)} {e.op} {render_expr(e.right, 5)}"
    elif isinstance(e, Like):
        text = (f"{render_expr(e.operand, 5)} {'NOT ' if e.negated else ''}LIKE "
                f"{render_expr(e.pattern, 5)}")
    elif isinstance(e, InList):
        text = (f"{render_expr(e.operand, 5)} {'NOT ' if e.negated else ''}IN ("
                + ", ".join(render_expr(i) for i in e.items) + ")")
    elif isinstance(e, InParam):
        text = f"{render_expr(e.operand, 5)} {'NOT ' if e.negated else ''}IN :{e.param.name}"
    elif isinstance(e, Between):
        text = (f"{render_expr(e.operand, 5)} {'NOT ' if e.negated else ''}BETWEEN "
                f"{render_expr(e.low, 5)} AND {render_expr(e.high, 5)}")
    elif isinstance(e, IsNull):
        text = f"{render_expr(e.operand, 5)} IS {'NOT ' if e.negated else ''}NULL"
    elif isinstance(e, Call):
        inner = "*" if e.star else ", ".join(render_expr(a) for a in e.args)
        text = f"{e.name}({'DISTINCT ' if e.distinct else ''}{inner})"
    else:  # pragma: no cover - every node type is handled above
        raise TypeError(f"not an expression: {e!r}")
    return f"({text})" if _prec(e) < parent else text


def _selection(sel: Selection) -> str:
    if isinstance(sel, OneCollection):
        text = f"COLLECTION {_ref(sel.collection)}"
        if sel.version is not None:
            text += f" AT VERSION {_ref(sel.version)}"
        elif sel.tag is not None:
            text += f" AT TAG {_value(sel.tag)}"
        return text
    word = "COLLECTIONS" if isinstance(sel, Collections) else "COMMITS"
    return word if sel.where is None else f"{word} WHERE {render_expr(sel.where)}"


def _value(r: Ref) -> str:
    """A tag, node or interval: always a string unless a parameter."""
    return ":" + r.name if isinstance(r, Param) else quote_string(r)


def _render_select(s: Select) -> str:
    parts = ["SELECT"]
    if s.distinct:
        parts.append("DISTINCT")
    if s.items is None:
        parts.append("*")
    else:
        parts.append(", ".join(render_expr(i.expr) + (f" AS {quote_name(i.alias)}"
                                                        if i.alias is not None else "")
                               for i in s.items))
    parts.append(f"FROM {quote_name(s.table)}")
    if s.where is not None:
        parts.append(f"WHERE {render_expr(s.where)}")
    if s.group_by:
        parts.append("GROUP BY " + ", ".join(render_expr(g) for g in s.group_by))
    if s.having is not None:
        parts.append(f"HAVING {render_expr(s.having)}")
    if s.order_by:
        parts.append("ORDER BY " + ", ".join(
            render_expr(o.expr) + (" DESC" if o.descending else "") for o in s.order_by))
    if s.limit is not None:
        parts.append(f"LIMIT {_ref(s.limit)}")
        if s.offset is not None:
            parts.append(f"OFFSET {_ref(s.offset)}")
    return " ".join(parts)


def _render_trigger(s: CreatePolicy) -> str:
    if s.trigger == "every":
        return f"EVERY {quote_string(s.schedule)}"
    if s.trigger == "cron":
        return f"CRON {quote_string(s.schedule)}"
    return f"ON COMMIT TO {_ref(s.schedule)}"


def _render_drop_versions(s: DropVersions) -> str:
    if s.keep_last is not None:
        return f"DROP VERSIONS OF {_ref(s.collection)} KEEP LAST {_ref(s.keep_last)}"
    assert s.older_than is not None
    return f"DROP VERSIONS OF {_ref(s.collection)} OLDER THAN {_value(s.older_than)}"


def render(s: Statement) -> str:
    """The normalised text of a statement."""
    if isinstance(s, Select):
        return _render_select(s)
    if isinstance(s, Explain):
        return f"EXPLAIN {render(s.statement)}"
    if isinstance(s, Snapshot):
        at = f" AT VERSION {_ref(s.version)}" if s.version is not None else ""
        return f"SNAPSHOT {_ref(s.collection)}{at} AS TAG {_value(s.tag)}"
    if isinstance(s, Replicate):
        at = f" AT VERSION {_ref(s.version)}" if s.version is not None else ""
        return (f"REPLICATE {_ref(s.collection)}{at} TO NODE "
                + ", ".join(_value(n) for n in s.nodes))
    if isinstance(s, (Pin, Unpin)):
        tier = f" IN TIER {_ref(s.tier)}" if s.tier is not None else ""
        return f"{s.kind} {_selection(s.selection)}{tier}"
    if isinstance(s, Evict):
        return f"EVICT {_selection(s.selection)} FROM TIER {_ref(s.tier)}"
    if isinstance(s, DropVersions):
        return _render_drop_versions(s)
    if isinstance(s, CreatePolicy):
        return f"CREATE POLICY {_ref(s.name)} {_render_trigger(s)} DO {render(s.statement)}"
    if isinstance(s, ShowPolicies):
        return "SHOW POLICIES"
    if isinstance(s, DropPolicy):
        return f"DROP POLICY {_ref(s.name)}"
    raise TypeError(f"not a statement: {s!r}")  # pragma: no cover
