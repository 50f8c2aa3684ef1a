"""The policy language: parse, plan and run statements against the catalog.

    import query
    stmt = query.parse("SELECT dtype, count(*) FROM tensors GROUP BY dtype")
    table = query.execute(db, stmt)           # a pyarrow.Table; db.query(text) does the same

Statements: SELECT over the virtual tables (``query.TABLES``); SNAPSHOT, REPLICATE, PIN,
UNPIN, EVICT, DROP VERSIONS; EXPLAIN; CREATE POLICY, SHOW POLICIES, DROP POLICY, run by
``PolicyRunner`` (``tensordb policies run`` for the embedded store). Every
value is bound as a parameter: statement text never reaches the SQL. Errors are
``tensordb.errors.QueryError`` with ``line``, ``column`` and ``expected``.

This package never sees a ``Database``: statements and policies run against a
``PolicyStore``, the catalog and the few client-API actions they use, which
``tensordb.Database`` has.
"""

from __future__ import annotations

from ._ast import (
    Collections,
    Commits,
    CreatePolicy,
    DropPolicy,
    DropVersions,
    Evict,
    Explain,
    OneCollection,
    Pin,
    Replicate,
    Select,
    ShowPolicies,
    Snapshot,
    Statement,
    Unpin,
)
from ._execute import EvictResult, PolicyStore, execute
from ._parser import parse, parse_script
from ._policies import JOB_TABLE, PolicyRun, PolicyRunner
from ._schedule import check_schedule
from ._tables import TABLES

__all__ = [
    "Collections",
    "Commits",
    "CreatePolicy",
    "DropPolicy",
    "DropVersions",
    "Evict",
    "EvictResult",
    "Explain",
    "JOB_TABLE",
    "OneCollection",
    "Pin",
    "PolicyRun",
    "PolicyRunner",
    "PolicyStore",
    "Replicate",
    "Select",
    "ShowPolicies",
    "Snapshot",
    "Statement",
    "TABLES",
    "Unpin",
    "check_schedule",
    "execute",
    "parse",
    "parse_script",
]
