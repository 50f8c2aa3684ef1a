"""Plans: a parsed SELECT compiled to one SQLAlchemy Core query over the catalog.

Every value of the statement (literal or :parameter) becomes a bound parameter; no
text of the statement reaches the SQL. Names are checked against the virtual table,
kinds against each other (a string is not compared with an integer; a string compared
with a timestamp must be one), and aggregates against GROUP BY, so that both catalogs
either run a statement the same way or it fails here with the place it is wrong.

Plans are cached per (statement, dialect): they hold no values of parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime, timezone
from functools import lru_cache
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Float,
    String,
    and_,
    bindparam,
    cast,
    distinct,
    false,
    func,
    literal,
    not_,
    null,
    or_,
    select,
    true,
)

from tensordb.catalog.schema import UTCDateTime
from tensordb.errors import QueryError

from . import _ast as A
from ._tables import TABLES, VTable

__all__ = ["SelectPlan", "ParamSpec", "plan_select", "condition_plan", "check_params",
           "parse_time", "AGGREGATES"]

AGGREGATES = ("avg", "count", "max", "min", "sum")
_KIND_TEXT = {"int": "an integer", "float": "a number", "str": "a string",
              "time": "a timestamp", "bool": "a boolean", None: "a value"}
_SA_TYPE = {"int": BigInteger, "float": Float, "str": String, "time": UTCDateTime,
            "bool": Boolean}


def _err(message: str, pos: A.Pos | None, expected: Sequence[str] = ()) -> QueryError:
    line, column = pos or (1, 1)
    return QueryError(f"{message} at line {line}, column {column}", line=line, column=column,
                      expected=list(expected))


def _numeric(kind: str | None) -> bool:
    return kind in ("int", "float")


def _compatible(a: str | None, b: str | None) -> bool:
    return a is None or b is None or a == b or (_numeric(a) and _numeric(b))


def parse_time(text: str) -> datetime | None:
    """An ISO 8601 date or timestamp (UTC unless it says otherwise), else None."""
    try:
        v = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    return v.replace(tzinfo=timezone.utc) if v.tzinfo is None else v


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """A :parameter of a plan: the kinds its value must have, where it was first used."""

    name: str
    kinds: frozenset[str]
    expanding: bool
    pos: A.Pos | None


@dataclass(frozen=True)
class SelectPlan:
    statement: A.Select
    table: VTable
    query: Any  # sqlalchemy Select
    names: tuple[str, ...]  # output column names
    kinds: tuple[str | None, ...]  # their kinds
    params: tuple[ParamSpec, ...]
    joins: tuple[str, ...]
    columns: tuple[str, ...]  # the virtual columns it reads


class _Typed:
    """A compiled expression: SQL, kind, and whether it holds an aggregate."""

    __slots__ = ("sql", "kind", "agg")

    def __init__(self, sql: Any, kind: str | None, agg: bool = False) -> None:
        self.sql, self.kind, self.agg = sql, kind, agg


class _Compiler:
    def __init__(self, table: VTable, dialect: str) -> None:
        self.table = table
        self.dialect = dialect
        self.needs: set[str] = set()
        self.used: dict[str, None] = {}
        self.params: dict[str, ParamSpec] = {}
        self.clause = "WHERE"  # where aggregates are refused, for the error

    # -- leaves ------------------------------------------------------------------------
    def column(self, e: A.Column) -> _Typed:
        col = self.table.columns.get(e.name)
        if col is None:
            raise _err(f"unknown column {e.name!r} in table {self.table.name!r}", e.pos,
                       list(self.table.columns))
        self.needs.update(col.needs)
        self.used[e.name] = None
        return _Typed(col.expr, col.kind)

    def param(self, p: A.Param, kind: str | None, *, expanding: bool = False) -> Any:
        old = self.params.get(p.name)
        kinds = (old.kinds if old else frozenset()) | ({kind} if kind else set())
        if old is not None and old.expanding != expanding:
            raise _err(f"parameter :{p.name} is used both as a list and as a value", p.pos,
                       [f":{p.name} used one way"])
        self.params[p.name] = ParamSpec(p.name, kinds, expanding, old.pos if old else p.pos)
        type_ = _SA_TYPE.get(kind or "")
        return bindparam(f"p_{p.name}", type_=type_() if type_ else None, expanding=expanding)

    def value(self, e: A.Expr, kind: str | None, against: str) -> _Typed:
        """A literal or parameter compared with something of ``kind`` (``against``
        names that something, for errors)."""
        if isinstance(e, A.Param):
            return _Typed(self.param(e, kind), kind)
        assert isinstance(e, A.Literal)
        v = e.value
        if v is None:
            raise _err(f"comparing {against} with NULL is never true; use IS NULL or "
                       f"IS NOT NULL", e.pos, ["IS NULL", "IS NOT NULL"])
        if isinstance(v, bool):
            vkind = "bool"
        elif isinstance(v, int):
            vkind = "int"
        elif isinstance(v, float):
            vkind = "float"
        else:
            vkind = "str"
        if kind == "time" and vkind == "str":
            t = parse_time(v)  # type: ignore[arg-type]
            if t is None:
                raise _err(f"{v!r} is not a timestamp (comparing it with {against})", e.pos,
                           ["an ISO 8601 timestamp such as '2025-01-31 12:00:00'"])
            return _Typed(literal(t, UTCDateTime()), "time")
        if not _compatible(kind, vkind):
            raise _err(f"cannot compare {against} ({_KIND_TEXT[kind]}) with "
                       f"{_KIND_TEXT[vkind]} {A.render_expr(e)}", e.pos, [_KIND_TEXT[kind]])
        return _Typed(literal(v, _SA_TYPE[vkind]()), kind or vkind)

    # -- expressions -------------------------------------------------------------------
    def expr(self, e: A.Expr, *, agg_ok: bool, in_agg: bool = False) -> _Typed:
        if isinstance(e, A.Column):
            return self.column(e)
        if isinstance(e, (A.Literal, A.Param)):
            if isinstance(e, A.Literal) and e.value is None:
                return _Typed(null(), None)
            # a value standing alone (a select-list item, a predicate's left side): a
            # literal is typed by itself and cast, so that PostgreSQL knows the type of its
            # parameter; a parameter's type is unknown until it is bound
            if isinstance(e, A.Param):
                return _Typed(self.param(e, None), None)
            t = self.value(e, None, "a value")
            return _Typed(cast(t.sql, _SA_TYPE[t.kind or "str"]), t.kind)
        if isinstance(e, A.Call):
            return self.call(e, agg_ok=agg_ok, in_agg=in_agg)
        if isinstance(e, (A.And, A.Or)):
            parts = [self.condition(i, agg_ok=agg_ok, in_agg=in_agg) for i in e.items]
            fn = and_ if isinstance(e, A.And) else or_
            return _Typed(fn(*(p.sql for p in parts)), "bool", any(p.agg for p in parts))
        if isinstance(e, A.Not):
            p = self.condition(e.operand, agg_ok=agg_ok, in_agg=in_agg)
            return _Typed(not_(p.sql), "bool", p.agg)
        if isinstance(e, A.Compare):
            return self.compare(e, agg_ok=agg_ok, in_agg=in_agg)
        if isinstance(e, A.Like):
            x = self.operand(e.operand, agg_ok=agg_ok, in_agg=in_agg)
            what = A.render_expr(e.operand)
            if x.kind not in ("str", None):
                raise _err(f"LIKE needs a string, and {what} is {_KIND_TEXT[x.kind]}",
                           e.operand.pos, ["a string column"])
            p = self.side(e.pattern, "str", what, agg_ok=agg_ok, in_agg=in_agg)
            # case-insensitive on every catalog (SQLite's LIKE is; PostgreSQL's is not)
            sql = x.sql.ilike(p.sql, escape="\\")
            return _Typed(not_(sql) if e.negated else sql, "bool", x.agg or p.agg)
        if isinstance(e, A.InList):
            x = self.operand(e.operand, agg_ok=agg_ok, in_agg=in_agg)
            what = A.render_expr(e.operand)
            items = [self.side(i, x.kind, what, agg_ok=agg_ok, in_agg=in_agg) for i in e.items]
            sql = x.sql.in_([i.sql for i in items])
            return _Typed(not_(sql) if e.negated else sql, "bool",
                          x.agg or any(i.agg for i in items))
        if isinstance(e, A.InParam):
            x = self.operand(e.operand, agg_ok=agg_ok, in_agg=in_agg)
            sql = x.sql.in_(self.param(e.param, x.kind, expanding=True))
            return _Typed(not_(sql) if e.negated else sql, "bool", x.agg)
        if isinstance(e, A.Between):
            x = self.operand(e.operand, agg_ok=agg_ok, in_agg=in_agg)
            what = A.render_expr(e.operand)
            lo = self.side(e.low, x.kind, what, agg_ok=agg_ok, in_agg=in_agg)
            hi = self.side(e.high, x.kind, what, agg_ok=agg_ok, in_agg=in_agg)
            sql = x.sql.between(lo.sql, hi.sql)
            return _Typed(not_(sql) if e.negated else sql, "bool", x.agg or lo.agg or hi.agg)
        if isinstance(e, A.IsNull):
            x = self.operand(e.operand, agg_ok=agg_ok, in_agg=in_agg)
            sql = x.sql.is_not(None) if e.negated else x.sql.is_(None)
            return _Typed(sql, "bool", x.agg)
        raise _err(f"cannot use {A.render_expr(e)} here", e.pos)  # pragma: no cover

    def operand(self, e: A.Expr, *, agg_ok: bool, in_agg: bool) -> _Typed:
        """The left side of a predicate: a value standing alone is typed by itself."""
        return self.expr(e, agg_ok=agg_ok, in_agg=in_agg)

    def side(self, e: A.Expr, kind: str | None, against: str, *, agg_ok: bool,
             in_agg: bool) -> _Typed:
        """The right side of a predicate: literals and parameters take ``kind``."""
        if isinstance(e, (A.Literal, A.Param)):
            return self.value(e, kind, against)
        t = self.expr(e, agg_ok=agg_ok, in_agg=in_agg)
        if not _compatible(kind, t.kind):
            raise _err(f"cannot compare {against} ({_KIND_TEXT[kind]}) with "
                       f"{A.render_expr(e)} ({_KIND_TEXT[t.kind]})", e.pos, [_KIND_TEXT[kind]])
        return t

    def compare(self, e: A.Compare, *, agg_ok: bool, in_agg: bool) -> _Typed:
        left, right = e.left, e.right
        # put the literal or parameter on the right, to type it by the other side
        if isinstance(left, (A.Literal, A.Param)) and not isinstance(right, (A.Literal, A.Param)):
            left, right = right, left
            op = {"<": ">", "<=": ">=", ">": "<", ">=": "<="}.get(e.op, e.op)
        else:
            op = e.op
        if isinstance(left, A.Literal) and left.value is None:
            raise _err("comparing NULL with anything is never true; use IS NULL or "
                       "IS NOT NULL", left.pos, ["IS NULL", "IS NOT NULL"])
        x = self.operand(left, agg_ok=agg_ok, in_agg=in_agg)
        y = self.side(right, x.kind, A.render_expr(left), agg_ok=agg_ok, in_agg=in_agg)
        a, b = x.sql, y.sql
        sql = {"=": a == b, "!=": a != b, "<": a < b, "<=": a <= b, ">": a > b,
               ">=": a >= b}[op]
        return _Typed(sql, "bool", x.agg or y.agg)

    def condition(self, e: A.Expr, *, agg_ok: bool, in_agg: bool = False) -> _Typed:
        """An expression used as true/false: WHERE, HAVING, AND/OR/NOT operands."""
        if isinstance(e, A.Literal) and isinstance(e.value, bool):
            return _Typed(true() if e.value else false(), "bool")
        if isinstance(e, A.Param):
            return _Typed(self.param(e, "bool"), "bool")
        t = self.expr(e, agg_ok=agg_ok, in_agg=in_agg)
        if t.kind not in ("bool", None):
            raise _err(f"{A.render_expr(e)} is {_KIND_TEXT[t.kind]}, not a condition", e.pos,
                       ["a condition such as x = 1"])
        return t

    def call(self, e: A.Call, *, agg_ok: bool, in_agg: bool) -> _Typed:
        if e.name not in AGGREGATES:
            raise _err(f"unknown function {e.name!r}", e.pos, [f"{f}(...)" for f in AGGREGATES])
        if not agg_ok:
            raise _err(f"aggregate {e.name}() is not allowed in {self.clause}", e.pos,
                       ["a column"])
        if in_agg:
            raise _err(f"aggregate {e.name}() cannot be inside another aggregate", e.pos,
                       ["a column"])
        if e.star:
            if e.name != "count":
                raise _err(f"{e.name}(*) is not a function; only count(*) is", e.pos,
                           ["count(*)", f"{e.name}(column)"])
            return _Typed(func.count(), "int", True)
        if len(e.args) != 1:
            raise _err(f"{e.name}() takes one argument, not {len(e.args)}", e.pos,
                       ["one argument"])
        arg = self.expr(e.args[0], agg_ok=True, in_agg=True)
        x = distinct(arg.sql) if e.distinct else arg.sql
        if e.name == "count":
            return _Typed(func.count(x), "int", True)
        if e.name in ("sum", "avg") and not _numeric(arg.kind) and arg.kind is not None:
            raise _err(f"{e.name}() needs numbers, and {A.render_expr(e.args[0])} is "
                       f"{_KIND_TEXT[arg.kind]}", e.args[0].pos, ["a numeric column"])
        if e.name == "avg":
            return _Typed(cast(func.avg(x), Float), "float", True)
        if e.name == "sum":
            if arg.kind == "int" and self.dialect == "postgresql":
                # PostgreSQL's sum(bigint) is numeric (a Decimal): keep it an integer
                return _Typed(cast(func.sum(x), BigInteger), "int", True)
            return _Typed(func.sum(x), arg.kind, True)
        fn = func.min if e.name == "min" else func.max
        return _Typed(fn(x, type_=arg.sql.type), arg.kind, True)


# -- SELECT ----------------------------------------------------------------------------
def _table(name: str, pos: A.Pos | None) -> VTable:
    t = TABLES.get(name)
    if t is None:
        raise _err(f"unknown table {name!r}", pos, list(TABLES))
    return t


def _out_name(item: A.SelectItem) -> str:
    if item.alias is not None:
        return item.alias
    if isinstance(item.expr, A.Column):
        return item.expr.name
    return A.render_expr(item.expr)


def _ungrouped(e: A.Expr, groups: set[A.Expr]) -> A.Column | None:
    """A column of ``e`` outside aggregates and GROUP BY, if any."""
    if e in groups or isinstance(e, (A.Literal, A.Param)):
        return None
    if isinstance(e, A.Call):
        return None
    if isinstance(e, A.Column):
        return e
    for c in A.children(e):
        bad = _ungrouped(c, groups)
        if bad is not None:
            return bad
    return None


def _position(e: A.Expr, n_items: int, clause: str) -> int | None:
    """``ORDER BY 2``: the select item it names (0-based), else None."""
    if isinstance(e, A.Literal) and isinstance(e.value, int) and not isinstance(e.value, bool):
        if not 1 <= e.value <= n_items:
            raise _err(f"{clause} {e.value} names no column of the select list (it has "
                       f"{n_items})", e.pos, [f"1 to {n_items}"])
        return e.value - 1
    return None


def _check_grouping(stmt: A.Select, items: Sequence[A.SelectItem], groups: Sequence[A.Expr],
                    order: Sequence[tuple[A.Expr, bool]]) -> None:
    """An aggregating query: every column outside an aggregate must be grouped."""
    if stmt.items is None:
        raise _err("SELECT * cannot be used with GROUP BY or aggregates; name the "
                   "columns", stmt.table_pos, ["the grouped columns and aggregates"])
    gset = set(groups)
    for e in [i.expr for i in items] + [e for e, _ in order] + (
            [stmt.having] if stmt.having is not None else []):
        bad = _ungrouped(e, gset)
        if bad is not None:
            raise _err(f"column {bad.name!r} must appear in GROUP BY or be used in an "
                       f"aggregate", bad.pos, [f"GROUP BY {bad.name}", "an aggregate"])


def _check_distinct(items: Sequence[A.SelectItem], order: Sequence[tuple[A.Expr, bool]]
                    ) -> None:
    """SELECT DISTINCT: ORDER BY may only name what is selected."""
    selected = {i.expr for i in items}
    for e, _ in order:
        if e not in selected:
            raise _err(f"with SELECT DISTINCT, ORDER BY {A.render_expr(e)} must be in the "
                       f"select list", e.pos, [A.render_expr(i.expr) for i in items])


def _labels(names: Sequence[str]) -> list[str]:
    """Output labels: unique, whatever the names (``n``, ``n_2``, ...)."""
    labels: list[str] = []
    for n in names:
        label, k = n, 1
        while label in labels:
            k += 1
            label = f"{n}_{k}"
        labels.append(label)
    return labels


def _resolve(e: A.Expr, clause: str, items: Sequence[A.SelectItem], table: VTable) -> A.Expr:
    """An alias or position of the select list in GROUP BY / ORDER BY -> its expr.

    As in SQL, ORDER BY reads an output name before a column of the table, and GROUP BY
    a column of the table before an output name."""
    k = _position(e, len(items), clause)
    if k is not None:
        return items[k].expr
    if isinstance(e, A.Column) and (clause == "ORDER BY" or e.name not in table.columns):
        for i in reversed(items):  # the last of two equal aliases wins, as in a dict
            if i.alias == e.name:
                return i.expr
    return e


def _limit(cc: _Compiler, v: int | A.Param) -> Any:
    return cc.param(v, "int") if isinstance(v, A.Param) else v


@lru_cache(maxsize=512)
def plan_select(stmt: A.Select, dialect: str) -> SelectPlan:
    """Compile a SELECT for a catalog of ``dialect`` ('sqlite', 'postgresql', ...)."""
    table = _table(stmt.table, stmt.table_pos)
    cc = _Compiler(table, dialect)
    if stmt.items is None:
        items = tuple(A.SelectItem(A.Column(n, pos=stmt.table_pos)) for n in table.columns)
    else:
        items = stmt.items
    names = [_out_name(i) for i in items]
    compiled = [cc.expr(i.expr, agg_ok=True) for i in items]
    where = cc.condition(stmt.where, agg_ok=False) if stmt.where is not None else None
    groups = [_resolve(g, "GROUP BY", items, table) for g in stmt.group_by]
    cc.clause = "GROUP BY"
    group_sql = [cc.expr(g, agg_ok=False).sql for g in groups]
    having = cc.condition(stmt.having, agg_ok=True) if stmt.having is not None else None
    aggregated = bool(groups) or having is not None or any(c.agg for c in compiled)
    order = [(_resolve(o.expr, "ORDER BY", items, table), o.descending) for o in stmt.order_by]
    cc.clause = "ORDER BY of a query that does not aggregate"
    order_sql = []
    for e, desc in order:
        t = cc.expr(e, agg_ok=aggregated)
        order_sql.append(t.sql.desc() if desc else t.sql.asc())
    if aggregated:
        _check_grouping(stmt, items, groups, order)
    if stmt.distinct:
        _check_distinct(items, order)
    q = select(*(c.sql.label(lab) for c, lab in zip(compiled, _labels(names), strict=True)))
    q = q.select_from(table.from_clause(cc.needs))
    conds = list(table.where) + ([where.sql] if where is not None else [])
    if conds:
        q = q.where(*conds)
    if group_sql:
        q = q.group_by(*group_sql)
    if having is not None:
        q = q.having(having.sql)
    if stmt.distinct:
        q = q.distinct()
    if order_sql:
        q = q.order_by(*order_sql)
    if stmt.limit is not None:
        q = q.limit(_limit(cc, stmt.limit))
    if stmt.offset is not None:
        q = q.offset(_limit(cc, stmt.offset))
    return SelectPlan(stmt, table, q, tuple(names), tuple(c.kind for c in compiled),
                      tuple(cc.params.values()), tuple(j.name for j in table.joins
                                                       if j.name in cc.needs),
                      tuple(cc.used))


def condition_plan(table_name: str, where: A.Expr | None, columns: Sequence[str],
                   dialect: str) -> SelectPlan:
    """The rows of ``columns`` of a virtual table that ``where`` selects (for PIN
    COLLECTIONS WHERE ..., COMMITS WHERE ...)."""
    stmt = A.Select(tuple(A.SelectItem(A.Column(c)) for c in columns), table_name, where,
                    order_by=tuple(A.OrderItem(A.Column(c)) for c in columns))
    return plan_select(stmt, dialect)


# -- parameters ------------------------------------------------------------------------
_SCALARS = (type(None), bool, int, float, str, datetime, date)


def _check_value(spec: ParamSpec, v: object) -> object:
    if not isinstance(v, _SCALARS):
        raise _err(f"parameter :{spec.name} must be a number, string, boolean, timestamp or "
                   f"None, not {type(v).__name__}", spec.pos,
                   [_KIND_TEXT[k] for k in sorted(spec.kinds)] or ["a value"])
    if v is None:
        return None
    for kind in spec.kinds:
        ok = {
            "int": isinstance(v, int) and not isinstance(v, bool),
            "float": isinstance(v, (int, float)) and not isinstance(v, bool),
            "str": isinstance(v, str),
            "bool": isinstance(v, bool),
            "time": isinstance(v, (datetime, date, str)),
        }[kind]
        if not ok:
            raise _err(f"parameter :{spec.name} must be {_KIND_TEXT[kind]}, not "
                       f"{type(v).__name__} {v!r:.40}", spec.pos, [_KIND_TEXT[kind]])
        if kind == "time":
            if isinstance(v, str):
                t = parse_time(v)
                if t is None:
                    raise _err(f"parameter :{spec.name} is not a timestamp: {v!r:.40}",
                               spec.pos, ["an ISO 8601 timestamp"])
                v = t
            elif not isinstance(v, datetime):
                v = datetime(v.year, v.month, v.day,  # type: ignore[union-attr]
                             tzinfo=timezone.utc)
        if kind == "int" and abs(v) > 2**63 - 1:  # type: ignore[arg-type]
            raise _err(f"parameter :{spec.name} is out of range", spec.pos,
                       ["a 64-bit integer"])
    return v


def check_params(specs: Sequence[ParamSpec], params: Mapping[str, object]) -> dict[str, object]:
    """The bind values for ``specs`` from the caller's ``params``; QueryError naming a
    missing parameter or one of the wrong kind. Parameters no spec uses are ignored."""
    out: dict[str, object] = {}
    for spec in specs:
        if spec.name not in params:
            raise _err(f"missing parameter :{spec.name}", spec.pos,
                       [f":{spec.name}"])
        v = params[spec.name]
        if spec.expanding:
            if isinstance(v, (str, bytes)) or not isinstance(v, (Sequence, set, frozenset)):
                raise _err(f"parameter :{spec.name} (after IN) must be a list, not "
                           f"{type(v).__name__}", spec.pos, ["a list"])
            out[f"p_{spec.name}"] = [_check_value(spec, x) for x in v]
        else:
            out[f"p_{spec.name}"] = _check_value(spec, v)
    return out
