"""Shared-memory areas whose store is gone.

A store's area in shared memory (``Config.shm_dir``: host-tier segments, KV arenas,
the commit notifier's sockets) is named after a hash of its data directory and catalog,
so the area alone does not say whose it is. Each store therefore leaves a record,
``store.json`` (its home and data directory), in its area when it is opened. An area is
an *orphan* when neither directory it records exists any more (the home was deleted
and the shared memory left behind); ``tensordb orphans`` lists them and, with
``--remove``, deletes those no process has open or mapped.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from storage_engine import shm_root
from tensordb.config import Config

__all__ = ["OWNER_FILE", "ShmArea", "find_areas", "record_owner", "remove_area"]

#: the record a store leaves in its shared-memory area
OWNER_FILE = "store.json"


def record_owner(config: Config) -> None:
    """Leave ``store.json`` in the store's area (once: it names the same store every time)."""
    path = Path(config.shm_dir) / OWNER_FILE
    if path.exists():
        return
    body = json.dumps({"home": str(config.home), "data_dir": str(config.data_dir)})
    tmp = path.with_name(f".{OWNER_FILE}.{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, body.encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:  # a full tmpfs: the record only helps a later clean-up
        tmp.unlink(missing_ok=True)


@dataclass(frozen=True, slots=True)
class ShmArea:
    """A store's area in shared memory: its path, size in bytes, the home and data
    directory its record names (None: no record, an area made before records were
    kept or one not made by a store), whether it is an orphan, and the processes that
    have a file of it open or mapped (pids this user may look into)."""

    path: Path
    nbytes: int
    home: str | None
    data_dir: str | None
    orphan: bool
    users: tuple[int, ...]


def _size(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
            except OSError:
                pass
    return total


def _users(paths: list[Path]) -> dict[Path, set[int]]:
    """The processes with a file under each path open (a descriptor) or mapped."""
    found: dict[Path, set[int]] = {p: set() for p in paths}
    prefixes = [(p, f"{p}/") for p in paths]
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        targets: list[str] = []
        try:
            with open(f"/proc/{entry}/maps", encoding="utf-8", errors="replace") as fh:
                targets += [line.split(None, 5)[-1].strip() for line in fh
                            if line.count(" ") >= 5]
        except OSError:
            pass
        try:
            fd_dir = f"/proc/{entry}/fd"
            for fd in os.listdir(fd_dir):
                try:
                    targets.append(os.readlink(f"{fd_dir}/{fd}"))
                except OSError:
                    pass
        except OSError:
            pass
        for p, prefix in prefixes:
            if any(t.startswith(prefix) or t == str(p) for t in targets):
                found[p].add(int(entry))
    return found


def find_areas(root: Path | None = None) -> list[ShmArea]:
    """The stores' areas under ``root`` (default: the shared-memory root stores use),
    sorted by path."""
    base = Path(root) if root is not None else shm_root()
    try:
        dirs = sorted(p for p in base.iterdir()
                      if p.name.startswith("tensordb-") and p.is_dir() and not p.is_symlink())
    except OSError:
        return []
    users = _users(dirs)
    out = []
    for d in dirs:
        home = data = None
        try:
            rec = json.loads((d / OWNER_FILE).read_text(encoding="utf-8"))
            if isinstance(rec, dict) and isinstance(rec.get("home"), str) \
                    and isinstance(rec.get("data_dir"), str):
                home, data = rec["home"], rec["data_dir"]
        except (OSError, ValueError):
            pass
        orphan = home is not None and data is not None and not os.path.exists(home) \
            and not os.path.exists(data)
        out.append(ShmArea(d, _size(d), home, data, orphan, tuple(sorted(users[d]))))
    return out


def remove_area(area: ShmArea) -> None:
    """Delete an area (the caller checked it is an orphan nobody uses)."""
    shutil.rmtree(area.path, ignore_errors=True)
