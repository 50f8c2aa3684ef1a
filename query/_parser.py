"""Text -> Statement: lark parses (LALR, no parse tree), the builder below makes the AST.

Every failure is a ``QueryError`` with ``line``, ``column`` and ``expected`` set: lark's
own errors are converted here, and the builder checks what the grammar cannot (numbers
in range, tiers, intervals, cron expressions, nesting depth) at the token that is wrong.
Parsed statements are cached by text; they are immutable.
"""

from __future__ import annotations

import math
from functools import cache, lru_cache
from typing import Any

from lark import Lark, Token, Transformer
from lark.exceptions import LarkError, UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from tensordb.errors import QueryError

from . import _ast as A
from ._grammar import GRAMMAR, KEYWORDS, describe_terminal
from ._schedule import check_schedule, parse_interval

__all__ = ["parse", "parse_script", "MAX_LENGTH", "MAX_DEPTH", "TIERS"]

#: longest statement text accepted (a policy or an operator's query, not a data load)
MAX_LENGTH = 100_000
#: deepest nesting of expressions (NOT NOT ..., parentheses around AND/OR)
MAX_DEPTH = 64
#: the tiers a statement may name
TIERS = ("host", "gpu", "disk")
_INT_MAX = 2**63 - 1
_POLICY_BODIES = ["SELECT", "SNAPSHOT", "REPLICATE", "PIN", "UNPIN", "EVICT", "DROP VERSIONS"]


def _pos(tok: Token) -> A.Pos:
    return (tok.line or 1, tok.column or 1)


def _err(message: str, pos: A.Pos | None, expected: list[str] | None = None) -> QueryError:
    line, column = pos or (1, 1)
    return QueryError(f"{message} at line {line}, column {column}", line=line, column=column,
                      expected=expected or [])


def _unquote(tok: Token) -> str:
    q = tok.value[0]
    return tok.value[1:-1].replace(q + q, q)


class _Star:
    """``*`` in a select list or a call."""


_STAR = _Star()


class _Ref:
    """A name or parameter with the place it was written."""

    __slots__ = ("value", "pos", "quoted")

    def __init__(self, value: str | A.Param, pos: A.Pos, quoted: bool) -> None:
        self.value, self.pos, self.quoted = value, pos, quoted


class _Count:
    __slots__ = ("value", "pos")

    def __init__(self, value: int | A.Param, pos: A.Pos) -> None:
        self.value, self.pos = value, pos


def _depth(*nodes: A.Expr, at: A.Pos | None = None) -> int:
    d = 1 + max(n.depth for n in nodes)
    if d > MAX_DEPTH:
        raise _err(f"expression nested more than {MAX_DEPTH} deep", at or nodes[0].pos,
                   [f"at most {MAX_DEPTH} levels of nesting"])
    return d


def _at_least(c: _Count | None, low: int, what: str) -> int | A.Param | None:
    if c is None:
        return None
    if isinstance(c.value, int) and c.value < low:
        raise _err(f"{what} must be at least {low}, not {c.value}", c.pos,
                   [f"an integer >= {low}"])
    return c.value


def _tier(r: _Ref | None) -> str | A.Param | None:
    if r is None:
        return None
    if isinstance(r.value, str) and r.value not in TIERS:
        raise _err(f"unknown tier {r.value!r}", r.pos, list(TIERS))
    return r.value


def _schedule(trigger: str, tok: Token) -> str:
    """The schedule of EVERY / CRON, checked by the rules the policy runner applies."""
    text = " ".join(_unquote(tok).split())
    try:
        check_schedule(trigger, text)
    except QueryError as exc:
        line, column = _pos(tok)
        column += 1 + (exc.column - 1 if exc.column and "\n" not in tok.value else 0)
        raise QueryError(f"{exc.message} (at line {line}, column {column})", line=line,
                         column=column, expected=exc.expected or ["a valid schedule"]) from None
    return text


