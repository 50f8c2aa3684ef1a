"""The geometry of a slice: the box a read asks for (given, or a rank's part), and
whether a box of a C-contiguous tensor is one run of bytes (one copy, not one per row)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

from tensordb.errors import InvalidInput

__all__ = ["int_list", "rank_box", "run_of"]


def int_list(what: str, value: object, n: int, where: str, collection: str) -> tuple[int, ...]:
    """``value`` as ``n`` ints (a box's offsets or shape), or InvalidInput naming it."""
    try:
        out: tuple[object, ...] | None = tuple(cast(Iterable[object], value))
    except TypeError:
        out = None
    if out is None or len(out) != n or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in out):
        raise InvalidInput(f"{where}: {what} must be {n} integers (the tensor has {n} "
                           f"dimensions), not {value!r}", collection=collection)
    return cast(tuple[int, ...], out)


def run_of(shape: tuple[int, ...], box: tuple[slice, ...]) -> tuple[int, int] | None:
    """(first element, element count) when ``box`` of a C-contiguous array of ``shape``
    is one run of consecutive elements; else None."""
    dims = len(shape)
    ext = [b.stop - b.start for b in box]
    # leading dims one index wide, then one partial dim, then whole dims
    first = next((d for d in range(dims) if ext[d] > 1), dims)
    if any(ext[d] != shape[d] for d in range(first + 1, dims)):
        return None
    start, stride, count = 0, 1, 1
    for d in reversed(range(dims)):
        start += box[d].start * stride
        stride *= shape[d]
        count *= box[d].stop - box[d].start
    return start, count


def rank_box(shape: tuple[int, ...], rank: object, world_size: object, dim: object,
              where: str, collection: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The box of part ``rank`` of ``world_size`` along ``dim`` (torch.chunk's split:
    parts of ceil(size / world_size), the last smaller, late ranks possibly empty)."""
    for what, v in (("rank", rank), ("world_size", world_size), ("dim", dim)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise InvalidInput(f"{where}: {what} must be an int, not {v!r}",
                               collection=collection)
    assert isinstance(rank, int) and isinstance(world_size, int) and isinstance(dim, int)
    if world_size < 1 or not 0 <= rank < world_size:
        raise InvalidInput(f"{where}: rank {rank} is out of range for world_size {world_size}",
                           collection=collection)
    nd = len(shape)
    if not -nd <= dim < nd:
        raise InvalidInput(f"{where}: dim {dim} is out of range for a {nd}-d tensor",
                           collection=collection)
    dim %= nd
    step = -(-shape[dim] // world_size)
    start = min(rank * step, shape[dim])
    length = max(0, min(step, shape[dim] - start))
    off = tuple(start if d == dim else 0 for d in range(nd))
    shp = tuple(length if d == dim else shape[d] for d in range(nd))
    return off, shp
