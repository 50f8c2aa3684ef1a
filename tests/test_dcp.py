"""torch.distributed.checkpoint on tensordb (engine_bindings.dcp): real gloo process
groups on this host save and load one collection across world sizes 4, 2, 3 and 1; a
single process saves and loads without a process group; bad inputs are typed errors
that leave the store as it was."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tensordb
from tensordb.errors import CommitConflict, InvalidInput, NotFound

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available in this torch build")

if dist.is_available():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import LoadPlan

    from engine_bindings.dcp import TensorDBReader, TensorDBWriter

RANKS = Path(__file__).with_name("_dcp_ranks.py")
ROOT = Path(__file__).resolve().parents[1]
# without a process group DCP saves and loads in this process, and says so
single_process = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning")


def test_public_surface() -> None:
    import engine_bindings.dcp as mod

    assert mod.__all__ == ["TensorDBReader", "TensorDBWriter"]
    from torch.distributed.checkpoint import StorageReader, StorageWriter

    assert issubclass(TensorDBWriter, StorageWriter)
    assert issubclass(TensorDBReader, StorageReader)


def test_ranks_save_and_load_across_world_sizes(sqlite_db: tensordb.Database,
                                                 store_home: Path, tmp_path: Path) -> None:
    """One launch of 4 processes (see _dcp_ranks.py): 4 ranks save version 1 (dim-0
    and dim-1 DTensor shards, replicated and plain tensors, non-tensor entries) and load
    it back resharded; 2 ranks, 1 rank and an empty state dict load it; 2 ranks save
    version 2; 3 ranks load the head and version 1."""
    run = tmp_path / "run"
    run.mkdir()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                         if p)}
    procs = [subprocess.Popen([sys.executable, str(RANKS), str(r), str(store_home), str(run)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(4)]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
        outs.append((p.returncode, out))
    failed = [f"rank {r} exited {rc}:\n{out[-4000:]}" for r, (rc, out) in enumerate(outs) if rc]
    assert not failed, "\n".join(failed)
    history = sqlite_db.history("llama")
    assert [c.version for c in history] == [2, 1]
    assert history[1].message == "step 100"


@single_process
def test_one_process_saves_versions_and_loads_them(sqlite_db: tensordb.Database) -> None:
    db = sqlite_db
    sd1 = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4, dtype=torch.bfloat16),
           "empty": torch.empty(0, 4), "scalar": torch.tensor(3.5), "step": 7,
           "cfg": {"name": "run-a", "betas": (0.9, 0.95)}}
    writer = TensorDBWriter(db, "m", message="first")
    dcp.save(sd1, storage_writer=writer)
    assert writer.result is not None and writer.result.version == 1
    sd2 = {"w": torch.arange(12.0).reshape(3, 4) + 1, "step": 8}
    dcp.save(sd2, storage_writer=TensorDBWriter(db, "m"))
    with db.snapshot("m") as snap:  # the head is the second checkpoint, nothing more
        assert snap.version == 2 and sorted(snap) == ["step", "w"]

    got1 = {"w": torch.zeros(3, 4), "b": torch.zeros(4, dtype=torch.bfloat16),
            "empty": torch.empty(0, 4), "scalar": torch.tensor(0.0), "step": 0,
            "cfg": {"name": "", "betas": None}}
    dcp.load(got1, storage_reader=TensorDBReader(db, "m", version=1))
    assert torch.equal(got1["w"], sd1["w"]) and torch.equal(got1["b"], sd1["b"])
    assert got1["scalar"].item() == 3.5 and got1["empty"].shape == (0, 4)
    assert got1["step"] == 7 and got1["cfg"] == {"name": "run-a", "betas": (0.9, 0.95)}
    got2 = {"w": torch.zeros(3, 4), "step": 0}
    reader = TensorDBReader(db, "m")
    dcp.load(got2, storage_reader=reader)
    assert reader.version == 2
    assert torch.equal(got2["w"], sd2["w"]) and got2["step"] == 8
    # a tagged version, and the same reader again (it opens its version anew)
    db.tag("m", "ckpt-1", version=1)
    reader = TensorDBReader(db, "m", tag="ckpt-1")
    for _ in range(2):
        got = {"w": torch.zeros(3, 4)}
        dcp.load(got, storage_reader=reader)
        assert torch.equal(got["w"], sd1["w"])


@single_process
def test_plain_version_loads_into_a_dcp_state_dict(sqlite_db: tensordb.Database) -> None:
    """A version committed without DCP (db.commit) is a checkpoint of whole tensors."""
    sqlite_db.commit("plain", {"a": torch.arange(6.0).reshape(2, 3), "c": torch.ones(5)})
    got = {"a": torch.zeros(2, 3)}
    dcp.load(got, storage_reader=TensorDBReader(sqlite_db, "plain"))
    assert torch.equal(got["a"], torch.arange(6.0).reshape(2, 3))


def test_bad_inputs_are_typed_and_change_nothing(sqlite_db: tensordb.Database) -> None:
    db = sqlite_db
    db.commit("m", {"w": torch.ones(2)})
    with pytest.raises(InvalidInput, match="collection"):
        TensorDBWriter(db, "bad//name")
    with pytest.raises(InvalidInput, match="timeout"):
        TensorDBWriter(db, "m", timeout=-1)
    with pytest.raises(InvalidInput, match="timeout"):
        TensorDBWriter(db, "m", timeout=float("nan"))
    with pytest.raises(InvalidInput, match="tier"):
        TensorDBWriter(db, "m", tier="tape")
    with pytest.raises(InvalidInput, match="message"):
        TensorDBWriter(db, "m", message=3)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="Database"):
        TensorDBWriter("not a store", "m")  # type: ignore[arg-type]
    with pytest.raises(NotFound, match="nope"):
        TensorDBReader(db, "nope")
    with pytest.raises(NotFound):
        TensorDBReader(db, "m", version=99)
    with pytest.raises(NotFound):
        TensorDBReader(db, "m", tag="no-such-tag")
    with pytest.raises(InvalidInput, match="not both"):
        TensorDBReader(db, "m", version=1, tag="t")
    with pytest.raises(InvalidInput, match="version"):
        TensorDBReader(db, "m", version="1")  # type: ignore[arg-type]
    # ranks whose readers opened different heads are refused before any byte is read
    reader = TensorDBReader(db, "m")
    with pytest.raises(CommitConflict, match="version="):
        reader.prepare_global_plan([LoadPlan([], storage_data=1), LoadPlan([], storage_data=2)])
    reader.close()
    assert db.collections() == ["m"] and [c.version for c in db.history("m")] == [1]


def _failure(exc: BaseException) -> BaseException:
    """The first rank's exception inside DCP's CheckpointException."""
    assert isinstance(exc, CheckpointException), exc
    return next(iter(exc.failures.values()))[0]


@single_process
def test_a_failing_save_publishes_nothing(sqlite_db: tensordb.Database) -> None:
    db = sqlite_db
    db.commit("m", {"w": torch.ones(2)})

    class Failing(DefaultSavePlanner):
        def resolve_data(self, write_item):  # type: ignore[no-untyped-def]
            if write_item.index.fqn == "b":
                raise RuntimeError("the trainer lost its tensor")
            return super().resolve_data(write_item)

    with pytest.raises(CheckpointException) as info:
        dcp.save({"a": torch.zeros(3), "b": torch.zeros(3)},
                 storage_writer=TensorDBWriter(db, "m"), planner=Failing())
    assert "lost its tensor" in str(_failure(info.value))
    with db.snapshot("m") as snap:
        assert snap.version == 1 and list(snap) == ["w"]


@single_process
def test_dcp_plan_caching_is_refused(sqlite_db: tensordb.Database) -> None:
    """A cached plan carries the group id of the save it was made for."""
    db = sqlite_db
    planner = DefaultSavePlanner(enable_plan_caching=True)
    dcp.save({"a": torch.zeros(3)}, storage_writer=TensorDBWriter(db, "cached"),
             planner=planner)
    with pytest.raises(CheckpointException) as info:
        dcp.save({"a": torch.ones(3)}, storage_writer=TensorDBWriter(db, "cached"),
                 planner=planner)
    err = _failure(info.value)
    assert isinstance(err, InvalidInput) and "plan caching" in str(err)
    assert [c.version for c in db.history("cached")] == [1]
