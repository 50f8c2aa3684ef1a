"""The grammar of the statement language (lark, LALR(1)), and how its terminals read.

Keywords are case-insensitive. Most are reserved: they cannot be bare names (quote a
column as "name", a collection as 'name'). Words that are also column or table names
(``version``, ``tag``, ``node``, ``tier``, ``collections``...) stay usable as names;
where both readings fit, the keyword wins.

There are no comments and no statement separators inside one statement: ``--``,
``/*`` and a second statement after ``;`` are syntax errors.
"""

from __future__ import annotations

__all__ = ["GRAMMAR", "KEYWORDS", "RESERVED", "describe_terminal"]

#: every keyword of the language
KEYWORDS = (
    "SELECT", "DISTINCT", "FROM", "WHERE", "GROUP", "BY", "HAVING", "ORDER", "ASC", "DESC",
    "LIMIT", "OFFSET", "AS", "AND", "OR", "NOT", "LIKE", "IN", "BETWEEN", "IS", "NULL",
    "TRUE", "FALSE", "EXPLAIN", "SNAPSHOT", "AT", "VERSION", "TAG", "REPLICATE", "TO",
    "NODE", "NODES", "PIN", "UNPIN", "EVICT", "TIER", "COLLECTION", "COLLECTIONS",
    "COMMITS", "DROP", "VERSIONS", "OF", "KEEP", "LAST", "OLDER", "THAN", "CREATE",
    "POLICY", "POLICIES", "EVERY", "CRON", "ON", "COMMIT", "DO", "SHOW",
)

#: keywords that are also names of columns or tables, or plausible ones: not reserved
_NAMES_TOO = frozenset({
    "VERSION", "VERSIONS", "TAG", "NODE", "NODES", "TIER", "COLLECTION", "COLLECTIONS",
    "COMMIT", "COMMITS", "POLICY", "POLICIES", "LAST",
})

RESERVED = frozenset(KEYWORDS) - _NAMES_TOO

# keywords the builder needs to see (statement verbs carry the statement's position);
# the others are filtered out of the parse by a leading underscore
_VISIBLE = frozenset({
    "SELECT", "EXPLAIN", "SNAPSHOT", "REPLICATE", "PIN", "UNPIN", "EVICT", "DROP", "CREATE",
    "SHOW", "DISTINCT", "NOT", "NULL", "TRUE", "FALSE", "ASC", "DESC",
})


def _kw(word: str) -> str:
    return word if word in _VISIBLE else "_" + word


def _reserved_alternation() -> str:
    return "|".join(sorted((w.lower() for w in RESERVED), key=lambda w: (-len(w), w)))


_RULES = r"""
single: statement [SEMI]
script: [statement] (SEMI [statement])*

?statement: select | explain | snapshot | replicate | pin | unpin | evict
          | drop_versions | create_policy | show_policies | drop_policy

explain: EXPLAIN statement

// -- SELECT ------------------------------------------------------------------------------
{select}
select_list: STAR | select_item (_COMMA select_item)*
select_item: expr [_AS alias]
alias: NAME | QNAME
table_ref: NAME | QNAME
where_clause: _WHERE expr
group_clause: _GROUP _BY expr (_COMMA expr)*
having_clause: _HAVING expr
order_clause: _ORDER _BY order_item (_COMMA order_item)*
order_item: expr [ASC | DESC]
limit_clause: _LIMIT count [_OFFSET count]
count: INT | PARAM

?expr: or_expr
?or_expr: and_expr | or_expr _OR and_expr -> or_
?and_expr: not_expr | and_expr _AND not_expr -> and_
?not_expr: predicate | NOT not_expr -> not_
?predicate: operand
    | operand CMP operand -> compare
    | operand [NOT] _LIKE operand -> like
    | operand [NOT] _IN _LPAR expr (_COMMA expr)* _RPAR -> in_list
    | operand [NOT] _IN param -> in_param
    | operand [NOT] _BETWEEN operand _AND operand -> between
    | operand _IS [NOT] NULL -> is_null
?operand: literal | param | column | call | _LPAR expr _RPAR
column: NAME | QNAME
call: NAME _LPAR [DISTINCT] call_args _RPAR
call_args: STAR | expr (_COMMA expr)*
param: PARAM
literal: INT | FLOAT | STRING | NULL | TRUE | FALSE

// -- actions -----------------------------------------------------------------------------
snapshot: SNAPSHOT ref [at_version] _AS _TAG value
replicate: REPLICATE ref [at_version] _TO (_NODE | _NODES) value (_COMMA value)*
at_version: _AT _VERSION count

pin: PIN selection [in_tier]
unpin: UNPIN selection [in_tier]
evict: EVICT selection _FROM _TIER ref
in_tier: _IN_TIER ref

selection: _COLLECTION ref [at_ref] -> one_collection
         | _COLLECTIONS [where_clause] -> collections
         | _COMMITS [where_clause] -> commits
at_ref: _AT _VERSION count -> at_version
      | _AT _TAG value -> at_tag

drop_versions: DROP _VERSIONS _OF ref _KEEP _LAST count -> drop_keep
             | DROP _VERSIONS _OF ref _OLDER _THAN value -> drop_older

ref: CNAME | STRING | PARAM
value: CNAME | STRING | PARAM

// -- policies ----------------------------------------------------------------------------
create_policy: CREATE _POLICY policy_name trigger _DO statement
trigger: _EVERY STRING -> every
       | _CRON STRING -> cron
       | _ON _COMMIT _TO policy_name -> on_commit
policy_name: CNAME | STRING
show_policies: SHOW _POLICIES
drop_policy: DROP _POLICY policy_name
"""

