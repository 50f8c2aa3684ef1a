"""Running statements: SELECTs against the catalog, actions through the client API.

``execute(db, text_or_statement, params)`` returns a pyarrow.Table: the rows of a
SELECT (int64, float64, string, bool, timestamp[us, tz=UTC] columns), or one summary
row for anything else (``statement``, ``affected``, ``detail``), or the plan for
EXPLAIN (``item``, ``detail``). ``db`` is a ``PolicyStore``: the catalog, and the
client API's actions (``tag``, ``pin``, ``unpin``, ``evict``, ``drop_versions``,
``replicate``), which ``tensordb.Database`` has; actions go through them, so they
check and lock exactly as the API does. An action over many versions stops at the
first error, and the versions before it stay done. Errors are those of
``tensordb.errors``.

It runs in the calling process and thread (``Database.query``, the CLI, a policy
runner's scheduler thread) and blocks on the catalog and on the actions' work.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from functools import lru_cache
from typing import Any, Protocol, runtime_checkable

import pyarrow as pa
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from tensordb.catalog import Catalog, write_conn
from tensordb.catalog.schema import policies
from tensordb.errors import InvalidInput, NotFound, QueryError

from . import _ast as A
from ._parser import _parse_one, parse
from ._plan import SelectPlan, check_params, condition_plan, plan_select
from ._schedule import parse_interval

__all__ = ["EvictResult", "PolicyStore", "execute", "to_arrow", "SUMMARY_SCHEMA",
           "EXPLAIN_SCHEMA"]

SUMMARY_SCHEMA = pa.schema([("statement", pa.string()), ("affected", pa.int64()),
                            ("detail", pa.string())])
EXPLAIN_SCHEMA = pa.schema([("item", pa.string()), ("detail", pa.string())])

_ARROW = {"int": pa.int64(), "float": pa.float64(), "str": pa.string(),
          "time": pa.timestamp("us", tz="UTC"), "bool": pa.bool_()}
_SHOWN = 20  # targets named in a summary's detail


# -- the store statements run against ------------------------------------------------
class EvictResult(Protocol):
    """What an eviction reports (``tensordb.EvictReport``)."""

    @property
    def segments(self) -> int:
        """Segments moved down a tier."""

    @property
    def nbytes(self) -> int:
        """Their bytes."""

    @property
    def skipped_pinned(self) -> int:
        """Segments left in place because a pin holds them."""


@runtime_checkable
class PolicyStore(Protocol):
    """What statements and policies use of a store: ``tensordb.Database`` has it all.

    SELECT, EXPLAIN and the policy statements read and write the catalog; the actions
    call these methods, with the client API's contracts (they may block, move bytes
    between tiers and nodes, and raise its errors)."""

    @property
    def catalog(self) -> Catalog:
        """The store's catalog (``engine``, ``info``, ``history``, ``commits_after``)."""

    def tag(self, collection: str, tag: str, *, version: int | None = None) -> int:
        """SNAPSHOT: tag a version (default the head); returns it."""

    def pin(self, collection: str, *, version: int | None = None, tag: str | None = None,
            tier: str = ...) -> int:
        """PIN: keep a version's bytes in ``tier``; returns the version."""

    def unpin(self, collection: str, *, version: int | None = None, tag: str | None = None,
              tier: str = ...) -> bool:
        """UNPIN: remove a pin; False if there was none."""

    def evict(self, collection: str, *, version: int | None = None, tag: str | None = None,
              tier: str = ...) -> EvictResult:
        """EVICT: move a version's unpinned bytes from ``tier`` down a tier."""

    def drop_versions(self, collection: str, *, keep_last: int | None = None,
                      older_than: timedelta | None = None) -> int:
        """DROP VERSIONS: forget old versions; returns how many."""

    def replicate(self, collection: str, *, version: int | None = None,
                  to: Iterable[str]) -> list[str]:
        """REPLICATE: make the ``to`` nodes hold a version; returns them."""


# -- results ---------------------------------------------------------------------------
def _array(values: Sequence[Any], kind: str | None) -> pa.Array:
    if kind == "bool":
        values = [None if v is None else bool(v) for v in values]
    try:
        return pa.array(values, type=_ARROW.get(kind or ""))
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
        # a driver's Decimal, or a value of an untyped parameter: convert it ourselves
        conv = {"int": int, "float": float}.get(kind or "", str)
        return pa.array([None if v is None else conv(v) for v in values],
                        type=_ARROW.get(kind or "", pa.string()))


