"""Weight synchronization: apply new versions of a collection to a live torch module.

A trainer commits version N+1; each engine process runs a ``WeightUpdater`` that follows
the collection and switches its module to the new version:

Every apply is all or nothing: the tensors it will apply are checked first (rows,
integrity marks, checksums: a damaged, unreadable or unreachable tensor fails the apply
before the module is touched), and a failure after that puts the version before back.

* ``mode="copy"``: the changed tensors are copied into the module's own parameters and
  buffers (``param.data.copy_``), in buckets of about ``bucket_bytes``. The module keeps
  its memory (any device, any dtype: ``copy_`` converts). Copy mode overwrites that
  memory in place, so it is for modules that own their memory, and a forward pass that
  runs during ``apply`` may see a mix of N and N+1: apply between forward passes.
* ``mode="swap"``: the module's parameters are repointed (``param.data = t``) at the new
  version's zero-copy tensors: no byte is copied. The updater holds the snapshot (a
  lease) of the version in use and releases the one before. The module must be on the
  CPU with the stored dtypes (host-tier views). The version before is released in the
  background (``settle`` waits for that), off the apply path.

Readers of the old version are never torn: the store's rows are immutable, a snapshot of
N keeps N's bytes for as long as its tensors are held, and a swap gives the module N+1's
tensors while whoever holds N's keeps them. Copy mode writes only memory the module owns
(a module built on store views gets private copy-on-write pages, never the store's).

Which tensors changed, cheaply and exactly: every stored tensor is an extent (a segment
and an offset in it), rows are immutable, and a commit that leaves a tensor unchanged
shares its extent with the version before. So two versions hold the same bytes for a
name when ``Snapshot.extents()`` names the same extent in both. No byte is read or
hashed. The updater trusts that the module still holds what it applied: after writing
to the module's tensors yourself, call ``invalidate``.

The updater here decides what to apply and follows the collection; how a version is
checked and written into the module (copy, swap, retiring) is ``_sync_apply``'s.

Uses the public tensordb API only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

import tensordb
from tensordb.errors import InvalidInput, NotFound, StoreClosed

from ._engines import checked_tensors
from ._sync_apply import Ident, Slicing, SwapHold, copy_buckets, identities, plan, repoint

__all__ = ["UpdateReport", "WeightUpdater"]

_MODES = ("copy", "swap")


@dataclass(frozen=True, slots=True)
class UpdateReport:
    """What one ``apply`` did.

    ``changed``: the state_dict names whose bytes differ from the version the module had
    (copied in copy mode, repointed in swap mode); ``unchanged``: how many were left as
    they were; ``bytes_copied``: 0 in swap mode; ``seconds``: the whole apply.
    """

    version: int
    changed: list[str]
    unchanged: int
    bytes_copied: int
    seconds: float
    previous: int | None = None


def _slicing(collection: str, rank: object, world_size: object,
             plan: object) -> Slicing | None:
    """The engine rank's slicing, checked (None: the module holds whole tensors)."""
    if rank is None and world_size is None and plan is None:
        return None
    for what, v in (("rank", rank), ("world_size", world_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidInput(f"a sliced updater needs {what} as an int, not {v!r}",
                               collection=collection)
    assert isinstance(rank, int) and isinstance(world_size, int)
    if world_size < 1 or not 0 <= rank < world_size:
        raise InvalidInput(f"rank {rank} is out of range for world_size {world_size}",
                           collection=collection)
    if not isinstance(plan, Mapping) or not all(
            isinstance(k, str) and (v is None or (isinstance(v, int) and not isinstance(v, bool)))
            for k, v in plan.items()):
        raise InvalidInput("plan must map tensor names or glob patterns to a dim or None",
                           collection=collection)
    return Slicing(rank, world_size, dict(plan))


# -- the updater ------------------------------------------------------------------------
class WeightUpdater:
    """Keeps ``module`` at the latest (or a chosen) version of ``collection``.

    ``current``: the version the module holds now (for instance one loaded with
    ``load_module``); the default, None, means unknown, and the first ``apply`` copies
    (or repoints) every tensor. ``strict``: the module's state_dict names and the
    collection's must match exactly; with False only the names in both are updated.

    Thread-safe: ``apply`` calls are serialised; ``follow`` may run in a thread of its
    own (``start``) while other threads read ``current_version``. Call from the process
    that owns the module; the updater holds a Database of that process.
    """

    def __init__(self, db: tensordb.Database, collection: str, module: torch.nn.Module, *,
                 bucket_bytes: int = 256 << 20, mode: str = "copy",
                 current: int | None = None, strict: bool = True,
                 rank: int | None = None, world_size: int | None = None,
                 plan: Mapping[str, int | None] | None = None) -> None:
        if not isinstance(module, torch.nn.Module):
            raise InvalidInput(f"module must be a torch.nn.Module, not "
                               f"{type(module).__name__}", collection=collection)
        if mode not in _MODES:
            raise InvalidInput(f"mode must be 'copy' or 'swap', not {mode!r}",
                               collection=collection)
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) \
                or bucket_bytes <= 0:
            raise InvalidInput(f"bucket_bytes must be a positive int, not {bucket_bytes!r}",
                               collection=collection)
        self.slicing = _slicing(collection, rank, world_size, plan)
        self.db = db
        self.collection = collection
        self.module = module
        self.mode = mode
        self.bucket_bytes = bucket_bytes
        self.strict = strict
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._current: int | None = None
        self._idents: dict[str, Ident] = {}
        self._swap = SwapHold()  # swap mode: the version in use, the ones retiring
        self.last_report: UpdateReport | None = None
        if current is not None:
            self._adopt(current)

    # -- state -----------------------------------------------------------------------
    @property
    def current_version(self) -> int | None:
        """The version the module holds (None before the first apply)."""
        with self._lock:
            return self._current

    def _adopt(self, version: int) -> None:
        """Record that the module already holds ``version`` (without touching it)."""
        snap = self.db.snapshot(self.collection, version=version)
        try:
            self._idents = identities(snap)
        except BaseException:
            snap.close()
            raise
        self._current = snap.version
        if self.mode == "swap":
            self._swap.hold(snap)
        else:
            snap.close()

    def invalidate(self) -> None:
        """Forget which version the module holds: the next ``apply`` updates every
        tensor. Call it after changing the module's tensors yourself (copy mode)."""
        with self._lock:
            self._current = None
            self._idents = {}

    def close(self) -> None:
        """Stop following and release the lease of the version in use. The module keeps
        its tensors (a swapped module's stay valid: they hold their own mappings)."""
        self.stop()
        with self._lock:
            snap, retirer = self._swap.detach()
        if retirer is not None:
            retirer.shutdown(wait=True)  # every retired version's lease is released
        if snap is not None:
            snap.close()

    def __enter__(self) -> WeightUpdater:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- applying ----------------------------------------------------------------------
    def apply(self, version: int | None = None) -> UpdateReport:
        """Bring the module to ``version`` (default: the head) and say what changed.

        All or nothing: every tensor to apply is checked first (its row, its integrity
        marks, its bytes against their checksum), and the module is touched only once
        all of them are known good. A failure after that (a copy that fails part-way)
        puts the version before back (copied from its snapshot, leased for the whole
        apply, in copy mode; the tensors the module held, in swap mode) before the
        error is raised, so ``current_version`` always names the one version the
        module holds (None only where the version before could not be put back).

        Blocks for the check and the copy (copy mode) or for mapping and repointing
        (swap mode). NotFound for an unknown collection or version; InvalidInput,
        naming the tensor, when the module does not fit the version; CorruptData or
        NodeUnavailable, naming the tensor, when the version cannot be read whole. In
        all those cases the module is untouched. Applying the version the module
        already holds changes nothing.
        """
        t0 = time.perf_counter()
        with self._lock:
            # copy mode hashes what it copies (the copy reads every byte anyway); swap
            # mode repoints at the store's own pages: a zero-copy read, held to the
            # integrity model as every view is (marks, a disk segment's first open),
            # without a hash pass over host memory that nothing else reads
            snap = self.db.snapshot(self.collection, version=version,
                                    verify=self.mode == "copy")
            keep = False
            try:
                report, keep = self._apply(snap, t0)
            finally:
                if not keep:
                    snap.close()
            self.last_report = report
            return report

    def _read(self, snap: tensordb.Snapshot) -> Callable[[str], torch.Tensor]:
        """How a tensor the module takes is read from ``snap`` (verifying in copy mode):
        whole, or this rank's part."""
        slicing = self.slicing
        if slicing is None:
            return snap.__getitem__
        return lambda name: slicing.read(snap, name)

    def _apply(self, snap: tensordb.Snapshot, t0: float) -> tuple[UpdateReport, bool]:
        previous = self._current
        targets = self.module.state_dict(keep_vars=True)
        if snap.version == previous:
            return UpdateReport(snap.version, [], len(targets), 0,
                                time.perf_counter() - t0, previous), False
        names = plan(snap, targets, collection=self.collection, strict=self.strict,
                     swap=self.mode == "swap", slicing=self.slicing)
        idents = identities(snap)
        old = self._idents
        changed = [n for n in names
                   if idents[n] is None or old.get(n) is None or idents[n] != old[n]]
        # tied parameters: one tensor under several names is updated once
        seen: set[int] = set()
        todo = []
        for n in changed:
            key = id(targets[n])
            if key not in seen:
                seen.add(key)
                todo.append(n)
        if self.mode == "copy":
            copied = self._copy(todo, targets, snap, previous)
        else:
            copied = 0
            # the gate: every tensor checked before the first is repointed
            repoint(todo, targets, dict(checked_tensors(snap, todo, read=self._read(snap))))
        self._idents = {n: idents[n] for n in names}
        self._current = snap.version
        keep = False
        if self.mode == "swap":
            self._swap.hold(snap)  # the version before retires in the background
            keep = True
        report = UpdateReport(snap.version, changed, len(targets) - len(changed), copied,
                              time.perf_counter() - t0, previous)
        return report, keep

    def _copy(self, todo: list[str], targets: dict[str, torch.Tensor],
              snap: tensordb.Snapshot, previous: int | None) -> int:
        """Copy mode: lease the version the module holds, check every tensor of the new
        one, copy; a copy that fails part-way is undone from the version before."""
        before: tensordb.Snapshot | None = None
        if previous is not None:
            try:
                before = self.db.snapshot(self.collection, version=previous, verify=True)
            except NotFound:
                before = None  # dropped meanwhile: a failure part-way cannot be undone
        try:
            sources = dict(checked_tensors(snap, todo, read=self._read(snap)))
            touched: list[str] = []
            try:
                return copy_buckets(todo, targets, sources, self.bucket_bytes, touched)
            except BaseException as exc:
                self._put_back(touched, targets, before, exc)
                raise
        finally:
            if before is not None:
                before.close()

    def _put_back(self, touched: list[str], targets: dict[str, torch.Tensor],
                  before: tensordb.Snapshot | None, exc: BaseException) -> None:
        """Copy the version before back into the tensors a failed copy touched; where
        that is not possible the module holds no one version (``current_version``
        None)."""
        if not touched:
            return
        if before is None:
            self.invalidate()
            exc.add_note(f"{self.collection}: {len(touched)} tensors were copied before "
                         f"the failure and the version before is gone: the module holds no "
                         f"one version now")
            return
        try:
            old = dict(checked_tensors(before, touched, read=self._read(before)))
            copy_buckets(touched, targets, old, self.bucket_bytes)
        except BaseException as undo:
            self.invalidate()
            exc.add_note(f"{self.collection}: putting v{before.version} back failed too "
                         f"({type(undo).__name__}: {undo}): the module holds no one "
                         f"version now")
            return
        exc.add_note(f"{self.collection}: the module is back on v{before.version}")

    def settle(self) -> None:
        """Wait until the versions a swap left behind are released (their leases
        ended, their mappings dropped). ``apply`` does not wait for that; ``close`` does."""
        with self._lock:
            retirer = self._swap.retirer
        if retirer is not None:
            retirer.submit(lambda: None).result()

    # -- following ----------------------------------------------------------------------
    def follow(self, timeout: float | None = None, *, every: bool = False,
               poll: float = 0.5,
               on_update: Callable[[UpdateReport], None] | None = None) -> int:
        """Apply new versions as they land, until ``stop`` or until ``timeout`` seconds
        pass without one. Returns how many versions were applied.

        Starts with the head if the module holds none yet. ``every=False`` (default)
        applies only the latest when several landed meanwhile (the module never holds a
        mix; it skips intermediate versions); ``every=True`` applies each in order.
        ``poll``: how often ``stop`` is noticed (commits wake the follower at once).
        """
        try:
            return self._follow(timeout, every, poll, on_update)
        finally:
            self._stop.clear()  # a stop() ends one follow, not the next

    def _follow(self, timeout: float | None, every: bool, poll: float,
                on_update: Callable[[UpdateReport], None] | None) -> int:
        applied = 0
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.current_version is None:
            try:
                report = self.apply()
            except NotFound:
                report = None  # nothing committed yet: wait for the first version
            if report is not None:
                applied += 1
                if on_update is not None:
                    on_update(report)
                if deadline is not None:
                    deadline = time.monotonic() + timeout  # type: ignore[operator]
        while not self._stop.is_set():
            wait = poll if deadline is None else min(poll, deadline - time.monotonic())
            if wait <= 0:
                break
            try:
                for c in self.db.watch(self.collection, after=self.current_version or 0,
                                       timeout=wait, poll=wait):
                    if self._stop.is_set():
                        break
                    if c.version <= (self.current_version or 0):
                        continue  # an intermediate version a latest-only apply skipped
                    report = self.apply(c.version if every else None)
                    applied += 1
                    if on_update is not None:
                        on_update(report)
                    if self._stop.is_set():
                        break
                    if deadline is not None:
                        deadline = time.monotonic() + timeout  # type: ignore[operator]
            except StoreClosed:
                break
        return applied

    def start(self, *, every: bool = False,
              on_update: Callable[[UpdateReport], None] | None = None) -> threading.Thread:
        """Run ``follow`` in a daemon thread; ``stop`` ends it."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                raise InvalidInput("this updater is already following",
                                   collection=self.collection)
            self._stop.clear()
            self._thread = threading.Thread(
                target=self.follow, kwargs={"every": every, "on_update": on_update},
                name=f"tensordb-follow-{self.collection}", daemon=True)
            self._thread.start()
            return self._thread

    def stop(self, timeout: float | None = 10.0) -> None:
        """Ask ``follow`` to return (within ``poll`` seconds) and wait for its thread."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            self._thread = None