class _Build(Transformer[Token, Any]):
    """Callbacks run by the LALR parser as it reduces: the AST is built in one pass."""

    # -- top level ---------------------------------------------------------------------
    def single(self, c: list[Any]) -> A.Statement:
        return c[0]

    def script(self, c: list[Any]) -> list[A.Statement]:
        return [s for s in c if isinstance(s, A.Statement)]

    def explain(self, c: list[Any]) -> A.Explain:
        if isinstance(c[1], A.Explain):
            raise _err("EXPLAIN cannot explain EXPLAIN", c[1].pos,
                       [k for k in _POLICY_BODIES + ["CREATE POLICY", "SHOW POLICIES",
                                                     "DROP POLICY"]])
        return A.Explain(c[1], pos=_pos(c[0]))

    # -- SELECT ------------------------------------------------------------------------
    def select(self, c: list[Any]) -> A.Select:
        kw, distinct, items, (table, table_pos), where, group, having, order, limit = c
        lim, off = limit if limit is not None else (None, None)
        return A.Select(items=None if items is _STAR else items, table=table, where=where,
                        group_by=group or (), having=having, order_by=order or (),
                        limit=_at_least(lim, 0, "LIMIT"), offset=_at_least(off, 0, "OFFSET"),
                        distinct=distinct is not None, pos=_pos(kw), table_pos=table_pos)

    def select_list(self, c: list[Any]) -> Any:
        if len(c) == 1 and isinstance(c[0], Token) and c[0].type == "STAR":
            return _STAR
        return tuple(c)

    def select_item(self, c: list[Any]) -> A.SelectItem:
        return A.SelectItem(c[0], c[1])

    def alias(self, c: list[Token]) -> str:
        return _unquote(c[0]) if c[0].type == "QNAME" else c[0].value

    def table_ref(self, c: list[Token]) -> tuple[str, A.Pos]:
        return (_unquote(c[0]) if c[0].type == "QNAME" else c[0].value), _pos(c[0])

    def where_clause(self, c: list[Any]) -> A.Expr:
        return c[0]

    def having_clause(self, c: list[Any]) -> A.Expr:
        return c[0]

    def group_clause(self, c: list[Any]) -> tuple[A.Expr, ...]:
        return tuple(c)

    def order_clause(self, c: list[Any]) -> tuple[A.OrderItem, ...]:
        return tuple(c)

    def order_item(self, c: list[Any]) -> A.OrderItem:
        return A.OrderItem(c[0], c[1] is not None and c[1].type == "DESC")

    def limit_clause(self, c: list[Any]) -> tuple[_Count, _Count | None]:
        return c[0], c[1]

    def count(self, c: list[Token]) -> _Count:
        tok = c[0]
        if tok.type == "PARAM":
            return _Count(A.Param(tok.value[1:], pos=_pos(tok)), _pos(tok))
        return _Count(self._int(tok), _pos(tok))

    # -- expressions -------------------------------------------------------------------
    @staticmethod
    def _int(tok: Token) -> int:
        v = int(tok.value)
        if abs(v) > _INT_MAX:
            raise _err(f"integer {tok.value[:30]} is out of range", _pos(tok),
                       ["an integer of at most 19 digits"])
        return v

    def or_(self, c: list[Any]) -> A.Or:
        items = [i for x in c for i in (x.items if isinstance(x, A.Or) else (x,))]
        return A.Or(tuple(items), pos=c[0].pos, depth=_depth(*items))

    def and_(self, c: list[Any]) -> A.And:
        items = [i for x in c for i in (x.items if isinstance(x, A.And) else (x,))]
        return A.And(tuple(items), pos=c[0].pos, depth=_depth(*items))

    def not_(self, c: list[Any]) -> A.Not:
        return A.Not(c[1], pos=_pos(c[0]), depth=_depth(c[1], at=_pos(c[0])))

    def compare(self, c: list[Any]) -> A.Compare:
        op = "!=" if c[1].value == "<>" else c[1].value
        return A.Compare(op, c[0], c[2], pos=c[0].pos, depth=_depth(c[0], c[2]))

    def like(self, c: list[Any]) -> A.Like:
        return A.Like(c[0], c[2], c[1] is not None, pos=c[0].pos, depth=_depth(c[0], c[2]))

    def in_list(self, c: list[Any]) -> A.InList:
        return A.InList(c[0], tuple(c[2:]), c[1] is not None, pos=c[0].pos,
                        depth=_depth(c[0], *c[2:]))

    def in_param(self, c: list[Any]) -> A.InParam:
        return A.InParam(c[0], c[2], c[1] is not None, pos=c[0].pos, depth=_depth(c[0]))

    def between(self, c: list[Any]) -> A.Between:
        return A.Between(c[0], c[2], c[3], c[1] is not None, pos=c[0].pos,
                         depth=_depth(c[0], c[2], c[3]))

    def is_null(self, c: list[Any]) -> A.IsNull:
        return A.IsNull(c[0], c[1] is not None, pos=c[0].pos, depth=_depth(c[0]))

    def column(self, c: list[Token]) -> A.Column:
        tok = c[0]
        return A.Column(_unquote(tok) if tok.type == "QNAME" else tok.value, pos=_pos(tok))

    def call(self, c: list[Any]) -> A.Call:
        name, distinct, args = c
        if args is _STAR:
            return A.Call(name.value.lower(), (), star=True, distinct=distinct is not None,
                          pos=_pos(name))
        return A.Call(name.value.lower(), args, distinct=distinct is not None, pos=_pos(name),
                      depth=_depth(*args))

    def call_args(self, c: list[Any]) -> Any:
        if len(c) == 1 and isinstance(c[0], Token) and c[0].type == "STAR":
            return _STAR
        return tuple(c)

    def param(self, c: list[Token]) -> A.Param:
        return A.Param(c[0].value[1:], pos=_pos(c[0]))

    def literal(self, c: list[Token]) -> A.Literal:
        tok = c[0]
        t = tok.type
        if t == "INT":
            value: Any = self._int(tok)
        elif t == "FLOAT":
            value = float(tok.value)
            if not math.isfinite(value):
                raise _err(f"number {tok.value[:30]} is out of range", _pos(tok),
                           ["a finite number"])
        elif t == "STRING":
            value = _unquote(tok)
        elif t == "NULL":
            value = None
        else:
            value = t == "TRUE"
        return A.Literal(value, pos=_pos(tok))

    # -- actions -----------------------------------------------------------------------
    def ref(self, c: list[Token]) -> _Ref:
        tok = c[0]
        if tok.type == "PARAM":
            return _Ref(A.Param(tok.value[1:], pos=_pos(tok)), _pos(tok), False)
        if tok.type == "STRING":
            return _Ref(_unquote(tok), _pos(tok), True)
        return _Ref(tok.value, _pos(tok), False)

    value = ref

    def at_version(self, c: list[Any]) -> tuple[str, Any]:
        return ("version", _at_least(c[0], 1, "a version"))

    def at_tag(self, c: list[Any]) -> tuple[str, Any]:
        return ("tag", c[0].value)

    def snapshot(self, c: list[Any]) -> A.Snapshot:
        kw, coll, at, tag = c
        return A.Snapshot(coll.value, tag.value, at[1] if at else None, pos=_pos(kw))

    def replicate(self, c: list[Any]) -> A.Replicate:
        kw, coll, at, *nodes = c
        return A.Replicate(coll.value, tuple(n.value for n in nodes), at[1] if at else None,
                           pos=_pos(kw))

    def in_tier(self, c: list[Any]) -> _Ref:
        return c[0]

    def one_collection(self, c: list[Any]) -> A.OneCollection:
        coll, at = c
        if at is None:
            return A.OneCollection(coll.value)
        if at[0] == "version":
            return A.OneCollection(coll.value, version=at[1])
        return A.OneCollection(coll.value, tag=at[1])

    def collections(self, c: list[Any]) -> A.Collections:
        return A.Collections(c[0])

    def commits(self, c: list[Any]) -> A.Commits:
        return A.Commits(c[0])

    def pin(self, c: list[Any]) -> A.Pin:
        return A.Pin(c[1], _tier(c[2]), pos=_pos(c[0]))

    def unpin(self, c: list[Any]) -> A.Unpin:
        return A.Unpin(c[1], _tier(c[2]), pos=_pos(c[0]))

    def evict(self, c: list[Any]) -> A.Evict:
        tier = _tier(c[2])
        assert tier is not None
        return A.Evict(c[1], tier, pos=_pos(c[0]))

    def drop_keep(self, c: list[Any]) -> A.DropVersions:
        return A.DropVersions(c[1].value, keep_last=_at_least(c[2], 1, "KEEP LAST"),
                              pos=_pos(c[0]))

    def drop_older(self, c: list[Any]) -> A.DropVersions:
        r: _Ref = c[2]
        if isinstance(r.value, str):
            parse_interval(r.value, r.pos)
        return A.DropVersions(c[1].value, older_than=r.value, pos=_pos(c[0]))

    # -- policies ----------------------------------------------------------------------
    def policy_name(self, c: list[Token]) -> _Ref:
        tok = c[0]
        name = _unquote(tok) if tok.type == "STRING" else tok.value
        if not name.strip() or len(name) > 255:
            raise _err("a policy name must be 1 to 255 characters, not blank", _pos(tok),
                       ["a name"])
        return _Ref(name, _pos(tok), tok.type == "STRING")

    def every(self, c: list[Token]) -> tuple[str, str]:
        return ("every", _schedule("every", c[0]))

    def cron(self, c: list[Token]) -> tuple[str, str]:
        return ("cron", _schedule("cron", c[0]))

    def on_commit(self, c: list[Any]) -> tuple[str, str]:
        return ("commit", c[0].value)

    def create_policy(self, c: list[Any]) -> A.CreatePolicy:
        kw, name, (trigger, schedule), body = c
        if isinstance(body, (A.CreatePolicy, A.ShowPolicies, A.DropPolicy, A.Explain)):
            raise _err(f"a policy cannot run {body.kind}", body.pos, list(_POLICY_BODIES))
        return A.CreatePolicy(name.value, trigger, schedule, body, pos=_pos(kw),
                              name_pos=name.pos)

    def show_policies(self, c: list[Any]) -> A.ShowPolicies:
        return A.ShowPolicies(pos=_pos(c[0]))

    def drop_policy(self, c: list[Any]) -> A.DropPolicy:
        return A.DropPolicy(c[1].value, pos=_pos(c[0]))