def to_arrow(names: Sequence[str], kinds: Sequence[str | None], rows: Sequence[Any]) -> pa.Table:
    """Rows of a result -> a pyarrow.Table with one column per name (names may repeat)."""
    cols: list[Sequence[Any]] = list(zip(*rows, strict=True)) if rows else [()] * len(names)
    return pa.Table.from_arrays([_array(c, k) for c, k in zip(cols, kinds, strict=True)],
                                names=list(names))


def _summary(kind: str, affected: int, detail: str) -> pa.Table:
    return pa.Table.from_pylist([{"statement": kind, "affected": affected, "detail": detail}],
                                schema=SUMMARY_SCHEMA)


def _listing(items: Sequence[str], empty: str = "nothing selected") -> str:
    if not items:
        return empty
    shown = ", ".join(items[:_SHOWN])
    return shown + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


# -- values of actions -----------------------------------------------------------------
class _Unbound:
    """A parameter EXPLAIN was not given: shown by name."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f":{self.name}"


def _value(v: Any, params: Mapping[str, object], what: str, typ: type,
           lenient: bool = False) -> Any:
    """A literal, or a parameter's value checked to be a ``typ`` (None stays None)."""
    if not isinstance(v, A.Param):
        return v
    line, column = v.pos or (1, 1)
    if v.name not in params:
        if lenient:
            return _Unbound(v.name)
        raise QueryError(f"missing parameter :{v.name} at line {line}, column {column}",
                         line=line, column=column, expected=[f":{v.name}"])
    got = params[v.name]
    if not isinstance(got, typ) or isinstance(got, bool):
        want = "an integer" if typ is int else "a string"
        raise QueryError(f"parameter :{v.name} ({what}) must be {want}, not "
                         f"{type(got).__name__} at line {line}, column {column}",
                         line=line, column=column, expected=[want])
    if typ is int and got < 1:  # type: ignore[operator]
        raise QueryError(f"parameter :{v.name} ({what}) must be at least 1, not {got} at "
                         f"line {line}, column {column}", line=line, column=column,
                         expected=["an integer >= 1"])
    return got


def _tier(v: Any, params: Mapping[str, object], default: str | None,
          lenient: bool = False) -> Any:
    if v is None:
        return default
    tier = _value(v, params, "a tier", str, lenient)
    if isinstance(tier, str) and tier not in ("host", "gpu", "disk"):
        line, column = v.pos if isinstance(v, A.Param) and v.pos else (1, 1)
        raise QueryError(f"unknown tier {tier!r} at line {line}, column {column}", line=line,
                         column=column, expected=["host", "gpu", "disk"])
    return tier


# -- SELECT ------------------------------------------------------------------------------
def _rows(db: PolicyStore, plan: SelectPlan, params: Mapping[str, object]) -> list[Any]:
    binds = check_params(plan.params, params)
    try:
        with db.catalog.engine.connect() as conn:
            return conn.execute(plan.query, binds).all()
    except SQLAlchemyError as exc:
        line, column = plan.statement.pos or (1, 1)
        orig = getattr(exc, "orig", None) or exc
        raise QueryError(f"the catalog could not run the statement at line {line}, column "
                         f"{column}: {str(orig).splitlines()[0] if str(orig) else orig!r}",
                         line=line, column=column, expected=[]) from exc


def _select(db: PolicyStore, plan: SelectPlan, params: Mapping[str, object]) -> pa.Table:
    return to_arrow(plan.names, plan.kinds, _rows(db, plan, params))


# -- selections ------------------------------------------------------------------------
Target = tuple[str, Any, Any]  # (collection, version or None, tag or None)


def _selection_plan(sel: A.Selection, dialect: str) -> SelectPlan | None:
    if isinstance(sel, A.Collections):
        return condition_plan("collections", sel.where, ("name", "head"), dialect)
    if isinstance(sel, A.Commits):
        return condition_plan("commits", sel.where, ("collection", "version"), dialect)
    return None


