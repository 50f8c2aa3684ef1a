"""The inputs the client normalises once, at the API edge: names and dtypes.

Collection, tensor and tag names are checked here; dtypes are named as the catalog
writes them and mapped to torch and numpy.
"""

from __future__ import annotations

import functools
import unicodedata
import warnings

import numpy as np
import torch

from tensordb.errors import InvalidInput

__all__ = ["DTYPES", "check_name", "dtype_name", "itemsize", "numpy_to_torch", "torch_dtype"]


_MAX = {"collection": 255, "tensor": 1024, "tag": 255}


def check_name(kind: str, name: object, *, collection: str | None = None) -> str:
    """Return ``name`` if it is a usable ``kind`` name, else raise InvalidInput naming it.

    Names are opaque keys (never paths on disk), but path-like names (``../x``, ``/x``,
    ``a//b``) are refused: they are almost always a bug, and they would become one the
    day a name is used to build a path (export, replication).
    """
    if not isinstance(name, str):
        raise InvalidInput(f"a {kind} name must be a str, not {type(name).__name__}",
                           collection=collection)
    # the common case in a few string methods, not a cached look-up of each: a commit of
    # 100,000 distinct names spent most of its Python time here. A printable ASCII name
    # with no space or dot at its start, no space or slash at its end, no backslash and
    # no "//" or "/." has none of _problem's faults; anything else takes the full check.
    if (name.isascii() and name.isprintable() and 0 < len(name) <= _MAX[kind]
            and name[0] not in " ./" and name[-1] not in " /" and "\\" not in name
            and "//" not in name and "/." not in name):
        return name
    problem = _problem(kind, name)
    if problem is not None:
        raise InvalidInput(problem, collection=collection)
    return name


@functools.lru_cache(maxsize=1 << 14)
def _problem(kind: str, name: str) -> str | None:
    """What is wrong with ``name``, or None. Cached: a model's few hundred tensor names
    come back with every commit of it (checking them was 1.4 ms of a 224-tensor commit)."""
    what = f"{kind} name {name!r}"
    if not name or not name.strip():
        return f"a {kind} name must not be empty"
    if len(name) > _MAX[kind]:
        return f"{what[:80]}... is longer than {_MAX[kind]} characters"
    if not name.isascii():
        try:
            name.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate: no UTF-8 the catalog can keep
            return f"{what} is not valid Unicode (lone surrogate at position {exc.start})"
    if not (name.isascii() and name.isprintable()) and any(
            unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp") for ch in name):
        return f"{what} contains a control character"
    if name != name.strip():
        return f"{what} starts or ends with white space"
    if "\\" in name or name.startswith("/") or name.endswith("/"):
        return f"{what} looks like a path"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return f"{what} looks like a path (empty, '.' or '..' component)"
    return None


_NAMES = [
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2",
]
#: catalog name -> torch dtype, for the dtypes this torch build has
DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in _NAMES if isinstance(getattr(torch, n, None), torch.dtype)
}
_BY_DTYPE = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype, *, tensor: str | None = None) -> str:
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise InvalidInput(
            f"unsupported dtype {dtype} for tensor {tensor!r}; supported: {', '.join(DTYPES)}",
            tensor=tensor,
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


def itemsize(name: str) -> int:
    return DTYPES[name].itemsize


def numpy_to_torch(arr: np.ndarray, *, tensor: str | None = None) -> torch.Tensor:
    if arr.dtype.hasobject or arr.dtype.kind not in "biufc":
        raise InvalidInput(f"unsupported numpy dtype {arr.dtype} for tensor {tensor!r}",
                           tensor=tensor)
    if not arr.dtype.isnative or any(st < 0 for st in arr.strides):
        arr = np.ascontiguousarray(arr.astype(arr.dtype.newbyteorder("="), copy=False))
    try:
        with warnings.catch_warnings():  # read-only arrays are fine: we only read them
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(arr)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"cannot store numpy array {tensor!r}: {exc}", tensor=tensor) from exc
