"""tensordb: Tensor-as-a-Service. See DESIGN.md section 3 for the client API contract."""

from __future__ import annotations

import os

from . import errors
from .catalog import Commit
from .client import (
    Corruption,
    Database,
    EvictReport,
    GcReport,
    KVCache,
    KVNodeSummary,
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
    "KVCache",
    "KVNodeSummary",
    "Shard",
    "Snapshot",
    "Transaction",
    "connect",
    "errors",
]

__version__ = "0.1.0"


def connect(url: str | None = None, *, node: str | None = None,
            data_dir: str | os.PathLike[str] | None = None,
            home: str | os.PathLike[str] | None = None, **settings: object) -> Database:
    """Open a store.

    With no URL: the embedded store in ``home`` ($TENSORDB_HOME, else ./.tensordb), a
    SQLite catalog beside a disk directory and a shared-memory area named after it.
    With a SQLAlchemy URL (``postgresql+psycopg://...``): that catalog, this host's
    ``node`` and ``data_dir``. ``settings`` override fields of ``Config``.
    """
    return Database(Config.resolve(url, home=home, node=node, data_dir=data_dir, **settings))
