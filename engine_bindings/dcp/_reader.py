"""``TensorDBReader``: a ``torch.distributed.checkpoint`` storage reader over one version
of a collection, loading into any sharding (DCP's planner works out the overlaps).

Which process runs what (DCP's order):

0. the constructor opens a snapshot of the version (a lease, held until the load's
   ``read_data`` ends): an unknown collection, version or tag raises ``NotFound`` there;
1. every rank: ``read_metadata`` builds DCP's ``Metadata`` from its rows: each
   tensor's dtype and global shape, and its stored chunks from ``snap.shards`` (a plain
   row is one chunk covering it); the entries the commit metadata marks as non-tensor
   become ``BytesStorageMetadata``. No pickled metadata is stored or read;
2. every rank: ``set_up_storage_reader``, ``prepare_local_plan`` (records the version
   this rank opened);
3. the coordinator: ``prepare_global_plan`` refuses a load whose ranks opened different
   versions (the head moved between them: pass ``version=``);
4. every rank: ``read_data`` reads each read item's region with ``snap.slice`` (only
   the bytes of that region, zero-copy where one stored chunk holds it) and copies it
   into the tensor the planner resolves; non-tensor entries go to ``planner.load_bytes``;
   then it releases the snapshot.

Any collection can be read this way, not only one a ``TensorDBWriter`` saved: a
plain version's tensors are single-chunk entries.
"""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

import tensordb
from tensordb.errors import CommitConflict, CorruptData, InvalidInput

from ._layout import bytes_items, decode_planner_data

__all__ = ["TensorDBReader"]