@cache
def _lark() -> Lark:
    return Lark(GRAMMAR, parser="lalr", lexer="contextual", start=["single", "script"],
                transformer=_Build(), maybe_placeholders=True, cache=False)


# -- lark's errors -> QueryError -------------------------------------------------------
def _end_pos(text: str) -> A.Pos:
    lines = text.split("\n")
    return len(lines), len(lines[-1]) + 1


def _found(tok: Token) -> str:
    if tok.type == "$END":
        return "end of statement"
    word = tok.type.lstrip("_")
    if word in KEYWORDS:
        return word
    shown = tok.value if len(tok.value) <= 30 else tok.value[:27] + "..."
    what = _FOUND.get(tok.type)
    return f"{what} {shown!r}" if what else repr(shown)


_FOUND = {"NAME": "name", "CNAME": "name", "QNAME": "name", "INT": "integer", "FLOAT": "number",
          "PARAM": "parameter", "STRING": "string"}


def _expected(names: set[str] | frozenset[str] | list[str]) -> list[str]:
    out = sorted({describe_terminal(n) for n in names},
                 key=lambda s: (s == "end of statement", not s.isupper(), s))
    return out


def _syntax_error(text: str, exc: UnexpectedInput) -> QueryError:
    hint = ""
    if isinstance(exc, UnexpectedToken):
        tok = exc.token
        if tok.type == "$END":
            line, column = _end_pos(text)
        else:
            line, column = tok.line or 1, tok.column or 1
        # accepts: what the parser would really take here; expected may hold more (LALR
        # shares states between contexts)
        expected = _expected(getattr(exc, "accepts", None) or exc.expected)
        found = _found(tok)
        if expected == ["end of statement"] and ";" in text:
            hint = " (one statement at a time: nothing may follow ';')"
    elif isinstance(exc, UnexpectedCharacters):
        line, column = exc.line, exc.column
        expected = _expected(exc.allowed or set())
        rest = text[exc.pos_in_stream:]
        if rest.startswith(("--", "/*", "#")):
            found, hint = "comment", " (comments are not allowed)"
        elif rest.startswith("'"):
            found = "unterminated 'string'"
        elif rest.startswith('"'):
            found = 'unterminated "quoted name"'
        else:
            found = repr(rest[:1])
    else:  # UnexpectedEOF: not raised by LALR, but cheap to cover
        line, column = _end_pos(text)
        expected = _expected(getattr(exc, "expected", []) or [])
        found = "end of statement"
    shown = ", ".join(expected)
    return QueryError(
        f"syntax error at line {line}, column {column}: unexpected {found}{hint}; expected "
        + (f"one of {shown}" if len(expected) > 1 else shown or "nothing more"),
        line=line, column=column, expected=expected)