# one line in lark's grammar
_SELECT = ("select: SELECT [DISTINCT] select_list _FROM table_ref [where_clause] "
           "[group_clause] [having_clause] [order_clause] [limit_clause]")

_TERMINALS = r"""
// a bare column, alias or table name
NAME: /(?!(?i:{reserved})\b)[A-Za-z_][A-Za-z0-9_]*/
// a bare collection, tag, node, tier or policy name: also 7b, qwen3-32b, org/model
CNAME: /(?!(?i:{reserved})(?![A-Za-z0-9_.\/-]))[A-Za-z0-9_][A-Za-z0-9_.\/-]*/
QNAME: /"(?:[^"]|"")+"/
STRING: /'(?:[^']|'')*'/
PARAM: /:[A-Za-z_][A-Za-z0-9_]*/
FLOAT.2: /-?(?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?(?![A-Za-z0-9_])|-?\d+[eE][+-]?\d+(?![A-Za-z0-9_])/
INT: /-?\d+(?![A-Za-z0-9_.])/
CMP: /<=|>=|<>|!=|=|<|>/
STAR: "*"
_LPAR: "("
_RPAR: ")"
_COMMA: ","
SEMI: ";"
// one token, so that "PIN COLLECTIONS WHERE x IN TIER host" needs one token of lookahead
_IN_TIER.2: /in\s+tier(?![A-Za-z0-9_])/i
%ignore /\s+/
"""


def _grammar() -> str:
    kws = "\n".join(f'{_kw(w)}: "{w.lower()}"i' for w in KEYWORDS)
    return (_RULES.replace("{select}", _SELECT)
            + _TERMINALS.replace("{reserved}", _reserved_alternation()) + kws + "\n")


GRAMMAR = _grammar()

_DESCRIBE = {
    "NAME": "a name",
    "CNAME": "a name",
    "QNAME": 'a "quoted name"',
    "STRING": "a 'string'",
    "PARAM": "a :parameter",
    "FLOAT": "a number",
    "INT": "an integer",
    "CMP": "a comparison (=, !=, <>, <, <=, >, >=)",
    "STAR": "'*'",
    "_LPAR": "'('",
    "LPAR": "'('",
    "_RPAR": "')'",
    "RPAR": "')'",
    "_COMMA": "','",
    "COMMA": "','",
    "SEMI": "';'",
    "_IN_TIER": "IN TIER",
    "$END": "end of statement",
    "<END-OF-FILE>": "end of statement",
}


def describe_terminal(name: str) -> str:
    """How an error message names what the parser expected: 'FROM', 'a name', "'('"."""
    if name in _DESCRIBE:
        return _DESCRIBE[name]
    word = name.lstrip("_")
    if word in KEYWORDS:
        return word
    return word.lower()
