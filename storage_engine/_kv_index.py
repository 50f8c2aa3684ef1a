"""The LMDB index of a KV block store's GPU tier, its write transactions, and read leases.

Only the GPU tier (``_kv_gpu``, ``_kv_gpu_part``) indexes its blocks here; the host's
blocks are in the store's native index (``storage_engine/kv/``), which has no LMDB in it. One
LMDB environment per store that has a GPU tier (``<root>/index``, ``lock=True``: every
process of the host shares it). The tier's parts keep their records in named databases
of it and count in its shared counters; ``KVIndex.write`` is the one write transaction
they all run in, so a GPU put, get or eviction is one transaction whatever parts it
touches.

``ReadLeases`` records which process reads which chunk (the ``leases`` database, keyed
by chunk and holder) and parks the chunks freed while someone reads them (``zombies``):
a private mapping still sees later writes to the file where the reader did not write,
so a chunk must not be reused while a view of it lives.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import lmdb

from ._kv_types import I64, LOC, Alive, Loc
from ._procs import current_holder, holder_alive

__all__: list[str] = []  # parts of BlockStore, nothing public


class WriteHooks(Protocol):
    """A part of the store that takes part in every write transaction."""

    def begin(self, txn: lmdb.Transaction) -> None:
        """Runs first inside each write transaction (before the caller's work)."""

    def aborted(self) -> None:
        """Runs after a write transaction aborted (its LMDB changes are undone)."""


class KVIndex:
    """The store's LMDB environment, its named databases and shared counters, and the
    write transaction whose file effects follow its fate.

    Process-local: ``open`` again after a fork (LMDB environments do not survive one).
    """

    def __init__(self, path: Path, *, map_size: int) -> None:
        self.path = path
        self.map_size = map_size
        self.env: lmdb.Environment  # set by ``open``
        self.dbs: dict[str, Any] = {}  # name -> LMDB database handle
        self.holder = b""
        #: the parts run at the start of each write transaction, in order
        self.hooks: list[WriteHooks] = []
        self._wtxn: Any = None  # the transaction of ``write`` while it runs
        self._pending: dict[str, int] = {}  # its counters, written at its commit
        self._created: list[Path] = []
        self._doomed: list[Path] = []
        #: counts this process's write transactions: a part that must do something
        #: once per transaction (a scan) remembers the epoch it did it in
        self.write_epoch = 0

    def open(self) -> None:
        self.holder = current_holder().encode()
        self._wtxn, self._pending = None, {}
        self._created, self._doomed = [], []
        self.dbs = {}
        self.env = lmdb.open(str(self.path), map_size=self.map_size, max_dbs=32,
                             lock=True, sync=False, metasync=False, readahead=False,
                             max_readers=4096, mode=0o600)

    def open_dbs(self, names: Sequence[str]) -> None:
        with self.env.begin(write=True) as txn:
            self.dbs = {n: self.env.open_db(n.encode(), txn=txn) for n in names}

    def close(self) -> None:
        self.env.close()

    def setting(self, txn: lmdb.Transaction, name: bytes, value: bytes | None
                ) -> bytes | None:
        """A store-wide setting: the first process to give ``value`` fixes it, later
        ones read it (None: nobody fixed it and ``value`` is None)."""
        db = self.env.open_db(b"settings", txn=txn)
        raw = txn.get(name, db=db)
        if raw is None:
            if value is not None:
                txn.put(name, value, db=db)
            return value
        return bytes(raw)

    def live(self, holder: bytes, alive: Alive | None = None) -> bool:
        """Whether the process ``holder`` may still be running (this one is); ``alive``
        caches the answers for the length of a transaction."""
        if alive is not None:
            ok = alive.get(holder)
            if ok is None:
                ok = alive[holder] = self.live(holder)
            return ok
        return holder == self.holder or holder_alive(holder.decode()) is not False

    def counter(self, txn: lmdb.Transaction, name: str, delta: int) -> int:
        """Add ``delta`` to a shared counter and return its new value. Inside the write
        transaction of ``write`` the value is kept in a dict and written once, at
        commit: a put of a batch touches the same few counters once per block, and an
        LMDB get and put per touch was a fifth of a small block's cost."""
        pend = self._pending if txn is self._wtxn else None
        if pend is not None and name in pend:
            value = pend[name] + delta
        else:
            raw = txn.get(name.encode(), db=self.dbs["counters"])
            value = (I64.unpack(raw)[0] if raw is not None else 0) + delta
        if pend is not None:
            pend[name] = value
        elif delta:
            txn.put(name.encode(), I64.pack(value), db=self.dbs["counters"])
        return value

    def created(self, path: Path) -> None:
        """A file the running write transaction made: removed if it aborts."""
        self._created.append(path)

    def doom(self, path: Path) -> None:
        """A file to remove once the running write transaction commits."""
        self._doomed.append(path)

    @contextmanager
    def write(self) -> Iterator[Any]:
        """A write transaction whose file effects follow its fate: files it created are
        removed if it aborts (before the abort: the names come from counters that the
        abort rolls back, and the next writer will reuse them), files it dooms are
        removed only once it commits (their names are never reused)."""
        self._created = []
        self._doomed = []
        txn = self.env.begin(write=True)
        self._wtxn, self._pending = txn, {}
        self.write_epoch += 1
        try:
            for hook in self.hooks:
                hook.begin(txn)
            yield txn
            pend, self._wtxn = self._pending, None
            db = self.dbs["counters"]
            for name, value in pend.items():
                txn.put(name.encode(), I64.pack(value), db=db)
        except BaseException:
            self._wtxn = None
            for path in self._created:
                path.unlink(missing_ok=True)
            self._created = []
            txn.abort()
            for hook in self.hooks:
                hook.aborted()
            raise
        txn.commit()
        self._created = []
        doomed, self._doomed = self._doomed, []
        for path in doomed:
            path.unlink(missing_ok=True)  # mappings of a slab keep their pages


#: puts a chunk nobody reads back on its arena's free list (inside a write transaction)
ReleaseChunk = Callable[[lmdb.Transaction, int, int], None]


class ReadLeases:
    """This process's read leases on chunks, and the chunks freed while leased.

    A lease is counted here per chunk and recorded once in the index under this
    process's holder id; views give theirs back through ``release`` (from a finalizer,
    so without a transaction), and the next write transaction drops the records.
    Leases of dead processes count as released.
    """

    DB_NAMES = ("leases", "zombies")

    def __init__(self, index: KVIndex, release: ReleaseChunk) -> None:
        self._index = index
        self._release = release
        self._held: dict[Loc, int] = {}
        self._released: deque[Loc] = deque()
        self._flushed: list[Loc] = []
        #: give a lease back (any thread, no transaction: the next write drops it)
        self.release: Callable[[Loc], None] = self._released.append

    def reset(self) -> None:
        """After a fork: the parent's leases are not this process's."""
        self._held.clear()
        self._released.clear()
        self._flushed = []

    @property
    def pending(self) -> bool:
        """Leases given back and not yet dropped from the index."""
        return bool(self._released)

    def lease(self, txn: lmdb.Transaction, loc: Loc) -> None:
        n = self._held.get(loc, 0)
        if n == 0:
            txn.put(LOC.pack(*loc) + self._index.holder, b"", db=self._index.dbs["leases"])
        self._held[loc] = n + 1

    def _unlease(self, txn: lmdb.Transaction, loc: Loc) -> None:
        n = self._held.get(loc, 0) - 1
        if n <= 0:
            self._held.pop(loc, None)
            txn.delete(LOC.pack(*loc) + self._index.holder, db=self._index.dbs["leases"])
        else:
            self._held[loc] = n

    def forget(self, locs: Iterable[Loc]) -> None:
        """Undo leases whose transaction aborted (its records went with it)."""
        for loc in locs:
            n = self._held.get(loc, 0) - 1
            if n <= 0:
                self._held.pop(loc, None)
            else:
                self._held[loc] = n

    # -- WriteHooks: released leases leave the index in the next write transaction -----
    def begin(self, txn: lmdb.Transaction) -> None:
        self._flushed = []
        flushed = []
        while self._released:
            loc = self._released.popleft()
            self._unlease(txn, loc)
            flushed.append(loc)
        self._flushed = flushed

    def aborted(self) -> None:
        flushed, self._flushed = self._flushed, []
        if flushed:  # the lease records it deleted came back with the abort
            db = self._index.dbs["leases"]
            with self._index.env.begin(write=True) as txn:
                for loc in flushed:
                    if loc not in self._held:
                        txn.delete(LOC.pack(*loc) + self._index.holder, db=db)

    # -- chunks being read -----------------------------------------------------------
    def leased(self, txn: lmdb.Transaction, loc: bytes, alive: Alive) -> bool:
        """Whether a live process holds a view of the chunk at ``loc``; drops the leases
        of dead ones."""
        db = self._index.dbs["leases"]
        cur = txn.cursor(db=db)
        if not cur.set_range(loc):
            return False
        dead = []
        live = False
        for k in cur.iternext(keys=True, values=False):
            k = bytes(k)
            if not k.startswith(loc):
                break
            if self._index.live(k[len(loc):], alive):
                live = True
                break
            dead.append(k)
        for k in dead:
            txn.delete(k, db=db)
        return live

    def free(self, txn: lmdb.Transaction, slab: int, chunk: int, alive: Alive) -> None:
        """Free a chunk: at once, or once nobody reads it (it waits in ``zombies``)."""
        loc = LOC.pack(slab, chunk)
        if self.leased(txn, loc, alive):
            txn.put(loc, b"", db=self._index.dbs["zombies"])
            return
        self._release(txn, slab, chunk)

    def reclaim_zombies(self, txn: lmdb.Transaction, alive: Alive) -> int:
        """Free the parked chunks nobody reads any more; how many."""
        db = self._index.dbs["zombies"]
        freed = 0
        for loc in list(txn.cursor(db=db).iternext(keys=True, values=False)):
            loc = bytes(loc)
            if not self.leased(txn, loc, alive):
                txn.delete(loc, db=db)
                slab, chunk = LOC.unpack(loc)
                self.free(txn, slab, chunk, alive)
                freed += 1
        return freed
