"""``TensorDBWriter``: a ``torch.distributed.checkpoint`` storage writer that commits a
checkpoint as one version of a collection, through one group transaction.

Which process runs what (DCP's order; "coordinator" is DCP's, rank 0 by default):

1. every rank: ``set_up_storage_writer``, ``prepare_local_plan`` (nothing to add);
2. the coordinator: ``prepare_global_plan`` picks the group id, reads the head's names
   (one snapshot) to find those the checkpoint no longer holds, and hands the group id,
   the world size, each rank's rank and the deletions (to rank 0) to every rank in its
   plan's ``storage_data``;
3. every rank: ``write_data`` opens ``db.transaction(collection, group=, rank=,
   world_size=)``, puts its write items (chunks of a sharded tensor with
   ``put_shard``, a whole tensor with ``put``, a non-tensor entry as its serialized
   bytes) and leaves the block: that commits the rank's part and blocks until every rank
   has committed (the version is published) or the group aborts (``GroupAborted``). So
   when ``write_data`` returns, the version exists;
4. the coordinator: ``finish`` has nothing left to write (the rows are the metadata).

DCP's planner deduplicates what several ranks hold alike (replicated tensors, plain
tensors and non-tensor entries every rank has): one rank writes each.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

import tensordb
from tensordb.errors import InvalidInput, NotFound

from ._layout import BYTES_PREFIX, FORMAT, FORMAT_KEY, PLANNER_KEY, WORLD_KEY, encode_planner_data

__all__ = ["TensorDBWriter"]

DEFAULT_TIMEOUT = 600.0
#: the group ids this process's ranks have written under (DCP's plan caching would
#: hand a rank an old one again)
_GROUPS_USED: set[str] = set()


@dataclass(frozen=True)
class _RankPlan:
    """What the coordinator tells one rank (``SavePlan.storage_data``; pickled by DCP)."""

    group: str
    rank: int
    world_size: int
    deletes: tuple[str, ...] = ()
    planner_data: str | None = None


class TensorDBWriter(StorageWriter):
    """Save a DCP checkpoint as one version of ``collection``.

    ``dcp.save(state_dict, storage_writer=TensorDBWriter(db, "llama"))`` on every rank
    (each with its own ``db``: ``tensordb.connect`` in each process) commits one version
    that holds exactly the checkpoint: tensors of the head that the state dict does not
    hold are deleted in it. ``message`` and ``tier`` are the commit's (``tier=None``: the
    store's default); ``timeout`` (seconds) is how long the group waits for its slowest
    rank before it aborts and publishes nothing. After the save, ``result`` is the
    ``Commit`` of the new version, on every rank.

    A ``checkpoint_id`` given to ``dcp.save`` names the collection instead. Not
    reentrant: one save at a time per writer.
    """

    def __init__(self, db: tensordb.Database, collection: str, *, message: str | None = None,
                 tier: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        super().__init__()
        if not isinstance(db, tensordb.Database):
            raise InvalidInput(f"TensorDBWriter needs a tensordb.Database, not "
                               f"{type(db).__name__}")
        if not isinstance(collection, str):
            raise InvalidInput(f"a collection name must be a str, not {type(collection).__name__}")
        if (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                or not timeout > 0 or timeout == float("inf")):
            raise InvalidInput(f"timeout must be a positive number of seconds, not {timeout!r}",
                               collection=collection)
        if message is not None and not isinstance(message, str):
            raise InvalidInput(f"message must be a str, not {type(message).__name__}",
                               collection=collection)
        if tier is not None and not isinstance(tier, str):
            raise InvalidInput(f"tier must be a str, not {type(tier).__name__}",
                               collection=collection)
        if tier is not None:
            db.tier(tier)  # an unknown tier: InvalidInput now, not inside the save
        try:  # a bad collection name: InvalidInput now, not inside the save
            db.snapshot(collection).close()
        except NotFound:
            pass
        self.db = db
        self.collection = collection
        self.message = message
        self.tier = tier
        self.timeout = float(timeout)
        self.result: tensordb.Commit | None = None
        self._save_id = uuid.uuid4().hex

    # -- DCP's StorageWriter -------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new save: ``checkpoint_id``, when given, names the collection."""
        if checkpoint_id is not None:
            self.collection = os.fspath(checkpoint_id)
        self._save_id = uuid.uuid4().hex
        self.result = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        # a checkpoint id alone does not say which store: never picked automatically
        return False

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.collection, save_id=self._save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives") is False:
            raise InvalidInput("TensorDBWriter commits one version through a group of all "
                               "ranks: dcp.save(..., use_collectives=False) is not supported",
                               collection=self.collection)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator: the group id, each rank's rank, and the head's names that
        the checkpoint does not hold (rank 0 deletes them)."""
        group = f"dcp-{uuid.uuid4().hex}"
        n = len(plans)
        names = {item.index.fqn for p in plans for item in p.items}
        deletes = tuple(sorted(self._head_names() - names))
        planner_data = encode_planner_data(p.planner_data for p in plans)
        return [dataclasses.replace(
            p, storage_data=_RankPlan(group, r, n, deletes if r == 0 else (),
                                      planner_data if r == 0 else None))
            for r, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """This rank's part of the group commit; returns once the version is published
        (every rank has committed), or raises ``GroupAborted``."""
        sd = plan.storage_data
        if not isinstance(sd, _RankPlan):
            raise InvalidInput("the save plan was not prepared by TensorDBWriter's "
                               "prepare_global_plan", collection=self.collection)
        if sd.group in _GROUPS_USED:
            # DCP's plan caching hands a rank its previous final plan, with the group id
            # of a save that has already run
            raise InvalidInput("this save reuses an earlier save's plan (DCP plan caching, "
                               "enable_plan_caching=True): not supported by TensorDBWriter",
                               collection=self.collection)
        _GROUPS_USED.add(sd.group)
        metadata = {FORMAT_KEY: FORMAT, WORLD_KEY: str(sd.world_size)}
        if sd.planner_data is not None:
            metadata[PLANNER_KEY] = sd.planner_data
        byte_items = sorted(i.index.fqn for i in plan.items if i.type == WriteItemType.BYTE_IO)
        if byte_items:
            metadata[f"{BYTES_PREFIX}{sd.rank}"] = json.dumps(byte_items)
        kwargs: dict[str, Any] = {}
        if self.tier is not None:
            kwargs["tier"] = self.tier
        results: list[WriteResult] = []
        with self.db.transaction(self.collection, group=sd.group, rank=sd.rank,
                                 world_size=sd.world_size, timeout=self.timeout,
                                 message=self.message, metadata=metadata, **kwargs) as tx:
            for item in plan.items:
                results.append(_put(tx, item, planner.resolve_data(item)))
            for name in sd.deletes:
                tx.delete(name)
        self.result = tx.result
        version = tx.result.version if tx.result is not None else None
        results = [dataclasses.replace(r, storage_data=version) for r in results]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing to write: the version is published when ``write_data`` returns, and
        the rows themselves are the checkpoint's metadata."""

    # -- helpers -------------------------------------------------------------------------
    def _head_names(self) -> set[str]:
        try:
            with self.db.snapshot(self.collection) as snap:
                return set(snap)
        except NotFound:
            return set()