def _parse(text: str, start: str) -> Any:
    if not isinstance(text, str):
        raise QueryError(f"a statement must be a str, not {type(text).__name__}", line=1,
                         column=1, expected=["a statement"])
    if len(text) > MAX_LENGTH:
        raise QueryError(f"the statement is {len(text)} characters long, over the "
                         f"{MAX_LENGTH} allowed at line 1, column 1", line=1, column=1,
                         expected=[f"at most {MAX_LENGTH} characters"])
    try:
        return _lark().parse(text, start=start)
    except UnexpectedInput as exc:
        raise _syntax_error(text, exc) from None
    except LarkError as exc:  # pragma: no cover - lark's other errors are grammar bugs
        raise QueryError(f"cannot parse the statement: {exc} at line 1, column 1", line=1,
                         column=1, expected=["a statement"]) from None


@lru_cache(maxsize=1024)
def _parse_one(text: str) -> A.Statement:
    return _parse(text, "single")


def parse(text: str | A.Statement) -> A.Statement:
    """One statement (a trailing ';' is allowed) -> its Statement. Cached by text.

    Raises QueryError with line, column and what was expected."""
    if isinstance(text, A.Statement):
        return text
    if not isinstance(text, str):
        return _parse(text, "single")  # raises the QueryError
    return _parse_one(text)


def parse_script(text: str) -> list[A.Statement]:
    """Statements separated by ';' (a ';' inside a string is part of the string)."""
    return list(_parse(text, "script"))
