"""File-backed tiers: one file per segment, in shared memory or on disk; here the file
tier itself (``FileTier``) and the host tier, in shared memory. The disk tier builds on
``FileTier`` in ``_disk``; a segment being written is a ``FileWriter`` (``_file_writer``).

Why a file per segment and not one arena with an allocator: deleting a file while a
reader still maps it keeps the reader's pages alive (POSIX unlink semantics), so gc can
never change or free bytes under a tensor someone holds. A segment is one commit's
bytes, so a reader of a 1,000-tensor commit maps one file.

Readers hold a shared ``flock`` on a segment for as long as they map it (the lock
belongs to the open file description the mapping keeps). That lets a delete tell a
file nobody maps from one somebody does: the first goes to the tier's *pool* of freed
files (``_pool``), whose pages later writes reuse without page faults; the second is
unlinked as before.

The cost of a fresh file is the page faults of first touch: a writer takes, in order,
the process's pre-faulted *spare* (host tier, ``prefault``), a file from the pool (a
mapping this process still holds of it, else one ``MAP_POPULATE`` of resident pages),
or a fresh file populated on every I/O worker at once (``_mapping``).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np

from ._errors import SegmentMissing, TierFull
from ._file_writer import FileWriter
from ._integrity import Marks
from ._io import io_pool
from ._mapping import MapCache, close_in_background, map_shared
from ._pool import Pool, default_pool_limit, lock_nb, same_file
from ._tier import SegmentWriter, Tier

__all__ = ["FileTier", "HostTier", "HostView", "shm_root"]

_SUFFIX = ".seg"
_SPARE_PREFIX = "spare-"
_POOL_DIR = "pool"


#: a directory to keep the host tier's and KV arenas' areas in instead of /dev/shm (a
#: tmpfs of its own, to bound what a store may take of the host's shared memory)
SHM_ROOT_ENV = "TENSORDB_SHM_ROOT"


def shm_root() -> Path:
    """Where stores keep their shared-memory areas: $TENSORDB_SHM_ROOT, else /dev/shm
    (else $TMPDIR, else /tmp, on a system without /dev/shm)."""
    root = os.environ.get(SHM_ROOT_ENV)
    if root:
        return Path(root)
    return Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(os.environ.get("TMPDIR", "/tmp"))


class HostView(mmap.mmap):
    """A private (copy-on-write) mapping of a segment file: the file tiers'
    ``SegmentView``. It is an ``mmap``, so ``torch.frombuffer``, ``np.frombuffer`` and
    ``memoryview`` map it with no copy, and a reader's writes stay in its own pages.
    Its descriptor holds a shared lock on the file for as long as the mapping lives,
    which keeps the file out of the pool."""

    __slots__ = ()

    #: the bytes are in host memory: ``host_bytes`` is a view, not a copy
    on_device = False
    device = None

    def host_bytes(self, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        """``nbytes`` from ``offset`` (default: to the end) as a uint8 view of the
        mapping: no copy."""
        n = len(self) - offset if nbytes is None else nbytes
        return np.frombuffer(self, np.uint8, count=n, offset=offset)


class FileTier(Tier):
    """Segments as files of mode 0600 in a directory of mode 0700.

    ``pool_limit``: bytes of freed files kept in ``root/pool`` for later writes (0: none,
    deletes unlink; None: a quarter of the host's memory, at most ``capacity``).
    ``marks``: the store's integrity marks (the disk tier records what its first open
    of a segment per boot finds; readers refuse marked extents)."""

    file_backed = True

    def __init__(self, name: str, root: Path, *, capacity: int | None = None,
                 persistent: bool, pool_limit: int | None = 0,
                 marks: Marks | None = None) -> None:
        self.name = name
        self.root = Path(root)
        self.capacity = capacity
        self.persistent = persistent
        self.marks = marks
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)
        limit = default_pool_limit(capacity) if pool_limit is None else max(0, pool_limit)
        self._pool = Pool(self.root / _POOL_DIR, limit)
        self._maps = MapCache()

    # -- paths ---------------------------------------------------------------------
    def path(self, segment_id: str) -> Path:
        """The file of a segment (``file_backed``)."""
        return self.root / f"{segment_id}{_SUFFIX}"

    # -- writing -------------------------------------------------------------------
    def _check_capacity(self, nbytes: int) -> None:
        if self.capacity is not None:
            used = self.used_bytes()
            if used + nbytes > self.capacity:
                raise TierFull(self.name, nbytes, used, self.capacity)

    def _room_for(self, nbytes: int) -> None:
        """TierFull now, not at the first write, when the medium has less room than
        ``nbytes`` even after the pool gives its files back (a write that finds it full
        later, racing another writer, is TierFull too: ``FileWriter.out_of_space``)."""
        st = os.statvfs(self.root)
        if st.f_bavail * st.f_frsize >= nbytes:
            return
        self.trim_pool(0)
        st = os.statvfs(self.root)
        if st.f_bavail * st.f_frsize < nbytes:
            used = self.used_bytes()
            raise TierFull(self.name, nbytes, used, self.capacity or used)

    def _new_file(self, path: Path, nbytes: int, *, how: str = "direct"
                  ) -> tuple[int, int | None, mmap.mmap | None]:
        """A new locked file of ``nbytes``: (locked fd, mapping's fd, mapping). ``how``:
        ``"direct"``, not mapped (a writer fills it through its descriptor, and the
        kernel makes each page as it is written: host pages are not allocated here, a
        disk file's blocks are); ``"fresh"``, mapped shared and pre-faulted (on every
        I/O worker at once when large); ``"lazy"``, mapped, its pages allocated by
        fallocate and faulted in by the caller."""
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            if not lock_nb(fd):  # nobody else can know this fresh name
                raise OSError(errno.EWOULDBLOCK, f"cannot lock new segment {path}")
            if how == "direct":
                if self.persistent:
                    self.allocate(fd, 0, nbytes)
                else:
                    self._room_for(nbytes)
                    os.ftruncate(fd, nbytes)  # tmpfs: writes make the pages
                return fd, None, None
            self.allocate(fd, 0, nbytes)
            # map through a second open file description: mmap keeps a dup of the fd it
            # is given, and a dup of the locked description would keep the lock for as
            # long as the mapping lives (its unmapping runs in the background)
            map_fd, mm = map_shared(path, nbytes, how)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        return fd, map_fd, mm

    def _from_pool(self, path: Path, nbytes: int) -> tuple[int, int, mmap.mmap] | None:
        """A pooled file claimed for a new segment at ``path``, sized and mapped: its
        pages are resident, so mapping them costs page-table entries only, and nothing
        at all where this process still holds a mapping of that file."""
        got = self._pool.claim(nbytes, path, self._maps.inodes())
        if got is None:
            return None
        try:
            if got.size > nbytes:
                os.ftruncate(got.fd, nbytes)  # the tail goes back to the system
            elif got.size < nbytes or got.allocated < nbytes:
                self.allocate(got.fd, 0, nbytes)
            kept = self._maps.take(got.ino, nbytes)
            if kept is not None:
                self._pool.counters["mapping_reused"] = \
                    self._pool.counters.get("mapping_reused", 0) + 1
                return got.fd, kept[0], kept[1]
            map_fd, mm = map_shared(path, nbytes, "resident")
        except BaseException:
            self.discard(path, got.fd)
            os.close(got.fd)
            raise
        return got.fd, map_fd, mm

    def create(self, segment_id: str, nbytes: int) -> SegmentWriter:
        if nbytes <= 0:
            raise ValueError("a segment holds at least one byte")
        self._check_capacity(nbytes)
        path = self.path(segment_id)
        made = self._from_pool(path, nbytes) or self._new_file(path, nbytes)
        return FileWriter(self, segment_id, path, made[0], made[1], made[2], nbytes)

    # -- what its writers use (``WriterTier`` of ``_file_writer``) --------------------
    # public for ``FileWriter`` and for the tiers built on this one (``DiskTier``,
    # ``_disk``); a caller of the tier needs none of them
    def allocate(self, fd: int, offset: int, nbytes: int) -> None:
        """Allocate pages for real: a file only truncated to size on a full tmpfs maps
        fine and then kills the writer with SIGBUS at the first write. On a full medium
        the pool gives its files back first; TierFull if that is not enough."""
        for attempt in (0, 1):
            try:
                os.posix_fallocate(fd, offset, nbytes)
                return
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise
                if attempt == 0 and exc.errno != errno.EFBIG and self.trim_pool(0):
                    continue
                raise TierFull(self.name, nbytes, self.used_bytes(),
                               self.capacity or self.used_bytes()) from exc

    def sync_dir(self) -> None:
        """fsync the tier's directory: a name made or renamed in it is durable."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def writer_released(self) -> None:
        """A writer of this tier let go of its segment (a hook: the host tier refills
        its spare)."""

    def segment_written(self, segment_id: str, fd: int) -> None:
        """A writer finished a segment's bytes (a hook: the disk tier marks it
        verified)."""

    def retire_mapping(self, map_fd: int, mm: mmap.mmap) -> None:
        """A writer is done with its mapping: kept for the file's next turn from the
        pool where the tier pools, else unmapped in the background."""
        if self._pool.limit > 0:
            self._maps.keep(map_fd, mm)
        else:
            close_in_background(mm, map_fd)

    def discard(self, path: Path, fd: int) -> None:
        """Drop the file at ``path``, exclusively locked by the caller through ``fd``
        (so nobody maps it): into the pool if it fits, else unlinked."""
        if self._pool.put(path, fd):
            return
        try:
            if same_file(fd, path):
                os.unlink(path)
        except FileNotFoundError:
            pass
        self._maps.forget(os.fstat(fd).st_ino)

    # -- reading -------------------------------------------------------------------
    def _open_ro(self, segment_id: str) -> int:
        """A read-only descriptor of the segment's file, holding a shared lock on it (a
        writer still finishing it lets go first); SegmentMissing when it is gone."""
        path = self.path(segment_id)
        for _ in range(3):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError as exc:
                raise SegmentMissing(self.name, segment_id) from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                # between our open and our lock the file may have gone to the pool (and
                # even come back as another segment): only the file still at the path
                # is the segment
                if same_file(fd, path):
                    return fd
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        raise SegmentMissing(self.name, segment_id)

    def _check_first_open(self, segment_id: str, fd: int, view: HostView | None) -> None:
        """Hook: the disk tier verifies a segment at its first open per boot."""

    def _map(self, segment_id: str, fd: int) -> HostView:
        try:
            # the mapping keeps a dup of fd: the shared lock lives as long as it does
            return HostView(fd, 0, access=mmap.ACCESS_COPY)
        except ValueError as exc:  # an empty file: truncated under us
            raise SegmentMissing(self.name, segment_id) from exc

    def open(self, segment_id: str) -> HostView:
        fd = self._open_ro(segment_id)
        try:
            view = self._map(segment_id, fd)
            self._check_first_open(segment_id, fd, view)
            return view
        finally:
            os.close(fd)

    def inspect(self, segment_id: str) -> HostView:
        """A view of the segment for checking its bytes: nothing verified at the open
        (``verify`` and the scrub read through it)."""
        fd = self._open_ro(segment_id)
        try:
            return self._map(segment_id, fd)
        finally:
            os.close(fd)

    def peek(self, segment_id: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        fd = self._open_ro(segment_id)
        try:
            return [os.pread(fd, n, off) for off, n in ranges]
        finally:
            os.close(fd)

    #: bytes per read of ``read_into``: pieces small enough to spread over the I/O
    #: pool's threads, large enough that a syscall is noise beside its copy
    READ_PIECE = 8 << 20

    def read_into(self, segment_id: str, items: list[tuple[int, np.ndarray]]) -> bool:
        """``preadv`` straight into the buffers: the kernel copies from the file's pages,
        the GIL is released, and pieces run in parallel on the I/O pool."""
        fd = self._open_ro(segment_id)
        try:
            self._check_first_open(segment_id, fd, None)
            size = os.fstat(fd).st_size
            piece = self.READ_PIECE
            jobs: list[tuple[int, np.ndarray]] = []
            for offset, out in items:
                n = out.shape[0]
                if offset < 0 or offset + n > size:
                    raise SegmentMissing(self.name, segment_id)  # not the segment we know
                jobs.extend((offset + lo, out[lo : lo + piece]) for lo in range(0, n, piece))

            def read(job: tuple[int, np.ndarray]) -> None:
                off, out = job
                view = memoryview(out)
                done = 0
                while done < len(view):
                    got = os.preadv(fd, [view[done:]], off + done)
                    if got <= 0:
                        raise SegmentMissing(self.name, segment_id)  # truncated under us
                    done += got

            if len(jobs) <= 1:
                for job in jobs:
                    read(job)
            else:
                futures = [io_pool().submit(read, job) for job in jobs]
                wait(futures)  # every read over before an error surfaces (and fd closes)
                for f in futures:
                    f.result()
        finally:
            os.close(fd)
        return True

    # -- housekeeping --------------------------------------------------------------
    def delete(self, segment_id: str) -> bool:
        """Remove a segment. A file nobody maps (its exclusive lock is free) goes to the
        pool when the tier pools and the pool has room; any other is unlinked, so a
        reader's mapping keeps its pages and its bytes."""
        path = self.path(segment_id)
        if self._pool.limit > 0:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return False
            try:
                if lock_nb(fd) and same_file(fd, path):
                    self.discard(path, fd)
                    return True
            finally:
                os.close(fd)
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False

    def segments(self) -> Iterator[str]:
        with os.scandir(self.root) as it:
            for entry in it:
                if entry.name.endswith(_SUFFIX):
                    yield entry.name[: -len(_SUFFIX)]

    def reclaim_orphans(self, is_registered: Callable[[str], bool]) -> list[str]:
        reclaimed: list[str] = []
        with os.scandir(self.root) as it:
            entries = [e.name for e in it]
        for fname in entries:
            is_spare = fname.startswith(_SPARE_PREFIX)
            if not (is_spare or fname.endswith(_SUFFIX)):
                continue
            seg = fname[: -len(_SUFFIX)] if not is_spare else fname
            if not is_spare and is_registered(seg):
                continue
            path = self.root / fname
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                if not lock_nb(fd):
                    continue  # its writer is alive (or a reader maps it)
                # the writer may have registered it and let go between our two looks
                if not is_spare and is_registered(seg):
                    continue
                if same_file(fd, path):
                    self.discard(path, fd)  # nobody maps it: the pool may take it
                    reclaimed.append(seg)
            finally:
                os.close(fd)
        return reclaimed

    def close(self) -> None:
        self._maps.close()

    # -- the pool --------------------------------------------------------------------
    @property
    def pool_limit(self) -> int:
        """Bytes of freed files the pool may hold (0: the tier does not pool)."""
        return self._pool.limit

    @pool_limit.setter
    def pool_limit(self, value: int) -> None:
        self._pool.limit = max(0, int(value))
        self.trim_pool()

    def pool_file(self, path: Path) -> bool:
        """Give the tier's pool a file nobody maps any more (a freed KV slab, say): pooled
        if it fits the bound, else unlinked. False when its lock is held (someone still
        uses it: it is left alone) or it is gone."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            if not lock_nb(fd):
                return False
            self.discard(path, fd)
            return True
        finally:
            os.close(fd)

    def pooled_bytes(self) -> int:
        """Bytes of pages the pool holds now, for every process of the store."""
        return self._pool.pooled_bytes()

    def trim_pool(self, limit: int | None = None) -> int:
        """Give pooled files back to the system, oldest first, until the pool holds at
        most ``limit`` bytes (default: its bound; 0: all; everything when memory is
        short); returns the bytes given back."""
        freed = self._pool.trim(limit)
        self._maps.prune()
        return freed

    def pool_counters(self) -> dict[str, int]:
        """This process's pool figures: ``claimed`` (files a write reused) and their
        bytes, ``pooled`` (files a delete, abort or orphan reclaim kept) and their
        bytes, ``mapping_reused`` (claims that found this process's own mapping of the
        file), ``released_bytes`` (given back by trims)."""
        out = dict(self._pool.counters)
        out.setdefault("mapping_reused", 0)
        return out

    def used_bytes(self) -> int:
        total = 0
        with os.scandir(self.root) as it:
            for entry in it:
                if entry.name.endswith(_SUFFIX):
                    try:
                        total += entry.stat().st_blocks * 512
                    except FileNotFoundError:
                        pass
        return total


#: a spare is faulted in pieces of this size, so closing the tier stops a refill early
#: (a process that commits and exits does not wait a second for a spare it drops)
_FAULT_PIECE = 64 << 20

#: a spare: its path, the locked fd, the mapping's fd, the mapping, its size
_Spare = tuple[Path, int, int, mmap.mmap, int]


class HostTier(FileTier):
    """Segments in POSIX shared memory (tmpfs), with a pool of freed files shared by
    the store's processes (``pool_limit``; None: a quarter of the host's memory) and an
    optional pre-faulted spare per process (``spare_bytes``, ``prefault``)."""

    def __init__(self, root: Path, *, capacity: int | None = None,
                 spare_bytes: int = 0, pool_limit: int | None = None,
                 marks: Marks | None = None) -> None:
        super().__init__("host", root, capacity=capacity, persistent=False,
                         pool_limit=pool_limit, marks=marks)
        self._lock = threading.Lock()
        self._spare: _Spare | None = None
        self._pending: Future[None] | None = None
        self._pool_threads: ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self._closing = threading.Event()  # a refill still faulting stops early
        self.spare_bytes = spare_bytes
        if spare_bytes:
            self.prefault(spare_bytes, wait=False)

    def _make_spare(self, nbytes: int) -> None:
        path = self.root / f"{_SPARE_PREFIX}{uuid.uuid4().hex}"
        # runs beside the caller's threads: fallocate and numpy's page walk release the
        # GIL, MAP_POPULATE would not
        fd, map_fd, mm = self._new_file(path, nbytes, how="lazy")
        assert map_fd is not None and mm is not None
        pages = np.frombuffer(mm, dtype=np.uint8)
        for lo in range(0, nbytes, _FAULT_PIECE):
            if self._closing.is_set():  # closed meanwhile: the spare would only be dropped
                del pages
                self._drop((path, fd, map_fd, mm, nbytes))
                return
            pages[lo : lo + _FAULT_PIECE : mmap.PAGESIZE] = 0
        del pages
        with self._lock:
            old, self._spare = self._spare, (path, fd, map_fd, mm, nbytes)
        if old is not None:
            self._drop(old)

    def _drop(self, spare: _Spare) -> None:
        """A spare given up: its file goes to the pool (nobody ever mapped it to read)."""
        path, fd, map_fd, mm, _ = spare
        self.discard(path, fd)
        self.retire_mapping(map_fd, mm)
        os.close(fd)

    @staticmethod
    def spare_for(nbytes: int) -> int:
        """A spare that holds a segment of ``nbytes`` of tensors: a segment pads each
        extent to 64 bytes, so the spare is larger by 1/256 (at least 1 MiB); the unused
        tail is given back when a segment takes it."""
        return nbytes + max(1 << 20, nbytes >> 8)

    def prefault(self, nbytes: int, *, wait: bool = True) -> None:
        """Allocate and map a spare of ``nbytes`` so the next commit that fits is a memcpy.
        With ``wait``, TierFull when shared memory has no room for it (and the spare
        size is left as it was: no refill tries it again after each commit)."""
        before = self.spare_bytes
        self.spare_bytes = max(self.spare_bytes, nbytes)
        with self._lock:
            if self._spare is not None and self._spare[4] >= nbytes:
                return
            if self._pool_threads is None:
                self._pool_threads = ThreadPoolExecutor(1, thread_name_prefix="tensordb-prefault")
            if self._pending is None or self._pending.done():
                self._pending = self._pool_threads.submit(self._make_spare, nbytes)
            pending = self._pending
        if wait:
            try:
                pending.result()
            except TierFull:
                self.spare_bytes = before
                raise

    def spare_ready(self) -> int:
        """Bytes of the pre-faulted spare ready now (0: none, or still being faulted)."""
        with self._lock:
            return self._spare[4] if self._spare is not None and os.getpid() == self._pid \
                else 0

    def create(self, segment_id: str, nbytes: int) -> SegmentWriter:
        if os.getpid() != self._pid:  # a forked child does not own its parent's spare
            self._spare, self._pending, self._pool_threads, self._pid = \
                None, None, None, os.getpid()
        if nbytes <= 0:
            raise ValueError("a segment holds at least one byte")
        self._check_capacity(nbytes)
        with self._lock:
            ready, pending = self._spare, self._pending
        if (ready is None or ready[4] < nbytes) and pending is not None \
                and not pending.done() and nbytes <= self.spare_bytes <= 2 * nbytes:
            # the spare is being refilled (a commit came right after the last one): a
            # fresh file would fault in the same pages again, beside the refill and
            # competing with it, so wait for the refill when it is mostly for us
            try:
                pending.result()
            except Exception:  # a failed refill only costs speed: fall back below
                pass
        with self._lock:
            spare = self._spare
            if spare is not None and spare[4] >= nbytes:
                self._spare = None
            else:
                spare = None
        if spare is None:
            return super().create(segment_id, nbytes)
        path, fd, map_fd, mm, _ = spare
        final = self.path(segment_id)
        os.rename(path, final)  # the lock and the mapping follow the inode
        return FileWriter(self, segment_id, final, fd, map_fd, mm, nbytes)

    def writer_released(self) -> None:
        # refill only now: a refill running during the commit would compete for memory
        # bandwidth with the commit's own copy
        if self.spare_bytes and os.getpid() == self._pid:
            self.prefault(self.spare_bytes, wait=False)

    def close(self) -> None:
        self._closing.set()
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except Exception:  # a failed prefault only costs speed
                pass
        with self._lock:
            spare, self._spare = self._spare, None
            threads, self._pool_threads = self._pool_threads, None
        if spare is not None and os.getpid() == self._pid:
            self._drop(spare)
        if threads is not None:
            threads.shutdown(wait=True)
        super().close()
