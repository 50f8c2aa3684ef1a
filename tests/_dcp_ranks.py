"""One rank of tests/test_dcp.py's job: run as ``python _dcp_ranks.py RANK HOME RUN_DIR``
by four processes at once; each exits 0 when every check of its rank held.

The job, in phases (each a gloo process group of its own, initialised through a
FileStore in RUN_DIR, with a short timeout):

1. 4 ranks save version 1 with ``TensorDBWriter``: FSDP-style dim-0 DTensor shards
   (one uneven, one with an empty shard), TP-style dim-1 shards, a replicated DTensor,
   DTensors on a 2 x 2 mesh (sharded on both dims; sharded on one mesh dim and
   replicated on the other), a plain tensor every rank holds, and non-tensor entries (a step counter, param groups,
   a Python RNG state); rank 0 checks what the store holds; all 4 load it back resharded
   (dim 0 <-> dim 1);
2. ranks 0-1 load version 1 into a 2-rank sharding, and save (and load) a checkpoint
   of one replicated tensor, so one rank's part of the group is empty; rank 2 alone
   loads version 1 into plain tensors;
   rank 3 alone into an empty state dict (DCP rebuilds it from the stored metadata);
3. ranks 0-1 save version 2 (other values, one tensor dropped, one added);
4. ranks 0-2 load the head (version 2) into a 3-rank sharding, and version 1 again.
"""

from __future__ import annotations

import json
import os
import random
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import tensordb
from engine_bindings.dcp import TensorDBReader, TensorDBWriter

COLLECTION = "llama"
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "embed": ((16, 8), torch.float32),
    "proj": ((8, 12), torch.bfloat16),
    "odd": ((10, 3), torch.float32),     # 4 ranks: rows 3, 3, 3, 1
    "tiny": ((3, 5), torch.float32),     # 4 ranks: rows 1, 1, 1, 0 (an empty shard)
    "norm": ((8,), torch.float32),
    "new": ((6, 4), torch.float32),      # only in version 2
    "grid": ((8, 6), torch.float32),     # 2-D mesh: FSDP on dim 0 and TP on dim 1
    "half": ((8, 4), torch.float16),     # 2-D mesh: replicated on one mesh dim
}
V1 = ("embed", "proj", "odd", "tiny", "norm", "grid", "half")
V2 = ("embed", "proj", "tiny", "norm", "new", "grid", "half")


def full(name: str, version: int) -> torch.Tensor:
    """The global value of ``name`` in ``version``: the same in every process."""
    shape, dtype = SHAPES[name]
    n = 1
    for s in shape:
        n *= s
    base = sum(map(ord, name)) % 97
    return (torch.arange(n, dtype=torch.float64).reshape(shape) * 0.25 + base
            + 1000 * version).to(dtype)


def py_rng(version: int) -> Any:
    return random.Random(version).getstate()


def make(version: int, layout: dict[str, Any], mesh: Any | None,
         mesh2d: Any | None = None) -> dict[str, Any]:
    """The state dict a job holds: ``layout[name]`` is a placement (a DTensor over
    ``mesh``), a list of two (over ``mesh2d``), or None for a plain tensor."""
    names = V1 if version == 1 else V2
    model: dict[str, Any] = {}
    for name in names:
        t = full(name, version)
        p = layout.get(name)
        if isinstance(p, list) and mesh2d is not None:
            model[name] = distribute_tensor(t, mesh2d, p)
        else:
            model[name] = _place(t, p, mesh)
    state: dict[str, Any] = {
        "model": model,
        "optim": {"step": 100 * version,
                  "param_groups": [{"lr": 0.001 * version, "betas": (0.9, 0.95)}],
                  "state": {"embed": {"exp_avg": _place(full("embed", version) / 3,
                                                        layout.get("embed"), mesh)}}},
        "plain": torch.full((4, 4), version, dtype=torch.int64),
        "rng": py_rng(version),
    }
    return state


def _place(t: torch.Tensor, p: Any, mesh: Any | None) -> Any:
    if isinstance(p, list):  # a 2-D layout in a job without the 2-D mesh: dim 0
        p = Shard(0)
    return t if p is None or mesh is None else distribute_tensor(t, mesh, [p])


def blank(version: int, layout: dict[str, Any], mesh: Any | None) -> dict[str, Any]:
    """A state dict of the same structure whose tensors hold zeros and whose non-tensor
    entries hold something else: what a load must fill."""
    sd = make(version, layout, mesh)
    _zero(sd)
    sd["optim"]["step"] = -1
    sd["optim"]["param_groups"] = [{"lr": -1.0, "betas": None}]
    sd["rng"] = None
    return sd


def _zero(d: dict[str, Any]) -> None:
    for v in d.values():
        if isinstance(v, dict):
            _zero(v)
        elif isinstance(v, DTensor):
            v.to_local().zero_()
        elif isinstance(v, torch.Tensor):
            v.zero_()


def check(got: dict[str, Any], version: int, where: str) -> None:
    """``got`` holds ``version``'s values (a DTensor's local shard, its part)."""
    want = make(version, {}, None)
    _check_tree(got, want, where)


def _check_tree(got: Any, want: Any, where: str) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (where, sorted(got), sorted(want))
        for k in want:
            _check_tree(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, torch.Tensor):
        if isinstance(got, DTensor):
            got = got.full_tensor()
        assert isinstance(got, torch.Tensor), (where, type(got))
        assert got.dtype == want.dtype and got.shape == want.shape, (where, got.dtype, got.shape)
        assert torch.equal(got, want), (where, got, want)
    else:
        assert got == want, (where, got, want)