def _targets(db: PolicyStore, sel: A.Selection, params: Mapping[str, object], dialect: str,
             lenient: bool = False) -> list[Target]:
    if isinstance(sel, A.OneCollection):
        return [(_value(sel.collection, params, "a collection", str, lenient),
                 _value(sel.version, params, "a version", int, lenient),
                 _value(sel.tag, params, "a tag", str, lenient))]
    plan = _selection_plan(sel, dialect)
    assert plan is not None
    rows = _rows(db, plan, params)
    if isinstance(sel, A.Collections):  # a collection with no version yet has no head
        return [(name, head, None) for name, head in rows if head]
    return [(name, version, None) for name, version in rows]


def _label(t: Target, version: int | None = None) -> str:
    name, v, tag = t
    v = version if version is not None else v
    if v is not None:
        return f"{name} v{v}"
    return f"{name} tag {tag!r}" if tag is not None else f"{name} (head)"


def _call(fn: str, t: Target, **kw: object) -> str:
    args = [repr(t[0])]
    if t[1] is not None:
        args.append(f"version={t[1]!r}")
    if t[2] is not None:
        args.append(f"tag={t[2]!r}")
    args += [f"{k}={v!r}" for k, v in kw.items() if v is not None]
    return f"db.{fn}({', '.join(args)})"


# -- actions ---------------------------------------------------------------------------
def _action(db: PolicyStore, stmt: A.Statement, params: Mapping[str, object], dialect: str
            ) -> pa.Table:
    if isinstance(stmt, A.Snapshot):
        coll = _value(stmt.collection, params, "a collection", str)
        tag = _value(stmt.tag, params, "a tag", str)
        v = db.tag(coll, tag, version=_value(stmt.version, params, "a version", int))
        return _summary(stmt.kind, 1, f"tagged {coll} v{v} as {tag!r}")
    if isinstance(stmt, A.Replicate):
        coll = _value(stmt.collection, params, "a collection", str)
        version = _value(stmt.version, params, "a version", int)
        to = [_value(n, params, "a node", str) for n in stmt.nodes]
        held = list(db.replicate(coll, version=version, to=to))
        where = f"{coll} v{version}" if version is not None else f"{coll} (head)"
        return _summary(stmt.kind, len(held), f"{where} is on {_listing(held, 'no node')}")
    if isinstance(stmt, A.DropVersions):
        coll = _value(stmt.collection, params, "a collection", str)
        if stmt.keep_last is not None:
            keep = _value(stmt.keep_last, params, "KEEP LAST", int)
            n = db.drop_versions(coll, keep_last=keep)
            why = f"keeping the last {keep}"
        else:
            text = _value(stmt.older_than, params, "an interval", str)
            pos = stmt.older_than.pos if isinstance(stmt.older_than, A.Param) else stmt.pos
            n = db.drop_versions(coll, older_than=parse_interval(text, pos))
            why = f"older than {text}"
        return _summary(stmt.kind, int(n), f"dropped {n} version(s) of {coll}, {why}")
    assert isinstance(stmt, (A.Pin, A.Unpin, A.Evict))
    targets = _targets(db, stmt.selection, params, dialect)
    if isinstance(stmt, A.Pin):
        tier = _tier(stmt.tier, params, "host")
        done = [_label(t, db.pin(t[0], version=t[1], tag=t[2], tier=tier)) for t in targets]
        return _summary(stmt.kind, len(done), f"pinned in {tier}: {_listing(done)}")
    if isinstance(stmt, A.Unpin):
        tier = _tier(stmt.tier, params, "host")
        removed: list[str] = []
        absent: list[str] = []
        for t in targets:
            (removed if db.unpin(t[0], version=t[1], tag=t[2], tier=tier) else absent).append(
                _label(t))
        detail = f"unpinned from {tier}: {_listing(removed, 'none')}"
        if absent:
            detail += f"; not pinned there: {_listing(absent)}"
        return _summary(stmt.kind, len(removed), detail)
    tier = _tier(stmt.tier, params, None)
    segments = nbytes = skipped = 0
    for t in targets:
        rep = db.evict(t[0], version=t[1], tag=t[2], tier=tier)
        segments += rep.segments
        nbytes += rep.nbytes
        skipped += rep.skipped_pinned
    detail = (f"evicted {segments} segment(s), {nbytes} bytes from {tier} for "
              f"{_listing([_label(t) for t in targets])}")
    if skipped:
        detail += f"; {skipped} pinned segment(s) left in place"
    return _summary(stmt.kind, segments, detail)


