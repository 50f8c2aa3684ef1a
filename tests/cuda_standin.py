"""A stand-in CUDA runtime for the GPU tiers' bookkeeping tests: "device memory" is a
shared-memory file per allocation, mapped where CUDA would map device memory, so the
IPC rules (one owner per allocation, a handle opens once per process and never in its
exporter) hold across real processes. ``install(root)`` puts it in place of cuda-python
for the calling process."""

from __future__ import annotations

import contextlib
import ctypes
import enum
import gc
import mmap
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from storage_engine import _cuda, _gpu


class _Err(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMemoryAllocation = 2
    cudaErrorMapBufferObjectFailed = 205
    cudaErrorInvalidResourceHandle = 400


class _Kind(enum.IntEnum):
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3


class _Handle:
    def __init__(self) -> None:
        self._buf = ctypes.create_string_buffer(64)

    def getPtr(self) -> int:  # noqa: N802 - the cuda-python name
        return ctypes.addressof(self._buf)


class FakeRuntime:
    """The calls the GPU tier makes, with CUDA's rules: an allocation has one owner,
    a handle opens once per process and never in its exporter."""

    cudaError_t = _Err
    cudaMemcpyKind = _Kind
    cudaIpcMemHandle_t = _Handle
    cudaIpcMemLazyEnablePeerAccess = 1
    OK = _Err.cudaSuccess

    def __init__(self, root: Path, limit: int | None = None) -> None:
        self.root = root
        self.limit = limit
        self.device = 0
        self.allocs: dict[int, tuple[str, mmap.mmap, int]] = {}
        self.imports: dict[int, tuple[str, mmap.mmap]] = {}
        self.freed: list[str] = []
        self.closed: list[str] = []

    @staticmethod
    def _addr(mm: mmap.mmap) -> int:
        return ctypes.addressof(ctypes.c_char.from_buffer(mm))

    def cudaGetDeviceCount(self) -> tuple[Any, int]:  # noqa: N802
        return self.OK, 1

    def cudaGetDevice(self) -> tuple[Any, int]:  # noqa: N802
        return self.OK, self.device

    def cudaSetDevice(self, device: int) -> tuple[Any]:  # noqa: N802
        self.device = device
        return (self.OK,)

    def cudaDeviceSynchronize(self) -> tuple[Any]:  # noqa: N802
        return (self.OK,)

    def cudaDeviceGetPCIBusId(self, n: int, device: int) -> tuple[Any, bytes]:  # noqa: N802
        return self.OK, b"0000:00:00.0" + b"\0" * (n - 12)

    def cudaDeviceGetByPCIBusId(self, bus: bytes) -> tuple[Any, int]:  # noqa: N802
        return self.OK, 0

    def cudaGetErrorName(self, err: Any) -> tuple[Any, bytes]:  # noqa: N802
        return self.OK, _Err(err).name.encode()

    def cudaGetErrorString(self, err: Any) -> tuple[Any, bytes]:  # noqa: N802
        return self.OK, b"stand-in runtime"

    def cudaMalloc(self, n: int) -> tuple[Any, int | None]:  # noqa: N802
        used = sum(a[2] for a in self.allocs.values())
        if self.limit is not None and used + n > self.limit:
            return _Err.cudaErrorMemoryAllocation, None
        name = uuid.uuid4().hex
        fd = os.open(self.root / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, n)
        mm = mmap.mmap(fd, n)
        os.close(fd)
        ptr = self._addr(mm)
        self.allocs[ptr] = (name, mm, n)
        return self.OK, ptr

    def cudaFree(self, ptr: int) -> tuple[Any]:  # noqa: N802
        name, _, _ = self.allocs.pop(ptr)
        os.unlink(self.root / name)
        self.freed.append(name)
        return (self.OK,)

    def cudaIpcGetMemHandle(self, ptr: int) -> tuple[Any, _Handle]:  # noqa: N802
        h = _Handle()
        ctypes.memmove(h.getPtr(), self.allocs[ptr][0].encode(), 32)
        return self.OK, h

    def cudaIpcOpenMemHandle(self, h: _Handle, flags: int) -> tuple[Any, int | None]:  # noqa: N802
        name = ctypes.string_at(h.getPtr(), 32).decode()
        if any(a[0] == name for a in self.allocs.values()) or \
                any(i[0] == name for i in self.imports.values()):
            return _Err.cudaErrorInvalidResourceHandle, None
        try:
            fd = os.open(self.root / name, os.O_RDWR)
        except FileNotFoundError:
            return _Err.cudaErrorMapBufferObjectFailed, None
        mm = mmap.mmap(fd, 0)
        os.close(fd)
        ptr = self._addr(mm)
        self.imports[ptr] = (name, mm)
        return self.OK, ptr

    def cudaIpcCloseMemHandle(self, ptr: int) -> tuple[Any]:  # noqa: N802
        self.closed.append(self.imports.pop(ptr)[0])
        return (self.OK,)

    def cudaMemcpy(self, dst: int, src: int, n: int, kind: Any) -> tuple[Any]:  # noqa: N802
        ctypes.memmove(dst, src, n)
        return (self.OK,)


def install(root: Path, limit: int | None = None) -> FakeRuntime:
    (root / "device").mkdir(parents=True, exist_ok=True)
    fake = FakeRuntime(root / "device", limit)
    _cuda._rt = fake
    return fake


@contextlib.contextmanager
def installed(root: Path, limit: int | None = None) -> Iterator[FakeRuntime]:
    """The stand-in in place for a test; afterwards the real runtime (or none) is back
    and the GPU tier's process-wide registries hold nothing of ``root``."""
    saved = _cuda._rt
    fake = install(root, limit)
    try:
        yield fake
    finally:
        gc.collect()  # close the stand-in mappings while the stand-in is installed
        _cuda._rt = saved
        with _gpu._lock:
            for key in [k for k in _gpu._owned if k.startswith(str(root))]:
                os.close(_gpu._owned.pop(key).fd)
                _gpu._owned_views.pop(key, None)
            _gpu._imports.clear()