def _put(tx: tensordb.Transaction, item: WriteItem, data: Any) -> WriteResult:
    fqn = item.index.fqn
    if item.type == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise InvalidInput(f"the planner resolved the non-tensor entry {fqn!r} to "
                               f"{type(data).__name__}, not io.BytesIO", tensor=fqn)
        buf = data.getbuffer()
        t = (torch.frombuffer(buf, dtype=torch.uint8) if buf.nbytes
             else torch.empty(0, dtype=torch.uint8))
        tx.put(fqn, t)
        return WriteResult(index=item.index, size_in_bytes=buf.nbytes, storage_data=None)
    if not isinstance(data, torch.Tensor) or item.tensor_data is None:
        raise InvalidInput(f"the planner resolved the tensor entry {fqn!r} to "
                           f"{type(data).__name__}, not a torch.Tensor", tensor=fqn)
    t = data.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    chunk = item.tensor_data.chunk
    size = tuple(item.tensor_data.size)
    offsets = tuple(chunk.offsets)
    if tuple(t.shape) != tuple(chunk.sizes):
        raise InvalidInput(f"the chunk of {fqn!r} at {offsets} is {tuple(t.shape)}, its plan "
                           f"says {tuple(chunk.sizes)}", tensor=fqn)
    if tuple(t.shape) == size and not any(offsets):
        tx.put(fqn, t)  # the whole tensor
    elif t.numel():
        tx.put_shard(fqn, t, global_shape=size, offsets=offsets)
    elif not any(offsets) and math.prod(size) == 0:
        # a tensor of no elements: the chunk at its origin (every sharding has one)
        # stands for it whole
        tx.put(fqn, torch.empty(size, dtype=t.dtype))
    # else: an empty chunk (a rank with no rows of an unevenly sharded tensor) holds
    # nothing to store
    return WriteResult(index=item.index, size_in_bytes=t.numel() * t.element_size(),
                       storage_data=None)