# -- policies ----------------------------------------------------------------------------
_SHOW = A.Select(None, "policies", order_by=(A.OrderItem(A.Column("name")),))


def _create_policy(db: PolicyStore, stmt: A.CreatePolicy) -> pa.Table:
    line, column = stmt.name_pos or stmt.pos or (1, 1)
    dup = QueryError(f"a policy named {stmt.name!r} already exists (line {line}, column "
                     f"{column}); DROP POLICY it first", line=line, column=column,
                     expected=["a new policy name"])
    try:
        with write_conn(db.catalog.engine) as conn:
            if conn.execute(select(policies.c.name).where(policies.c.name == stmt.name)
                            ).first() is not None:
                raise dup
            conn.execute(policies.insert().values(
                name=stmt.name, trigger=stmt.trigger, schedule=stmt.schedule,
                statement=str(stmt.statement), enabled=True,
                created_at=datetime.now(timezone.utc)))
    except IntegrityError as exc:  # created by someone else meanwhile
        raise dup from exc
    return _summary(stmt.kind, 1, f"policy {stmt.name!r}: {_trigger_text(stmt)} do "
                                  f"{stmt.statement}")


def _trigger_text(stmt: A.CreatePolicy) -> str:
    if stmt.trigger == "every":
        return f"every {stmt.schedule}"
    if stmt.trigger == "cron":
        return f"cron {stmt.schedule!r} (UTC)"
    return f"on each commit to {stmt.schedule}"


def _drop_policy(db: PolicyStore, stmt: A.DropPolicy) -> pa.Table:
    with write_conn(db.catalog.engine) as conn:
        gone = conn.execute(delete(policies).where(policies.c.name == stmt.name)).rowcount
    if not gone:
        raise NotFound(f"no policy {stmt.name!r}")
    return _summary(stmt.kind, 1, f"dropped policy {stmt.name!r}")


# -- EXPLAIN ---------------------------------------------------------------------------
def _sql(plan: SelectPlan, db: PolicyStore) -> list[tuple[str, str]]:
    compiled = plan.query.compile(dialect=db.catalog.engine.dialect)
    rows = [("sql", " ".join(str(compiled).split()))]
    binds = [f"{k}={v!r}" for k, v in compiled.params.items() if not k.startswith("p_")]
    if binds:
        rows.append(("bound values", ", ".join(binds)))
    for spec in plan.params:
        kinds = "/".join(sorted(spec.kinds)) or "any"
        rows.append(("parameter", f":{spec.name} ({'list of ' if spec.expanding else ''}"
                                  f"{kinds})"))
    return rows


def _explain_select(plan: SelectPlan, db: PolicyStore) -> list[tuple[str, str]]:
    t = plan.table
    rows = [("table", f"{t.name}: {t.doc}"),
            ("reads", " ".join([t.base.name] + [j.text for j in t.joins if j.name in plan.joins]))]
    if t.where_text:
        rows.append(("always", t.where_text))
    rows += [("column", f"{name} = {t.columns[name].source}") for name in plan.columns]
    return rows + _sql(plan, db)


