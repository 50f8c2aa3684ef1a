"""The GPU tier: segments in device memory, shared between processes through CUDA IPC.

Bytes live in ``cudaMalloc`` allocations of the process that wrote them (the *owner*);
each segment has a small file ``<root>/<segment>.ipc`` (mode 0600, in a directory of
mode 0700) holding the owner's identity, the device and the 64-byte
``cudaIpcMemHandle_t``. Another process on the host reads the file and maps the same
device memory with ``cudaIpcOpenMemHandle``: no copy.

Rules that follow from CUDA IPC, and differ from the file tiers:

* **The owner process owns the device memory.** An allocation dies with the process
  that made it, whatever its importers do, so write to the GPU tier from a long-running
  process (``tensordb serve``, an engine's main process); segments of an owner that
  exited are gone (``open`` raises SegmentMissing) and ``reclaim_orphans`` removes their
  files once the catalog forgets them. The tier frees device memory only in the owner.
* **Views are shared, not copy-on-write.** ``open`` returns a ``GpuView`` exposing
  ``__cuda_array_interface__`` (``torch.as_tensor(view, device="cuda")`` views it with no
  copy). Every process sees the same bytes: GPU views are read-only by convention, as
  with ``torch.multiprocessing`` (torch has no read-only flag, and CUDA IPC has no
  private mapping). A reader that writes changes what every reader sees.
* **Deleting keeps mapped bytes alive.** A process that maps a segment holds a shared
  ``flock`` on its ``.ipc`` file for as long as any view of it lives; ``delete`` unlinks
  the file (no new reader finds it) and the owner frees the memory only when it can take
  the lock exclusively and holds no view of its own. The owner checks at each call of
  ``create``, ``delete``, ``reclaim_orphans``, ``used_bytes``, ``close`` and ``sweep``;
  a long-running owner calls ``sweep`` now and then to free what other processes
  deleted.

Writers: ``create`` allocates the device memory at once. Callers either fill
``writer.buffer`` (a host staging array, allocated when first asked for, copied to the
device by ``finish``) or copy device tensors straight into ``writer.device_view()``
(``torch.as_tensor(w.device_view(), device=...)``), with no host round trip.

cuda-python is imported on first use (``_cuda``), so this module imports without it;
``GpuTier.available()`` says whether the tier can run here.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ._cuda import (
    GpuError,
    check,
    handle_bytes,
    handle_from,
    is_oom,
    loaded,
    memcpy,
    on_device,
    probe,
    runtime,
)
from ._errors import SegmentMissing, TierFull
from ._procs import current_holder, holder_alive
from ._tier import SegmentWriter, Tier

__all__ = ["GpuTier", "GpuView"]

IPC_SUFFIX = ".ipc"
_TMP_SUFFIX = ".ipc.tmp"
_TMP_GRACE_S = 60.0


# -- views and the records that keep device memory alive ---------------------------------
class _Owned:
    """A segment this process allocated: freed by ``_sweep`` once nobody maps it."""

    __slots__ = ("path", "ptr", "nbytes", "device", "fd", "ino", "writing", "__weakref__")

    def __init__(self, path: Path, ptr: int, nbytes: int, device: int, fd: int) -> None:
        self.path = path
        self.ptr = ptr
        self.nbytes = nbytes
        self.device = device
        self.fd = fd
        self.ino = os.fstat(fd).st_ino
        self.writing = True


class _Import:
    """A segment of another process mapped into this one; unmapped when the last view
    of it goes (it is held by ``GpuView``s, which torch tensors made from them hold)."""

    __slots__ = ("ptr", "device", "fd", "__weakref__")

    def __init__(self, ptr: int, device: int, fd: int) -> None:
        self.ptr = ptr
        self.device = device
        self.fd = fd


def _close_import(ptr: int, device: int, fd: int) -> None:
    try:
        with on_device(device):
            runtime().cudaIpcCloseMemHandle(ptr)
    except Exception:  # unmapping at teardown: nothing useful to do with a failure
        pass
    finally:
        os.close(fd)  # drops the shared lock: the owner may free the memory now


class GpuView:
    """The device bytes of one segment as a 1-D uint8 ``__cuda_array_interface__``: the
    GPU tier's ``SegmentView``.

    ``torch.as_tensor(view, device=f"cuda:{view.device}")`` is a zero-copy tensor of
    them (it keeps the view, and so the mapping, alive). Read-only by convention: the
    bytes are shared with every other reader and with the owner.
    """

    __slots__ = ("segment_id", "ptr", "nbytes", "device", "_keep", "__weakref__")

    #: the bytes are in device memory: ``host_bytes`` copies them
    on_device = True

    def __init__(self, segment_id: str, ptr: int, nbytes: int, device: int,
                 keep: object) -> None:
        self.segment_id = segment_id
        self.ptr = ptr
        self.nbytes = nbytes
        self.device = device  # the ordinal in this process (CUDA_VISIBLE_DEVICES applied)
        self._keep = keep

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        # torch refuses the read-only flag ("should always be False"): read-only is a
        # convention here, not something the interface can carry
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False),
                "strides": None, "version": 3}

    def __len__(self) -> int:
        return self.nbytes

    def to_host(self, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        """Copy ``nbytes`` from ``offset`` (default: all) into a new host uint8 array."""
        n = self.nbytes - offset if nbytes is None else nbytes
        if offset < 0 or n < 0 or offset + n > self.nbytes:
            raise ValueError(f"bytes {offset}..{offset + n} lie outside the segment "
                             f"of {self.nbytes}")
        out = np.empty(n, np.uint8)
        if n:
            with on_device(self.device):
                memcpy(out.ctypes.data, self.ptr + offset, n, "cudaMemcpyDeviceToHost")
        return out

    def host_bytes(self, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        """``SegmentView.host_bytes``: a copy (``to_host``), since the bytes are on the
        device."""
        return self.to_host(offset, nbytes)


# Process-wide registries, keyed by the .ipc file's path: one process may open a store
# twice, and CUDA refuses to open one handle twice in a process or in its exporter.
_lock = threading.RLock()
_owned: dict[str, _Owned] = {}
_owned_views: dict[str, weakref.WeakSet[GpuView]] = {}
_imports: dict[str, weakref.ReferenceType[_Import]] = {}
_pid = os.getpid()


def _after_fork_check() -> None:
    global _pid
    if os.getpid() != _pid:  # a forked child owns nothing and has mapped nothing
        _owned.clear()
        _owned_views.clear()
        _imports.clear()
        _pid = os.getpid()


def _lock_nb(fd: int, how: int) -> bool:
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


class _GpuWriter(SegmentWriter):
    def __init__(self, tier: GpuTier, segment_id: str, rec: _Owned) -> None:
        self._tier = tier
        self.segment_id = segment_id
        self.nbytes = rec.nbytes
        self._rec: _Owned | None = rec
        self._staging: np.ndarray | None = None

    @property
    def buffer(self) -> np.ndarray:
        """A host staging array; ``finish`` copies it to the device."""
        if self._rec is None:
            raise ValueError(f"the writer of segment {self.segment_id} has ended")
        if self._staging is None:
            self._staging = np.empty(self.nbytes, np.uint8)
        return self._staging

    def device_view(self) -> GpuView:
        """The segment's device memory, writable: copy device tensors straight in. The
        caller synchronises its streams before ``finish``."""
        if self._rec is None:
            raise ValueError(f"the writer of segment {self.segment_id} has ended")
        return self._tier._owned_view(self.segment_id, self._rec)

    def finish(self) -> None:
        rec = self._rec
        if rec is None:
            return
        with on_device(rec.device):
            if self._staging is not None:
                memcpy(rec.ptr, self._staging.ctypes.data, self.nbytes,
                        "cudaMemcpyHostToDevice")
                self._staging = None
            # a reader in another process must find every byte there, whichever stream
            # wrote it
            check(runtime().cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    def release(self) -> None:
        if self._rec is not None:
            self._rec.writing = False
            self._rec = None
            self._staging = None

    def abort(self) -> None:
        rec, self._rec = self._rec, None
        self._staging = None
        if rec is None:
            return
        rec.writing = False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(rec.path)
        self._tier.sweep()


class GpuTier(Tier):
    """Segments in the memory of one CUDA device, mapped across processes by CUDA IPC.

    ``root``: a host directory for the ``.ipc`` files (in the store's shared-memory
    area). ``device``: the CUDA ordinal, in this process, to allocate on. Nothing CUDA is
    touched before the first ``create`` or ``open``.
    """

    supports_gpu = True
    persistent = False

    def __init__(self, root: Path | str, *, device: int = 0,
                 capacity: int | None = None) -> None:
        self.name = "gpu"
        Path(root).mkdir(parents=True, exist_ok=True, mode=0o700)
        # one spelling per directory: the process-wide registries are keyed by path
        self.root = Path(root).resolve()
        self.device = int(device)
        self.capacity = capacity
        os.chmod(self.root, 0o700)

    # -- availability ----------------------------------------------------------------
    @staticmethod
    def available() -> bool:
        """cuda-python imports and a CUDA device answers (cached per process)."""
        return probe() is None

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why ``available()`` is False; None when it is True."""
        return probe()

    # -- paths and metadata ----------------------------------------------------------
    def path(self, segment_id: str) -> Path:
        return self.root / f"{segment_id}{IPC_SUFFIX}"

    def _bus_id(self) -> str | None:
        """The device's PCI bus id, which names it the same in every process."""
        try:
            raw = check(runtime().cudaDeviceGetPCIBusId(32, self.device),
                         "cudaDeviceGetPCIBusId")
        except Exception:  # optional: readers fall back on the ordinal
            return None
        if isinstance(raw, (bytes, bytearray)):
            raw = bytes(raw).split(b"\0", 1)[0].decode()
        return str(raw) or None

    @staticmethod
    def _read_meta(fd: int) -> dict[str, Any] | None:
        try:
            meta = json.loads(os.pread(fd, 4096, 0))
        except (ValueError, OSError):
            return None
        return meta if isinstance(meta, dict) else None

    def _meta_of(self, path: Path) -> dict[str, Any] | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            return self._read_meta(fd)
        finally:
            os.close(fd)

    def _local_device(self, meta: dict[str, Any]) -> int:
        """The owner's device as an ordinal of this process (its CUDA_VISIBLE_DEVICES
        may differ from the owner's)."""
        bus = meta.get("pci_bus_id")
        if bus:
            try:
                return int(check(runtime().cudaDeviceGetByPCIBusId(bus.encode()),
                                  "cudaDeviceGetByPCIBusId"))
            except Exception:  # an older binding's signature: use the ordinal
                pass
        return int(meta["device"])

    # -- writing ---------------------------------------------------------------------
    def create(self, segment_id: str, nbytes: int) -> SegmentWriter:
        if nbytes <= 0:
            raise ValueError("a segment holds at least one byte")
        _after_fork_check()
        self.sweep()
        if self.capacity is not None:
            used = self.used_bytes()
            if used + nbytes > self.capacity:
                raise TierFull(self.name, nbytes, used, self.capacity)
        rt = runtime()
        with on_device(self.device):
            try:
                ptr = int(check(rt.cudaMalloc(nbytes), "cudaMalloc"))
            except GpuError as exc:
                if is_oom(exc):
                    used = self.used_bytes()
                    raise TierFull(self.name, nbytes, used, self.capacity or used) from exc
                raise
            try:
                handle = check(rt.cudaIpcGetMemHandle(ptr), "cudaIpcGetMemHandle")
                bus = self._bus_id()
            except BaseException:
                rt.cudaFree(ptr)
                raise
        tmp = self.root / f"{segment_id}{_TMP_SUFFIX}"
        final = self.path(segment_id)
        fd = -1
        try:
            meta = {"owner": current_holder(), "device": self.device,
                    "pci_bus_id": bus, "nbytes": nbytes,
                    "handle": handle_bytes(handle).hex()}
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
            # locked while half-written: reclaim_orphans takes a lockable tmp file for
            # the leftover of a creator that died here
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, json.dumps(meta).encode())
            if final.exists():
                raise FileExistsError(errno.EEXIST, f"segment {segment_id} exists", str(final))
            rec = _Owned(final, ptr, nbytes, self.device, fd)
            with _lock:  # known as being written before any other thread can see it
                _owned[str(final)] = rec
            try:
                os.rename(tmp, final)
            except BaseException:
                with _lock:
                    _owned.pop(str(final), None)
                raise
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BaseException:
            if fd >= 0:
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            with contextlib.suppress(Exception), on_device(self.device):
                rt.cudaFree(ptr)
            raise
        return _GpuWriter(self, segment_id, rec)

    def _owned_view(self, segment_id: str, rec: _Owned) -> GpuView:
        view = GpuView(segment_id, rec.ptr, rec.nbytes, rec.device, rec)
        with _lock:
            _owned_views.setdefault(str(rec.path), weakref.WeakSet()).add(view)
        return view

    # -- reading ---------------------------------------------------------------------
    def open(self, segment_id: str) -> GpuView:
        """Map a segment (no copy). Shared, read-only by convention; raises
        SegmentMissing when the segment was deleted or its owner process has exited."""
        _after_fork_check()
        path = self.path(segment_id)
        key = str(path)
        with _lock:
            rec = _owned.get(key)
            if rec is not None and self._still_linked(rec):
                return self._owned_view(segment_id, rec)
            ref = _imports.get(key)
            imp = ref() if ref is not None else None
            if imp is not None:
                meta_n = self._meta_of(path)
                if meta_n is not None:
                    return GpuView(segment_id, imp.ptr, int(meta_n["nbytes"]), imp.device, imp)
            return self._import(segment_id, path)

    @staticmethod
    def _still_linked(rec: _Owned) -> bool:
        try:
            return os.stat(rec.path).st_ino == rec.ino
        except FileNotFoundError:
            return False

    def _import(self, segment_id: str, path: Path) -> GpuView:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise SegmentMissing(self.name, segment_id) from exc
        try:
            # held for as long as a view lives: the owner frees nothing under us
            fcntl.flock(fd, fcntl.LOCK_SH)
            meta = self._read_meta(fd)
            if os.fstat(fd).st_nlink == 0 or meta is None:  # deleted before we locked it
                raise SegmentMissing(self.name, segment_id)
            if holder_alive(str(meta.get("owner"))) is not True:
                raise SegmentMissing(self.name, segment_id)  # its memory died with the owner
            device = self._local_device(meta)
            rt = runtime()
            handle = handle_from(bytes.fromhex(meta["handle"]))
            try:
                with on_device(device):
                    ptr = int(check(rt.cudaIpcOpenMemHandle(
                        handle, rt.cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle"))
            except GpuError as exc:
                raise SegmentMissing(self.name, segment_id) from exc
        except BaseException:
            os.close(fd)
            raise
        imp = _Import(ptr, device, fd)
        fin = weakref.finalize(imp, _close_import, ptr, device, fd)
        fin.atexit = False  # at exit the driver unmaps everything itself
        _imports[str(path)] = weakref.ref(imp)
        return GpuView(segment_id, ptr, int(meta["nbytes"]), device, imp)

    # -- housekeeping ----------------------------------------------------------------
    def sweep(self) -> int:
        """Free the device memory of this process's segments that were deleted (by any
        process) and that nobody maps any more. Returns how many were freed. Call it
        now and then in a long-running owner; it never blocks."""
        _after_fork_check()
        freed = 0
        with _lock:
            for key, rec in list(_owned.items()):
                if rec.path.parent != self.root or rec.writing or self._still_linked(rec):
                    continue
                views = _owned_views.get(key)
                if views is not None and len(views) > 0:
                    continue  # this process still holds a view of it
                if not _lock_nb(rec.fd, fcntl.LOCK_EX):
                    continue  # another process still maps it
                try:
                    with on_device(rec.device):
                        check(runtime().cudaFree(rec.ptr), "cudaFree")
                finally:
                    os.close(rec.fd)
                    del _owned[key]
                    _owned_views.pop(key, None)
                freed += 1
        return freed

    def delete(self, segment_id: str) -> bool:
        try:
            os.unlink(self.path(segment_id))
        except FileNotFoundError:
            return False
        with _lock:
            mine = str(self.path(segment_id)) in _owned
        if mine:
            self.sweep()
        return True

    def _entries(self) -> list[str]:
        with os.scandir(self.root) as it:
            return [e.name for e in it]

    def segments(self) -> Iterator[str]:
        """Segments whose owner process is alive (those of a dead owner have no bytes)."""
        for fname in self._entries():
            if not fname.endswith(IPC_SUFFIX):
                continue
            meta = self._meta_of(self.root / fname)
            if meta is not None and holder_alive(str(meta.get("owner"))) is not False:
                yield fname[: -len(IPC_SUFFIX)]

    def reclaim_orphans(self, is_registered: Callable[[str], bool]) -> list[str]:
        """Remove unregistered segments whose writer is gone: those of this process not
        being written, and those of owners that exited (their memory went with them)."""
        _after_fork_check()
        me = current_holder()
        reclaimed: list[str] = []
        for fname in self._entries():
            path = self.root / fname
            if fname.endswith(_TMP_SUFFIX):  # a creator that died between two syscalls
                with contextlib.suppress(FileNotFoundError):
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                    try:
                        # old and unlocked: a live creator locks it right after making it
                        # and renames it within microseconds
                        if (time.time() - os.fstat(fd).st_mtime > _TMP_GRACE_S
                                and _lock_nb(fd, fcntl.LOCK_EX)):
                            os.unlink(path)
                    finally:
                        os.close(fd)
                continue
            if not fname.endswith(IPC_SUFFIX):
                continue
            seg = fname[: -len(IPC_SUFFIX)]
            meta = self._meta_of(path)
            if meta is None:
                continue
            owner = str(meta.get("owner"))
            if owner == me:
                with _lock:
                    rec = _owned.get(str(path))
                    if rec is not None and rec.writing:
                        continue  # a writer of this process has not registered it yet
            elif holder_alive(owner) is not False:
                continue  # a live owner's writer may still be registering it
            if is_registered(seg):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                reclaimed.append(seg)
        self.sweep()
        return reclaimed

    def used_bytes(self) -> int:
        """Device bytes held by segments of live owners on this tier's directory."""
        self.sweep()
        total = 0
        for fname in self._entries():
            if fname.endswith(IPC_SUFFIX):
                meta = self._meta_of(self.root / fname)
                if meta is not None and holder_alive(str(meta.get("owner"))) is not False:
                    total += int(meta.get("nbytes", 0))
        return total

    def close(self) -> None:
        """Free what was deleted and is no longer mapped. Live segments stay: their
        memory belongs to this process until it exits."""
        if loaded():
            self.sweep()
