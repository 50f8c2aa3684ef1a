"""How a DCP checkpoint lies in a version: the commit metadata keys both sides share.

A checkpoint saved by ``TensorDBWriter`` is an ordinary version: one row per state-dict
entry, named by its flattened DCP key (``model.layers.0.weight``,
``optim.state.model.layers.0.weight.exp_avg``). A tensor written in chunks by several
ranks is a sharded row (``tx.put_shard``); one written whole is a plain row. A
non-tensor entry (an optimizer's step counter, an RNG state, any picklable object) is
the bytes DCP's planner serialized it to (``torch.save``), stored as a 1-D uint8
tensor; the commit metadata names those entries so that a reader hands them back as
bytes, not as tensors. Nothing else is stored: the reader rebuilds DCP's ``Metadata``
from the rows (each row's dtype and shape, ``snap.shards`` for its chunks).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from tensordb.errors import CorruptData

__all__ = [
    "BYTES_PREFIX",
    "FORMAT",
    "FORMAT_KEY",
    "PLANNER_KEY",
    "WORLD_KEY",
    "bytes_items",
    "decode_planner_data",
    "encode_planner_data",
]

#: the metadata key that marks a version as a DCP checkpoint, and its value
FORMAT_KEY = "dcp.format"
FORMAT = "1"
#: the world size of the save that wrote it
WORLD_KEY = "dcp.world_size"
#: ``dcp.bytes.<rank>``: a JSON list of the non-tensor entries that rank wrote (one key
#: per rank, because the metadata of a group's ranks is merged and a key may carry one
#: value only)
BYTES_PREFIX = "dcp.bytes."
#: the planner's flattening map (flat key -> path in the nested state dict), JSON, so
#: that a load into an empty state dict rebuilds the nesting
PLANNER_KEY = "dcp.planner_data"


def bytes_items(metadata: Mapping[str, str] | None, collection: str,
                version: int) -> set[str]:
    """The names the commit metadata marks as non-tensor entries."""
    out: set[str] = set()
    for key, value in (metadata or {}).items():
        if not key.startswith(BYTES_PREFIX):
            continue
        try:
            names = json.loads(value)
        except ValueError:
            names = None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise CorruptData(f"the commit metadata {key!r} of {collection!r} v{version} is not "
                              f"a JSON list of names: {value[:80]!r}", collection=collection,
                              version=version)
        out.update(names)
    return out


def encode_planner_data(mappings: Iterable[Any]) -> str | None:
    """One JSON object of the ranks' flattening maps (``SavePlan.planner_data``), or None
    when no rank has one (a planner that does not flatten)."""
    merged: dict[str, list[str | int]] = {}
    for m in mappings:
        if not isinstance(m, Mapping):
            continue
        for flat, path in m.items():
            if (isinstance(flat, str) and isinstance(path, tuple | list)
                    and all(isinstance(p, str | int) for p in path)):
                merged[flat] = list(path)
    if not merged:
        return None
    return json.dumps(merged, separators=(",", ":"))


def decode_planner_data(metadata: Mapping[str, str] | None) -> dict[str, tuple[str | int, ...]] | None:
    """The flattening map saved with the checkpoint, or None."""
    raw = (metadata or {}).get(PLANNER_KEY)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    return {k: tuple(v) for k, v in data.items() if isinstance(v, list)}
