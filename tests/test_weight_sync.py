"""Weight sync: a WeightUpdater applies new versions to a live module, in another
process as a writer commits, never leaving the module (or a reader) with a torn state."""

from __future__ import annotations

import multiprocessing as mp
import threading
from pathlib import Path

import pytest
import torch
from conftest import open_store

import tensordb
from engine_bindings._sync import UpdateReport, WeightUpdater
from tensordb.errors import InvalidInput, NotFound

# forkserver, not fork: see test_processes.py (OpenMP state after fork)
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "tensordb", "conftest"])

LAST = 25  # versions the writer publishes


class Net(torch.nn.Module):
    """Parameters and a buffer, float32 and bfloat16, one of them tied."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.proj = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16).to(torch.bfloat16)
        self.head = torch.nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor, two names
        self.register_buffer("scale", torch.ones(4))


def state_of(version: float) -> dict[str, torch.Tensor]:
    """Every tensor of the module filled with ``version`` (exact in bfloat16 too)."""
    return {n: torch.full_like(t, version) for n, t in Net().state_dict().items()}


def module_versions(module: torch.nn.Module) -> set[float]:
    """The set of values in the module's tensors: one value when it is not torn."""
    return {float(v) for t in module.state_dict().values() for v in t.float().unique()}


def _subscriber(home: str, mode: str, every: bool, out: mp.queues.Queue,
                ready: mp.connection.Connection) -> None:
    db = open_store(Path(home))
    module = Net()
    updater = WeightUpdater(db, "w", module, mode=mode)
    first = updater.apply()
    seen: list[tuple[int, bool, bool, int]] = []
    held: dict[str, object] = {"snap": db.snapshot("w", version=first.version),
                               "version": first.version,
                               "tensors": [t.detach() for t in module.state_dict().values()]}

    def check(report: UpdateReport) -> None:
        untorn = module_versions(module) == {float(report.version)}
        # a reader of the version before still sees that version, whole
        old_snap, old_v = held["snap"], held["version"]
        reader_ok = all(bool((t == old_v).all())
                        for t in old_snap.state_dict().values())  # type: ignore[union-attr]
        if mode == "swap":  # tensors the module held before the swap are not overwritten
            reader_ok = reader_ok and all(bool((t == old_v).all())
                                          for t in held["tensors"])  # type: ignore[union-attr]
        old_snap.close()  # type: ignore[union-attr]
        held.update(snap=db.snapshot("w", version=report.version), version=report.version,
                    tensors=[t.detach() for t in module.state_dict().values()])
        seen.append((report.version, untorn, reader_ok, len(report.changed)))
        if report.version == LAST:
            updater.stop()

    ready.send(first.version)
    updater.follow(timeout=30, every=every, on_update=check)
    out.put(seen)
    updater.close()
    db.close()


@pytest.mark.parametrize("every", [True, False], ids=["every", "latest"])
@pytest.mark.parametrize("mode", ["copy", "swap"])
def test_subscriber_follows_a_writer_untorn(sqlite_db: tensordb.Database, store_home: Path,
                                            mode: str, every: bool) -> None:
    db = sqlite_db
    db.commit("w", state_of(1.0))
    out = CTX.Queue()
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_subscriber, args=(str(store_home), mode, every, out, child))
    proc.start()
    try:
        assert parent.recv() == 1
        for v in range(2, LAST + 1):  # as fast as it can: the subscriber falls behind
            db.commit("w", state_of(float(v)))
        seen = out.get(timeout=60)
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    versions = [s[0] for s in seen]
    if every:
        assert versions == list(range(2, LAST + 1))
    else:  # latest only: strictly increasing, ending at the last
        assert versions == sorted(set(versions)) and versions[-1] == LAST
    assert all(untorn for _, untorn, _, _ in seen), seen
    assert all(reader_ok for _, _, reader_ok, _ in seen), seen
    assert all(n == len(Net().state_dict()) for *_, n in seen)  # every tensor changed


@pytest.mark.parametrize("mode", ["copy", "swap"])
def test_report_counts_one_changed_tensor(sqlite_db: tensordb.Database, mode: str) -> None:
    db = sqlite_db
    base = state_of(1.0)
    db.commit("w", base)
    module = Net()
    tied = module.embed.weight
    updater = WeightUpdater(db, "w", module, mode=mode)
    first = updater.apply()
    assert first.version == 1 and first.previous is None
    assert sorted(first.changed) == sorted(base) and first.unchanged == 0
    assert module_versions(module) == {1.0}

    db.commit("w", {**base, "proj.bias": torch.full((16,), 7.0)})
    report = updater.apply()
    assert report.version == 2 and report.previous == 1
    assert report.changed == ["proj.bias"] and report.unchanged == len(base) - 1
    assert report.bytes_copied == (16 * 4 if mode == "copy" else 0)
    assert report.seconds >= 0
    assert bool((module.proj.bias == 7.0).all()) and bool((module.proj.weight == 1.0).all())
    assert updater.current_version == 2
    assert module.head.weight is module.embed.weight is tied  # ties and objects kept
    assert module.embed.weight.requires_grad

    again = updater.apply()  # the version it has: nothing to do
    assert again.changed == [] and again.bytes_copied == 0 and again.version == 2

    back = updater.apply(1)  # any version, not only forward
    assert back.changed == ["proj.bias"] and bool((module.proj.bias == 1.0).all())
    updater.invalidate()  # e.g. after the caller changed the module itself
    assert updater.current_version is None
    assert len(updater.apply(1).changed) == len(base)
    updater.close()


