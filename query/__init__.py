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

from typing import TYPE_CHECKING

from tensordb.lazy import lazy_face

if TYPE_CHECKING:
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

#: each name of the face and the module that defines it, loaded on first use
_LAZY = {
    "Collections": "._ast",
    "Commits": "._ast",
    "CreatePolicy": "._ast",
    "DropPolicy": "._ast",
    "DropVersions": "._ast",
    "Evict": "._ast",
    "Explain": "._ast",
    "OneCollection": "._ast",
    "Pin": "._ast",
    "Replicate": "._ast",
    "Select": "._ast",
    "ShowPolicies": "._ast",
    "Snapshot": "._ast",
    "Statement": "._ast",
    "Unpin": "._ast",
    "EvictResult": "._execute",
    "PolicyStore": "._execute",
    "execute": "._execute",
    "parse": "._parser",
    "parse_script": "._parser",
    "JOB_TABLE": "._policies",
    "PolicyRun": "._policies",
    "PolicyRunner": "._policies",
    "check_schedule": "._schedule",
    "TABLES": "._tables",
}

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


__getattr__, __dir__ = lazy_face(__name__, _LAZY, __all__)