def _explain(db: PolicyStore, stmt: A.Statement, params: Mapping[str, object], dialect: str
             ) -> pa.Table:
    rows: list[tuple[str, str]] = [("statement", str(stmt)), ("dialect", dialect)]
    if isinstance(stmt, A.Select):
        rows += _explain_select(plan_select(stmt, dialect), db)
    elif isinstance(stmt, A.ShowPolicies):
        rows += _explain_select(plan_select(_SHOW, dialect), db)
    elif isinstance(stmt, A.CreatePolicy):
        rows += [("action", f"insert policy {stmt.name!r} into the policies table"),
                 ("trigger", _trigger_text(stmt)), ("runs", str(stmt.statement))]
        if stmt.statement.params:
            rows.append(("parameters", ", ".join(f":{p}" for p in sorted(stmt.statement.params))
                         + " (given by the policy runner)"))
    elif isinstance(stmt, A.DropPolicy):
        rows.append(("action", f"delete policy {stmt.name!r} from the policies table"))
    elif isinstance(stmt, A.Snapshot):
        rows.append(("call", _call("tag", (
            _value(stmt.collection, params, "a collection", str, True), None, None),
            tag=_value(stmt.tag, params, "a tag", str, True),
            version=_value(stmt.version, params, "a version", int, True))))
    elif isinstance(stmt, A.Replicate):
        rows.append(("call", _call("replicate", (
            _value(stmt.collection, params, "a collection", str, True),
            _value(stmt.version, params, "a version", int, True), None),
            to=[_value(n, params, "a node", str, True) for n in stmt.nodes])))
    elif isinstance(stmt, A.DropVersions):
        coll = _value(stmt.collection, params, "a collection", str, True)
        if stmt.keep_last is not None:
            kw: dict[str, object] = {"keep_last": _value(stmt.keep_last, params, "KEEP LAST",
                                                         int, True)}
        else:
            text = _value(stmt.older_than, params, "an interval", str, True)
            kw = {"older_than": parse_interval(text) if isinstance(text, str) else text}
        rows.append(("call", _call("drop_versions", (coll, None, None), **kw)))
    else:
        assert isinstance(stmt, (A.Pin, A.Unpin, A.Evict))
        fn = stmt.kind.lower()
        tier = _tier(stmt.tier, params, "host" if fn != "evict" else None, True)
        plan = _selection_plan(stmt.selection, dialect)
        if plan is not None:
            what = "collection's head" if plan.table.name == "collections" else "commit"
            rows.append(("selection", f"each {what} the condition selects"))
            rows += _sql(plan, db)
        if plan is not None and any(s.name not in params for s in plan.params):
            rows.append(("call", f"db.{fn}(...) for each selected version, tier={tier!r}"))
        else:
            targets = _targets(db, stmt.selection, params, dialect, lenient=True)
            rows += [("call", _call(fn, t, tier=tier)) for t in targets[:50]]
            if len(targets) > 50:
                rows.append(("call", f"... and {len(targets) - 50} more"))
            if not targets:
                rows.append(("call", "none: the selection is empty"))
    rows.append(("runs", "nothing: EXPLAIN only shows the plan"))
    return pa.Table.from_pylist([{"item": k, "detail": v} for k, v in rows],
                                schema=EXPLAIN_SCHEMA)


# -- entry point -------------------------------------------------------------------------
@lru_cache(maxsize=1024)
def _prepared(text: str, dialect: str) -> tuple[A.Statement, SelectPlan | None]:
    stmt = _parse_one(text)
    return stmt, plan_select(stmt, dialect) if isinstance(stmt, A.Select) else None


def execute(db: PolicyStore, statement: str | A.Statement,
            params: Mapping[str, object] | None = None) -> pa.Table:
    """Run one statement against ``db`` (a ``PolicyStore``, e.g. a ``tensordb.Database``)
    and return its table.

    ``statement``: text (parsed and planned once, then cached) or a Statement from
    ``parse``. ``params``: values of its ``:name`` parameters; names it does not use are
    ignored. Raises QueryError (with line, column, expected) for a statement that cannot
    be parsed or planned, and the API's errors (NotFound, InvalidInput, ...) for actions.
    May block on the catalog's write lock (actions, policies); SELECT and EXPLAIN only
    read.
    """
    if params is None:
        params = {}
    elif not isinstance(params, Mapping) or not all(isinstance(k, str) for k in params):
        raise InvalidInput(f"params must map parameter names to values, not "
                           f"{type(params).__name__}")
    dialect = db.catalog.engine.dialect.name
    if isinstance(statement, str):
        stmt, plan = _prepared(statement, dialect)
    else:
        stmt = parse(statement)
        if not isinstance(stmt, A.Statement):
            raise InvalidInput(f"not a statement: {type(statement).__name__}")
        plan = plan_select(stmt, dialect) if isinstance(stmt, A.Select) else None
    if plan is not None:
        return _select(db, plan, params)
    if isinstance(stmt, A.Explain):
        return _explain(db, stmt.statement, params, dialect)
    if isinstance(stmt, A.ShowPolicies):
        return _select(db, plan_select(_SHOW, dialect), params)
    if isinstance(stmt, A.CreatePolicy):
        return _create_policy(db, stmt)
    if isinstance(stmt, A.DropPolicy):
        return _drop_policy(db, stmt)
    return _action(db, stmt, params, dialect)
