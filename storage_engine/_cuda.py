"""The CUDA runtime, through cuda-python, imported on first use.

cuda-python is imported lazily (``cuda.bindings.runtime``, or ``cuda.cudart`` before
12.6), so the storage engine imports without it; ``probe`` says whether a GPU tier can
run here. Checking initialises the CUDA driver in the calling process, as
``torch.cuda.is_available()`` does: a process forked after that cannot use CUDA.

Tests put a stand-in runtime in place by assigning this module's ``_rt``.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import threading
from collections.abc import Iterator
from typing import Any

from ._errors import StorageError

__all__ = ["GpuError"]

HANDLE_BYTES = 64


class GpuError(StorageError):
    """A CUDA runtime call failed."""


_rt: Any = None
_rt_lock = threading.Lock()
_probe_result: str | None | bool = False  # False: not probed yet


def _import_runtime() -> Any:
    try:
        return importlib.import_module("cuda.bindings.runtime")  # cuda-python >= 12.6
    except ImportError:
        return importlib.import_module("cuda.cudart")  # older releases


def runtime() -> Any:
    """The cuda-python runtime module; GpuError when cuda-python is missing."""
    global _rt
    if _rt is None:
        with _rt_lock:
            if _rt is None:
                try:
                    _rt = _import_runtime()
                except ImportError as exc:
                    raise GpuError("the GPU tier needs cuda-python (pip install "
                                   "'tensordb[gpu]')") from exc
    return _rt


def loaded() -> bool:
    """Whether the runtime was imported (or a stand-in installed) in this process."""
    return _rt is not None


def check(result: Any, what: str) -> Any:
    """Unpack a cuda-python ``(err, value...)`` tuple; GpuError unless cudaSuccess."""
    rt = runtime()
    err = result[0] if isinstance(result, tuple) else result
    if err != rt.cudaError_t.cudaSuccess:
        try:
            name = rt.cudaGetErrorName(err)[1].decode()
            text = rt.cudaGetErrorString(err)[1].decode()
        except Exception:  # the error of a broken runtime: say what we can
            name, text = str(err), ""
        raise GpuError(f"{what} failed: {name}: {text}".rstrip(": "))
    if not isinstance(result, tuple) or len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def is_oom(exc: GpuError) -> bool:
    return "cudaErrorMemoryAllocation" in str(exc)


def probe() -> str | None:
    """None when a GPU tier can run here, else why not (cached per process)."""
    global _probe_result
    if _probe_result is not False:
        return _probe_result if isinstance(_probe_result, str) else None
    reason: str | None
    try:
        rt = runtime()
    except GpuError:
        reason = "cuda-python is not installed (pip install 'tensordb[gpu]')"
    except Exception as exc:  # a broken install: report it rather than crash the import
        reason = f"cuda-python does not import: {type(exc).__name__}: {exc}"
    else:
        try:
            count = check(rt.cudaGetDeviceCount(), "cudaGetDeviceCount")
            reason = None if count and int(count) > 0 else "no CUDA device is present"
        except GpuError as exc:
            reason = f"no usable CUDA device: {exc}"
        except Exception as exc:  # e.g. libcuda cannot be loaded
            reason = f"the CUDA driver cannot be loaded: {type(exc).__name__}: {exc}"
    _probe_result = reason
    return reason


def handle_bytes(handle: Any) -> bytes:
    return ctypes.string_at(handle.getPtr(), HANDLE_BYTES)


def handle_from(raw: bytes) -> Any:
    handle = runtime().cudaIpcMemHandle_t()
    ctypes.memmove(handle.getPtr(), raw, HANDLE_BYTES)
    return handle


@contextlib.contextmanager
def on_device(device: int) -> Iterator[None]:
    """Make ``device`` current for the calling thread, and restore the previous one: the
    caller's framework (torch) keeps its own idea of the current device."""
    rt = runtime()
    prev = check(rt.cudaGetDevice(), "cudaGetDevice")
    if prev != device:
        check(rt.cudaSetDevice(device), "cudaSetDevice")
    try:
        yield
    finally:
        if prev != device:
            rt.cudaSetDevice(prev)


def memcpy(dst: int, src: int, nbytes: int, kind: str) -> None:
    """``cudaMemcpy`` of ``kind`` (a ``cudaMemcpyKind`` name) on the current device."""
    rt = runtime()
    check(rt.cudaMemcpy(dst, src, nbytes, getattr(rt.cudaMemcpyKind, kind)), "cudaMemcpy")


def synchronize(device: int) -> None:
    """Wait for every stream of ``device``: another process must find every byte there."""
    with on_device(device):
        check(runtime().cudaDeviceSynchronize(), "cudaDeviceSynchronize")
