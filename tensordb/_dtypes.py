"""The dtypes tensordb stores, by the names written in the catalog."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from .errors import InvalidInput

__all__ = ["DTYPES", "dtype_name", "torch_dtype", "itemsize"]

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
