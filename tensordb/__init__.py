"""tensordb: Tensor-as-a-Service. See DESIGN.md section 3 for the client API contract.

The package face is lazy (PEP 562): ``import tensordb`` loads nothing but this module, and
each name below loads its module on first use. So the layers under the client facade
(``tensordb.errors``, ``tensordb.config``, ``tensordb.catalog``, ``query``,
``transport``) can import their own modules without loading the facade above them.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .lazy import lazy_face

if TYPE_CHECKING:
    from . import errors
    from .catalog import Commit
    from .client import (
        Corruption,
        Database,
        EvictReport,
        GcReport,
        KVCache,
        KVNodeSummary,
        ScrubReport,
        Shard,
        Snapshot,
        Transaction,
    )
    from .config import Config

__all__ = [
    "Commit",
    "Config",
    "Corruption",
    "Database",
    "EvictReport",
    "GcReport",
    "ScrubReport",
    "KVCache",
    "KVNodeSummary",
    "Shard",
    "Snapshot",
    "Transaction",
    "connect",
    "errors",
]

__version__ = "0.1.0"

#: each lazy name and the module that defines it
_LAZY = {
    "errors": ".errors",
    "Commit": ".catalog",
    "Config": ".config",
    **{name: ".client" for name in ("Corruption", "Database", "EvictReport", "GcReport",
                                    "KVCache", "KVNodeSummary", "ScrubReport", "Shard",
                                    "Snapshot", "Transaction")},
}


__getattr__, __dir__ = lazy_face(__name__, _LAZY, __all__, modules=("errors",))


def connect(url: str | None = None, *, node: str | None = None,
            data_dir: str | os.PathLike[str] | None = None,
            home: str | os.PathLike[str] | None = None, **settings: object) -> Database:
    """Open a store.

    With no URL: the embedded store in ``home`` ($TENSORDB_HOME, else ./.tensordb), a
    SQLite catalog beside a disk directory and a shared-memory area named after it.
    With a SQLAlchemy URL (``postgresql+psycopg://...``): that catalog, this host's
    ``node`` and ``data_dir``. ``settings`` override fields of ``Config``.
    """
    config: type[Config] = __getattr__("Config")
    database: type[Database] = __getattr__("Database")
    return database(config.resolve(url, home=home, node=node, data_dir=data_dir, **settings))