def test_swap_is_zero_copy_and_leases_the_version_in_use(sqlite_db: tensordb.Database
                                                         ) -> None:
    db = sqlite_db
    for v in (1, 2, 3):
        db.commit("w", state_of(float(v)))
    module = Net()
    updater = WeightUpdater(db, "w", module, mode="swap")
    updater.apply(2)
    shm = str(db.config.shm_dir) + "/"
    spans = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith(shm):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                spans.append((lo, hi))
    for name, t in module.state_dict().items():
        assert any(lo <= t.data_ptr() < hi for lo, hi in spans), name  # a store view
    db.set_retention("w", 1)
    db.gc()
    assert [c.version for c in db.history("w")] == [3, 2]  # 2 is leased by the updater
    updater.apply(3)
    updater.settle()  # the version before is released in the background
    db.gc()
    assert [c.version for c in db.history("w")] == [3]  # the lease on 2 was released
    assert module_versions(module) == {3.0}
    updater.close()


def test_copy_mode_keeps_the_modules_memory(sqlite_db: tensordb.Database) -> None:
    db = sqlite_db
    db.commit("w", state_of(1.0))
    module = Net()
    ptrs = {n: t.data_ptr() for n, t in module.state_dict().items()}
    with WeightUpdater(db, "w", module, mode="copy", bucket_bytes=256) as updater:
        report = updater.apply()
    assert report.bytes_copied == sum(t.nbytes for n, t in state_of(1.0).items()
                                      if n != "head.weight")  # the tie is copied once
    assert {n: t.data_ptr() for n, t in module.state_dict().items()} == ptrs
    assert module_versions(module) == {1.0}


def test_current_skips_what_the_module_already_has(sqlite_db: tensordb.Database) -> None:
    db = sqlite_db
    db.commit("w", state_of(1.0))
    db.commit("w", {**state_of(1.0), "scale": torch.full((4,), 2.0)})
    module = Net()
    module.load_state_dict(state_of(1.0))
    updater = WeightUpdater(db, "w", module, current=1)
    assert updater.current_version == 1
    report = updater.apply()
    assert report.changed == ["scale"] and report.previous == 1


def test_errors_are_typed(sqlite_db: tensordb.Database) -> None:
    db = sqlite_db
    with pytest.raises(NotFound) as nf:
        WeightUpdater(db, "nope", Net()).apply()
    assert nf.value.collection == "nope"
    db.commit("w", state_of(1.0))
    with pytest.raises(NotFound):
        WeightUpdater(db, "w", Net()).apply(9)

    bad = {**state_of(1.0), "proj.weight": torch.ones(8, 16)}
    db.commit("bad", bad)
    module = Net()
    before = {n: t.clone() for n, t in module.state_dict().items()}
    for mode in ("copy", "swap"):
        with pytest.raises(InvalidInput) as info:
            WeightUpdater(db, "bad", module, mode=mode).apply()
        assert info.value.tensor == "proj.weight" and "proj.weight" in str(info.value)
        assert "(8, 16)" in str(info.value)
    after = module.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)  # untouched

    db.commit("extra", {**state_of(1.0), "lm.extra": torch.ones(2)})
    with pytest.raises(InvalidInput) as info:
        WeightUpdater(db, "extra", Net()).apply()
    assert info.value.tensor == "lm.extra"
    report = WeightUpdater(db, "extra", Net(), strict=False).apply()
    assert "lm.extra" not in report.changed

    half = Net().to(torch.float16)
    with pytest.raises(InvalidInput) as info:
        WeightUpdater(db, "w", half, mode="swap").apply()
    assert "use mode='copy'" in str(info.value)
    WeightUpdater(db, "w", half, mode="copy").apply()  # copy converts
    assert module_versions(half) == {1.0}

    with pytest.raises(InvalidInput):
        WeightUpdater(db, "w", Net(), mode="move")
    with pytest.raises(InvalidInput):
        WeightUpdater(db, "w", Net(), bucket_bytes=0)
    with pytest.raises(InvalidInput):
        WeightUpdater(db, "w", object())  # type: ignore[arg-type]


def test_follow_in_a_thread_applies_the_latest(sqlite_db: tensordb.Database) -> None:
    db = sqlite_db
    module = Net()
    updater = WeightUpdater(db, "w", module, mode="swap")
    applied = threading.Event()
    versions: list[int] = []

    def note(report: UpdateReport) -> None:
        versions.append(report.version)
        if report.version == 3:
            applied.set()

    updater.start(on_update=note)  # nothing committed yet: it waits for version 1
    with pytest.raises(InvalidInput):
        updater.start()
    for v in (1, 2, 3):
        db.commit("w", state_of(float(v)))
    assert applied.wait(20)
    updater.stop()
    assert updater.current_version == 3 and versions == sorted(versions)
    assert module_versions(module) == {3.0}
    db.commit("w", state_of(4.0))
    assert updater.follow(timeout=0.2) == 1  # picks up what landed while stopped
    assert updater.current_version == 4
    updater.close()