class TensorDBReader(StorageReader):
    """Load a DCP checkpoint from ``collection``: its head, ``version=N`` or
    ``tag="ckpt-100"`` (not both).

    ``dcp.load(state_dict, storage_reader=TensorDBReader(db, "llama"))`` on every rank
    (each with its own ``db``). The version is resolved, and leased, when the reader is
    made (``NotFound`` for an unknown collection, version or tag); ranks whose readers
    resolved the head to different versions (a commit landed between them) are refused
    with ``CommitConflict``: pin ``version=`` or ``tag=`` for a load while a trainer
    commits. The lease is released when the load has read its data (``close()`` for a
    reader that never loads). A ``checkpoint_id`` given to ``dcp.load`` names the
    collection instead.
    """

    def __init__(self, db: tensordb.Database, collection: str, *, version: int | None = None,
                 tag: str | None = None) -> None:
        super().__init__()
        if not isinstance(db, tensordb.Database):
            raise InvalidInput(f"TensorDBReader needs a tensordb.Database, not "
                               f"{type(db).__name__}")
        if not isinstance(collection, str):
            raise InvalidInput(f"a collection name must be a str, not {type(collection).__name__}")
        if version is not None and tag is not None:
            raise InvalidInput("give a version or a tag, not both", collection=collection)
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise InvalidInput(f"version must be an int, not {type(version).__name__}",
                               collection=collection)
        if tag is not None and not isinstance(tag, str):
            raise InvalidInput(f"tag must be a str, not {type(tag).__name__}",
                               collection=collection)
        self.db = db
        self.collection = collection
        self.version_asked = version
        self.tag = tag
        self._load_id = uuid.uuid4().hex
        # opened now, so that an unknown collection, version or tag is a typed error here
        # (inside dcp.load, DCP would report it as an AssertionError of its own); the
        # lease keeps the version until the load has read it
        self._snap: tensordb.Snapshot | None = db.snapshot(collection, version=version, tag=tag)
        #: the version this reader loads (the head's when it was opened)
        self.version: int = self._snap.version

    # -- DCP's StorageReader -------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new load: ``checkpoint_id``, when given, names the collection."""
        self.close()
        if checkpoint_id is not None:
            self.collection = os.fspath(checkpoint_id)
        self._load_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        # a checkpoint id alone does not say which store: never picked automatically
        return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            # DCP asks again for a rank's own metadata when the first call failed: there
            # is none, and the first call's error is the one to see
            raise NotImplementedError("a tensordb checkpoint has no per-rank metadata")
        if self._snap is None:  # a second load with this reader
            self._snap = self.db.snapshot(self.collection, version=self.version_asked,
                                          tag=self.tag)
            self.version = self._snap.version
        try:
            return self._metadata(self._snap)
        except BaseException:
            self.close()
            raise

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        if self._snap is None:
            raise InvalidInput("read_metadata must come before set_up_storage_reader",
                               collection=self.collection)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return dataclasses.replace(plan, storage_data=self.version)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        versions = sorted({p.storage_data for p in plans if p.storage_data is not None})
        if len(versions) > 1:
            raise CommitConflict(
                f"the ranks of a load of {self.collection!r} opened different versions "
                f"{versions} (a commit landed while they started): pass version= or tag=",
                collection=self.collection, names=[], base=int(versions[0]),
                head=int(versions[-1]))
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        snap = self._snap
        if snap is None:
            raise InvalidInput("read_metadata must come before read_data",
                               collection=self.collection)
        try:
            for req in plan.items:
                fqn = req.storage_index.fqn
                if req.type == LoadItemType.BYTE_IO:
                    raw = snap[fqn]
                    planner.load_bytes(req, io.BytesIO(raw.numpy().tobytes()))
                    continue
                base = req.storage_index.offset or torch.Size([0] * len(req.lengths))
                offsets = tuple(b + s for b, s in zip(base, req.storage_offsets, strict=True))
                dst = planner.resolve_tensor(req).detach()
                if (dst.device.type == "cpu" and dst.is_contiguous()
                        and dst.size() == req.lengths
                        and str(dst.dtype).removeprefix("torch.") == snap.info()[fqn][0]):
                    # straight into the planner's tensor: the region's runs of bytes by
                    # kernel reads, nothing mapped here
                    snap.slice(fqn, offsets=offsets, shape=tuple(req.lengths), out=dst)
                    planner.commit_tensor(req, dst)
                    continue
                src = snap.slice(fqn, offsets=offsets, shape=tuple(req.lengths))
                if dst.size() != src.size():
                    raise InvalidInput(
                        f"the planner's destination for {fqn!r} at {offsets} is "
                        f"{tuple(dst.size())}, the region read is {tuple(src.size())}",
                        collection=self.collection, tensor=fqn, version=snap.version)
                dst.copy_(src)
                planner.commit_tensor(req, dst)
        finally:
            self.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- helpers -------------------------------------------------------------------------
    def close(self) -> None:
        """Release the snapshot this reader holds (``read_data`` does at its end; a
        reader that never loads should be closed). Idempotent."""
        if self._snap is not None:
            snap, self._snap = self._snap, None
            snap.close()

    def _metadata(self, snap: tensordb.Snapshot) -> Metadata:
        commit = snap.commit
        marked = bytes_items(commit.metadata, self.collection, snap.version)
        info = snap.info()
        md: dict[str, STORAGE_TYPES] = {}
        for name, (dtype_name, shape, _nbytes) in info.items():
            if name in marked:
                md[name] = BytesStorageMetadata()
                continue
            dtype = getattr(torch, dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise CorruptData(f"tensor {name!r} of {self.collection!r} v{snap.version} has "
                                  f"the unknown dtype {dtype_name!r}", collection=self.collection,
                                  tensor=name, version=snap.version)
            chunks = [ChunkStorageMetadata(offsets=torch.Size(s.offsets),
                                           sizes=torch.Size(s.shape))
                      for s in snap.shards(name)]
            md[name] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype),
                                             size=torch.Size(shape), chunks=chunks)
        return Metadata(
            state_dict_metadata=md,
            planner_data=decode_planner_data(commit.metadata),
            storage_data={"collection": self.collection, "version": snap.version},
            storage_meta=StorageMeta(checkpoint_id=self.collection, load_id=self._load_id))
