"""Group commits from real processes: the ranks of a gloo process group each write their
shards of one version (FSDP-style dim-0 and TP-style dim-1 shards), and a rank killed
mid-group leaves no version and, after gc, no bytes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import open_store

import tensordb
from tensordb.errors import GroupAborted

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover - torch builds without distributed
    pytest.skip("this torch has no torch.distributed", allow_module_level=True)

# forkserver, not fork: a child forked from a process whose OpenMP pool has run can
# deadlock in its first parallel op (see test_processes)
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "tensordb", "conftest"])


def _globals() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"fsdp.weight": torch.randn(10, 6, generator=g),    # split along dim 0
            "tp.weight": torch.randn(4, 9, generator=g).to(torch.bfloat16),  # along dim 1
            "norm": torch.randn(6, generator=g)}                # replicated: rank 0 puts it


def _part(t: torch.Tensor, dim: int, rank: int, world: int) -> tuple[torch.Tensor, list[int]]:
    step = -(-t.shape[dim] // world)
    start = min(rank * step, t.shape[dim])
    length = max(0, min(step, t.shape[dim] - start))
    offsets = [0] * t.dim()
    offsets[dim] = start
    return t.narrow(dim, start, length), offsets


def _rank_main(home: str, init: str, rank: int, world: int, kill: bool,
               out: Any) -> None:
    """One trainer rank: join the process group, put this rank's shards in the group
    transaction, report what the block returned."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        x = torch.ones(1) * rank
        dist.all_reduce(x)  # the group is real: every rank took part
        db = open_store(Path(home))
        full = _globals()
        try:
            with db.transaction("llama", group="step-100", rank=rank, world_size=world,
                                timeout=60, message="step 100") as tx:
                for name, dim in (("fsdp.weight", 0), ("tp.weight", 1)):
                    local, offsets = _part(full[name], dim, rank, world)
                    tx.put_shard(name, local, global_shape=full[name].shape, offsets=offsets)
                if rank == 0:
                    tx.put("norm", full["norm"])
                if kill:
                    os.kill(os.getpid(), signal.SIGKILL)  # dies inside its block
            out.put((rank, "ok", tx.result.version if tx.result else None, x.item()))
        except GroupAborted as exc:
            out.put((rank, "aborted", exc.reason, x.item()))
        finally:
            db.close()
    finally:
        if not kill:
            dist.destroy_process_group()


def _run(home: Path, tmp: Path, world: int, kill_rank: int | None = None
         ) -> dict[int, tuple[Any, ...]]:
    out = CTX.Queue()
    init = f"file://{tmp / 'pg-store'}"
    procs = [CTX.Process(target=_rank_main,
                         args=(str(home), init, r, world, r == kill_rank, out))
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, tuple[Any, ...]] = {}
    expected = world - (kill_rank is not None)
    for _ in range(expected):
        item = out.get(timeout=120)
        got[item[0]] = item[1:]
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
    return got


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_of_a_process_group_commit_one_version(sqlite_db: tensordb.Database,
                                                     store_home: Path, tmp_path: Path,
                                                     world: int) -> None:
    got = _run(store_home, tmp_path, world)
    total = sum(range(world))
    assert got == {r: ("ok", 1, float(total)) for r in range(world)}
    full = _globals()
    with sqlite_db.snapshot("llama") as snap:
        assert snap.commit.message == "step 100"
        assert sorted(snap) == sorted(full)
        for name, t in full.items():
            assert torch.equal(snap[name], t), name
        assert [s.rank for s in snap.shards("fsdp.weight")] == list(range(world))
        for readers in (1, 2, 3):  # an engine of any width reads its own slices
            for name, dim in (("fsdp.weight", 0), ("tp.weight", 1), ("fsdp.weight", 1)):
                parts = [snap.slice(name, rank=r, world_size=readers, dim=dim)
                         for r in range(readers)]
                assert torch.equal(torch.cat(parts, dim), full[name])
    assert sqlite_db.verify() == []


def test_a_rank_killed_mid_group_publishes_nothing(sqlite_db: tensordb.Database,
                                                   store_home: Path, tmp_path: Path) -> None:
    got = _run(store_home, tmp_path, 3, kill_rank=1)
    assert set(got) == {0, 2}
    for state, reason, _ in got.values():
        assert state == "aborted" and "rank 1 died" in reason
    assert sqlite_db.collections() == []
    sqlite_db.gc()
    stats = sqlite_db.stats()
    assert stats["segments"] == 0 and stats["host_bytes"] == 0  # no orphan bytes
