"""torch modules in and out of a collection, and tensor-parallel reads.

Everything here maps the store's bytes: a module loaded with ``load_module`` runs on
zero-copy views of a snapshot where it can (copy-on-write: the module's writes stay
private to the process), and a rank's shard is a view of its slice of the stored tensor.
Views stay valid after their snapshot is closed: they keep their own mapping.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass

import torch

import tensordb
from tensordb.errors import InvalidInput, NotFound

__all__ = [
    "LoadReport",
    "commit_module",
    "load_module",
    "shard",
    "shard_bounds",
    "shard_state_dict",
]


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What ``load_module`` did: which tensors the module now maps (``assigned``, zero-copy)
    and which it copied into its own storage (``copied``), by state_dict name."""

    collection: str
    version: int
    assigned: tuple[str, ...]
    copied: tuple[str, ...]
    missing: tuple[str, ...]  # in the module, not in the collection (strict=False only)
    unexpected: tuple[str, ...]  # in the collection, not in the module (strict=False only)

    @property
    def zero_copy(self) -> bool:
        return not self.copied


def _int(value: object, what: str, collection: str, name: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"{what} must be an int, not {value!r}", collection=collection,
                           tensor=name)
    return value


def _assignable(current: torch.Tensor, stored: torch.Tensor) -> bool:
    # a module built on the meta device (no memory at all) is the cheapest to load into
    return (current.device.type in ("cpu", "meta") and current.dtype == stored.dtype
            and current.shape == stored.shape and current.layout == torch.strided)


def load_module(db: tensordb.Database, collection: str, module: torch.nn.Module, *,
                version: int | None = None, tag: str | None = None, strict: bool = True,
                assign: bool | None = None) -> LoadReport:
    """Load a version (head, ``version`` or ``tag``) of ``collection`` into ``module``.

    ``assign=None`` (default): each parameter or buffer that is on the CPU with the stored
    dtype and shape is replaced by the store's zero-copy view (``load_state_dict(...,
    assign=True)``; ``requires_grad`` and tied parameters are kept); the others are
    filled with ``copy_`` (device and dtype conversion). ``assign=False``: copy all.
    ``assign=True``: zero-copy all, InvalidInput where a tensor cannot be. A module built
    on the meta device (``with torch.device("meta"): ...``) is loaded with no allocation.
    ``strict``: names must match exactly (InvalidInput naming the difference). Shapes
    must always match. The module is not touched unless every check passes. Called from
    the process that owns the module; it blocks while mapping, never while copying
    anything but the ``copy_`` tensors.
    """
    if not isinstance(module, torch.nn.Module):
        raise InvalidInput(f"module must be a torch.nn.Module, not {type(module).__name__}",
                           collection=collection)
    if assign not in (None, True, False):
        raise InvalidInput(f"assign must be None, True or False, not {assign!r}",
                           collection=collection)
    with db.snapshot(collection, version=version, tag=tag) as snap:
        got_version = snap.version
        stored = snap.state_dict()
    current = module.state_dict(keep_vars=True)
    missing = tuple(n for n in current if n not in stored)
    unexpected = tuple(n for n in stored if n not in current)
    if strict and (missing or unexpected):
        raise InvalidInput(f"{collection} v{got_version} does not match the module: missing "
                           f"{list(missing)[:10]}, unexpected {list(unexpected)[:10]}",
                           collection=collection, version=got_version)
    names = [n for n in current if n in stored]
    for n in names:
        if tuple(current[n].shape) != tuple(stored[n].shape):
            raise InvalidInput(f"{collection}/{n}: stored shape {tuple(stored[n].shape)} != "
                               f"the module's {tuple(current[n].shape)}", collection=collection,
                               tensor=n, version=got_version)
    if assign is False:
        zero = []
    else:
        zero = [n for n in names if _assignable(current[n], stored[n])]
        if assign is True and len(zero) != len(names):
            bad = next(n for n in names if n not in set(zero))
            raise InvalidInput(f"{collection}/{bad}: cannot be assigned zero-copy (the module "
                               f"holds {current[bad].dtype} on {current[bad].device}, the store "
                               f"{stored[bad].dtype} on cpu); use assign=None to copy it",
                               collection=collection, tensor=bad, version=got_version)
    zero_set = set(zero)
    copy = [n for n in names if n not in zero_set]
    meta = [n for n in copy if current[n].is_meta]
    if meta:
        raise InvalidInput(f"{collection}/{meta[0]}: the module holds it on the meta device as "
                           f"{current[meta[0]].dtype}, the store as {stored[meta[0]].dtype}; "
                           f"nothing to copy into", collection=collection, tensor=meta[0],
                           version=got_version)
    # tied parameters (one tensor under several names) must stay one tensor
    aliases: dict[int, list[str]] = {}
    for n in zero:
        aliases.setdefault(id(current[n]), []).append(n)
    if zero:
        module.load_state_dict({n: stored[n] for n in zero}, strict=False, assign=True)
        for group in aliases.values():
            if len(group) > 1:
                _retie(module, group)
    with torch.no_grad():
        for n in copy:
            current[n].copy_(stored[n])
    return LoadReport(collection, got_version, tuple(zero), tuple(copy), missing, unexpected)