def group(run: Path, phase: str, rank: int, world: int) -> Any:
    dist.init_process_group("gloo", init_method=f"file://{run / phase}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    return init_device_mesh("cpu", (world,))


def main(rank: int, home: Path, run: Path) -> None:
    db = tensordb.connect(home=home, data_dir=home / "data")
    fsdp = {"embed": Shard(0), "proj": Shard(1), "odd": Shard(0), "tiny": Shard(0),
            "norm": Replicate(), "new": Shard(0), "grid": [Shard(0), Shard(1)],
            "half": [Replicate(), Shard(0)]}
    flipped = {"embed": Shard(1), "proj": Shard(0), "odd": Shard(1), "tiny": Shard(1),
               "norm": Shard(0), "new": Shard(1), "grid": Shard(1), "half": Replicate()}

    # 1. four ranks save version 1, and load it back resharded
    mesh = group(run, "p1", rank, 4)
    mesh2d = init_device_mesh("cpu", (2, 2))
    writer = TensorDBWriter(db, COLLECTION, message="step 100")
    dcp.save(make(1, fsdp, mesh, mesh2d), storage_writer=writer)
    assert writer.result is not None and writer.result.version == 1, writer.result
    if rank == 0:
        with db.snapshot(COLLECTION) as snap:
            assert snap.version == 1 and snap.commit.message == "step 100"
            # the FSDP chunks were stored as each rank's shard, not gathered
            embed = snap.shards("model.embed")
            assert sorted((s.offsets, s.shape) for s in embed) == [
                ((4 * r, 0), (4, 8)) for r in range(4)], embed
            assert sorted(s.rank for s in embed) == [0, 1, 2, 3], embed
            proj = snap.shards("model.proj")
            assert sorted((s.offsets, s.shape) for s in proj) == [
                ((0, 3 * r), (8, 3)) for r in range(4)], proj
            assert [(s.offsets, s.shape) for s in snap.shards("model.tiny")] != []
            assert torch.equal(snap["model.embed"], full("embed", 1))
            assert torch.equal(snap["model.proj"], full("proj", 1))
            assert torch.equal(snap["model.odd"], full("odd", 1))
            # on the 2-D mesh: a 2 x 2 grid of chunks; replicated over one mesh dim,
            # each of the 2 chunks written once
            assert sorted((s.offsets, s.shape) for s in snap.shards("model.grid")) == [
                ((r, c), (4, 3)) for r in (0, 4) for c in (0, 3)]
            assert sorted(s.offsets for s in snap.shards("model.half")) == [(0, 0), (4, 0)]
            assert torch.equal(snap["model.grid"], full("grid", 1))
            # a replicated DTensor and a plain tensor: one rank wrote each, whole
            assert len(snap.shards("model.norm")) == 1
            assert len(snap.shards("plain")) == 1
            # the non-tensor entries are their serialized bytes, marked as such
            assert snap["optim.step"].dtype == torch.uint8
            marked = {n for k, v in (snap.commit.metadata or {}).items()
                      if k.startswith("dcp.bytes.") for n in json.loads(v)}
            assert marked == {"optim.step", "optim.param_groups.0.lr",
                              "optim.param_groups.0.betas", "rng"}, marked
    dist.barrier()
    got = blank(1, flipped, mesh)
    dcp.load(got, storage_reader=TensorDBReader(db, COLLECTION))
    check(got, 1, "4 ranks, dims flipped")
    dist.destroy_process_group()

    # 2. the same version into 2 ranks, 1 rank, and an empty state dict
    if rank < 2:
        mesh = group(run, "p2", rank, 2)
        got = blank(1, flipped, mesh)
        dcp.load(got, storage_reader=TensorDBReader(db, COLLECTION, version=1))
        check(got, 1, "2 ranks")
        # one entry, replicated: DCP gives it to one rank, the other's part is empty
        writer = TensorDBWriter(db, "small")
        dcp.save({"bias": torch.arange(4.0)}, storage_writer=writer)
        assert writer.result is not None and writer.result.version == 1, writer.result
        small = {"bias": torch.zeros(4)}
        dcp.load(small, storage_reader=TensorDBReader(db, "small"))
        assert torch.equal(small["bias"], torch.arange(4.0)), small
        # 3. two ranks save version 2: a tensor dropped, one added, other values
        writer = TensorDBWriter(db, COLLECTION)
        dcp.save(make(2, fsdp, mesh), storage_writer=writer)
        assert writer.result is not None and writer.result.version == 2, writer.result
        with db.snapshot(COLLECTION) as snap:
            assert snap.version == 2
            assert "model.odd" not in snap and "model.new" in snap, sorted(snap)
            assert sorted(s.offsets for s in snap.shards("model.embed")) == [(0, 0), (8, 0)]
        dist.destroy_process_group()
    elif rank == 2:
        got = blank(1, {}, None)
        dcp.load(got, storage_reader=TensorDBReader(db, COLLECTION, version=1))
        check(got, 1, "1 rank")
    else:
        got = {}  # as torch's dcp_to_torch_save reads a checkpoint into a plain dict
        _load_state_dict(got, storage_reader=TensorDBReader(db, COLLECTION, version=1),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        check(got, 1, "empty state dict")
        db.close()
        return

    # 4. three ranks: the head (version 2), and version 1 again
    mesh = group(run, "p4", rank, 3)
    got = blank(2, fsdp, mesh)
    dcp.load(got, storage_reader=TensorDBReader(db, COLLECTION))
    check(got, 2, "3 ranks, head")
    got = blank(1, flipped, mesh)
    dcp.load(got, storage_reader=TensorDBReader(db, COLLECTION, version=1))
    check(got, 1, "3 ranks, version 1")
    dist.destroy_process_group()
    db.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
    os._exit(0)  # skip interpreter teardown of the gloo threads
