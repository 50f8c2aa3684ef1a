"""Node server and client on Arrow Flight, and the same-host fast path.

Empty for now: cluster mode builds on ``tensordb.catalog`` and ``storage_engine``.
"""

from __future__ import annotations

__all__: list[str] = []