def _retie(module: torch.nn.Module, names: list[str]) -> None:
    first_mod, _, first_attr = names[0].rpartition(".")
    owner = module.get_submodule(first_mod)
    value = getattr(owner, first_attr)
    for n in names[1:]:
        mod_name, _, attr = n.rpartition(".")
        sub = module.get_submodule(mod_name)
        # Module.__setattr__ replaces the parameter or buffer of that name in place (a
        # buffer keeps its persistence)
        setattr(sub, attr, value)


def commit_module(db: tensordb.Database, collection: str, module: torch.nn.Module, *,
                  message: str | None = None, tier: str | None = None,
                  metadata: Mapping[str, str] | None = None) -> tensordb.Commit:
    """Commit ``module.state_dict()`` as a new version of ``collection``. Unchanged
    tensors share their extent with the head: a step that changed one parameter of a
    thousand stores one. Tensors on a GPU are copied to the host first."""
    if not isinstance(module, torch.nn.Module):
        raise InvalidInput(f"module must be a torch.nn.Module, not {type(module).__name__}",
                           collection=collection)
    return db.commit(collection, module.state_dict(), message=message, tier=tier,
                     metadata=metadata)


# -- tensor-parallel reads -------------------------------------------------------------
def shard_bounds(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """(start, length) of ``rank``'s part of a dimension of ``size`` split ``world_size``
    ways as torch.chunk does: parts of ceil(size / world_size), the last smaller, ranks
    past the end empty."""
    step = -(-size // world_size)
    start = min(rank * step, size)
    return start, max(0, min(step, size - start))


def _check_shard_args(collection: str, name: str | None, rank: object,
                      world_size: object) -> tuple[int, int]:
    ws = _int(world_size, "world_size", collection, name)
    r = _int(rank, "rank", collection, name)
    if ws < 1:
        raise InvalidInput(f"world_size must be >= 1, not {ws}", collection=collection,
                           tensor=name)
    if not 0 <= r < ws:
        raise InvalidInput(f"rank {r} is out of range for world_size {ws}",
                           collection=collection, tensor=name)
    return r, ws


def _slice(snap: tensordb.Snapshot, name: str, rank: int, world_size: int,
           dim: object) -> torch.Tensor:
    """Rank ``rank``'s part of ``name`` along ``dim``: only its bytes are read, whether
    the tensor was stored whole (a zero-copy view) or in shards (``Snapshot.slice``)."""
    collection = snap.collection
    d = _int(dim, "dim", collection, name)
    if name not in snap:
        raise NotFound(f"collection {collection!r} version {snap.version} has no tensor "
                       f"{name!r}", collection=collection, tensor=name, version=snap.version)
    shape = snap.info()[name][1]
    if not shape:
        raise InvalidInput(f"{collection}/{name} is 0-d and cannot be sharded",
                           collection=collection, tensor=name)
    if not -len(shape) <= d < len(shape):
        raise InvalidInput(f"dim {d} is out of range for {collection}/{name} of shape "
                           f"{tuple(shape)}", collection=collection, tensor=name)
    return snap.slice(name, rank=rank, world_size=world_size, dim=d)


def shard(db: tensordb.Database, collection: str, name: str, *, rank: int, world_size: int,
          dim: int = 0, version: int | None = None) -> torch.Tensor:
    """Rank ``rank`` of ``world_size`` of tensor ``name`` along ``dim`` (torch.chunk split:
    equal parts, the last may be smaller): a zero-copy view of the stored bytes where one
    extent holds the part (a tensor stored whole, or one shard holding it), else a copy
    of only the part's bytes from the shards that meet it. Only the pages of the part
    are ever touched. InvalidInput when rank, world_size or dim are out of range."""
    r, ws = _check_shard_args(collection, name, rank, world_size)
    with db.snapshot(collection, version=version) as snap:
        return _slice(snap, name, r, ws, dim)


def plan_dim(plan: Mapping[str, int | None], name: str) -> int | None:
    """The dim ``plan`` splits ``name`` along (None: replicated): an exact name wins over
    glob patterns; among patterns the first that matches, in the plan's order."""
    if name in plan:
        return plan[name]
    for pattern, dim in plan.items():
        if fnmatch.fnmatchcase(name, pattern):
            return dim
    return None


def shard_state_dict(db: tensordb.Database, collection: str, *, rank: int, world_size: int,
                     plan: Mapping[str, int | None], version: int | None = None
                     ) -> dict[str, torch.Tensor]:
    """Every tensor of a version, each as this rank's zero-copy view.

    ``plan`` maps a tensor name, or a glob pattern (``*.q_proj.weight``), to the dim it
    is split along, or None to replicate it. An exact name wins over patterns; among
    patterns the first that matches, in the plan's order. Tensors the plan does not
    mention are replicated. One snapshot: all views come from the same version.
    """
    r, ws = _check_shard_args(collection, None, rank, world_size)
    if not isinstance(plan, Mapping):
        raise InvalidInput(f"plan must map names or patterns to a dim or None, not "
                           f"{type(plan).__name__}", collection=collection)
    for pattern, dim in plan.items():
        if not isinstance(pattern, str) or not (dim is None or _int(dim, f"plan[{pattern!r}]",
                                                                     collection) is not None):
            raise InvalidInput(f"plan entry {pattern!r}: {dim!r} is not a dim or None",
                               collection=collection)
    out: dict[str, torch.Tensor] = {}
    with db.snapshot(collection, version=version) as snap:
        full = snap.state_dict()
        for name in full:
            dim = plan_dim(plan, name)
            out[name] = full[name] if dim is None else _slice(snap, name, r, ws, dim)
    return out
