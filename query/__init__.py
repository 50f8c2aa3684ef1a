"""The policy language (parse, plan, run against the catalog) and scheduled policies.

Empty for now: the statement language is built on top of ``tensordb.catalog``.
"""

from __future__ import annotations

__all__: list[str] = []
