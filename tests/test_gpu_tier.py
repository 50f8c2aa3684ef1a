"""The GPU tier (CUDA IPC through cuda-python).

Three groups:
* everywhere: the module imports without cuda-python and says why it is unavailable;
* everywhere: the tier's bookkeeping (ownership, shared locks of importers, deferred
  frees, orphans, capacity) against a stand-in CUDA runtime that maps shared-memory files
  where CUDA maps device memory, in one process and across processes;
* ``gpu`` marker, skipped without a CUDA device: the real thing. Process A writes a
  segment, a spawned process B maps it through its IPC handle, and a torch tensor made
  from the view equals what A wrote and lies at the IPC-mapped pointer (no copy).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import multiprocessing as mp
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cuda_standin import FakeRuntime, _Err, install, installed

import storage_engine as se
from storage_engine import _cuda, _gpu
from storage_engine._gpu import IPC_SUFFIX, GpuError, GpuTier, GpuView
from storage_engine.testing import TierTests

CTX = mp.get_context("spawn")  # a child of a CUDA process must not be forked
ROOT = Path(__file__).resolve().parent.parent


# -- without cuda-python -----------------------------------------------------------------
def test_imports_and_is_unavailable_without_cuda_python(tmp_path: Path) -> None:
    code = f"""
import sys
sys.modules["cuda"] = None  # as if cuda-python were not installed
sys.modules["cuda.bindings"] = None
import storage_engine._gpu as g
assert g.GpuTier.available() is False
print(g.GpuTier.unavailable_reason())
tier = g.GpuTier({str(tmp_path / 'gpu')!r})  # constructing touches no CUDA
assert list(tier.segments()) == [] and tier.used_bytes() == 0
assert tier.supports_gpu is True
try:
    tier.create("s", 8)
except g.GpuError as exc:
    print(exc)
else:
    raise SystemExit("create without cuda-python must fail")
tier.close()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "cuda-python is not installed" in lines[0]
    assert "needs cuda-python" in lines[1]


def test_available_here_agrees_with_the_reason() -> None:
    reason = GpuTier.unavailable_reason()
    assert GpuTier.available() is (reason is None)
    if reason is not None:
        assert reason  # a sentence the gpu tests print when they skip


# -- the stand-in runtime (cuda_standin) ---------------------------------------------
@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeRuntime]:
    with installed(tmp_path) as fake:
        yield fake


def _write(tier: GpuTier, data: bytes, sid: str = "s1") -> se.SegmentWriter:
    w = tier.create(sid, len(data))
    w.buffer[:] = np.frombuffer(data, np.uint8)
    w.finish()
    return w


class TestGpuTierBookkeeping(TierTests):
    """The tier contract, and what is the GPU tier's own, on the stand-in runtime."""

    @pytest.fixture(autouse=True)
    def _standin(self, fake: FakeRuntime) -> None:
        """Every test of the class runs on the stand-in (``make`` included)."""

    def make(self, root: Path, capacity: int | None = None) -> se.Tier:
        return GpuTier(root, capacity=capacity)

    def stored_bytes(self, tier: se.Tier, segment_id: str) -> bytes:
        # the stand-in's "device memory" is host memory: read it at the owner's pointer
        assert isinstance(tier, GpuTier)
        rec = _gpu._owned[str(tier.path(segment_id))]
        return ctypes.string_at(rec.ptr, rec.nbytes)

    def test_roundtrip_in_the_owner(self, tier: GpuTier, fake: FakeRuntime) -> None:
        _write(tier, b"abcdefgh" * 100).release()
        view = tier.open("s1")
        assert isinstance(view, GpuView) and len(view) == 800
        assert view.ptr in fake.allocs and not fake.imports  # the owner maps nothing
        assert bytes(view.to_host(0, 8)) == b"abcdefgh" and view.to_host().nbytes == 800
        cai = view.__cuda_array_interface__
        assert cai["shape"] == (800,) and cai["typestr"] == "|u1"
        assert cai["data"] == (view.ptr, False) and cai["version"] == 3
        assert list(tier.segments()) == ["s1"] and tier.used_bytes() == 800
        assert tier.supports_gpu and not tier.persistent

    def test_ipc_file_is_private_and_names_its_owner(self, tier: GpuTier) -> None:
        _write(tier, b"z" * 64).release()
        assert stat.S_IMODE(os.stat(tier.root).st_mode) == 0o700
        path = tier.root / f"s1{IPC_SUFFIX}"
        assert os.listdir(tier.root) == [path.name]
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        meta = json.loads(path.read_bytes())
        assert meta["owner"] == se.current_holder() and meta["nbytes"] == 64
        assert len(bytes.fromhex(meta["handle"])) == 64

    def test_writer_can_fill_the_device_directly(self, tier: GpuTier) -> None:
        w = tier.create("d", 16)
        ctypes.memmove(w.device_view().ptr, b"0123456789abcdef", 16)
        w.finish()  # nothing staged: no host copy over what was written
        w.release()
        assert bytes(tier.open("d").to_host()) == b"0123456789abcdef"

    def test_delete_waits_for_local_views(self, tier: GpuTier, fake: FakeRuntime) -> None:
        _write(tier, b"y" * 128).release()
        view = tier.open("s1")
        assert tier.delete("s1") is True
        assert fake.freed == []  # a view of it lives
        assert bytes(view.to_host(0, 4)) == b"yyyy"
        with pytest.raises(se.SegmentMissing):
            tier.open("s1")
        assert tier.delete("s1") is False
        del view
        gc.collect()
        assert tier.sweep() == 1 and len(fake.freed) == 1 and not fake.allocs

    def test_abort_frees(self, tier: GpuTier, fake: FakeRuntime) -> None:
        w = tier.create("s1", 64)
        w.abort()
        w.abort()  # idempotent
        assert list(tier.segments()) == [] and len(fake.freed) == 1

    def test_orphans(self, tier: GpuTier, fake: FakeRuntime) -> None:
        live = tier.create("live", 64)  # being written: never an orphan
        _write(tier, b"r" * 64, "registered").release()
        _write(tier, b"o" * 64, "orphan").release()  # released, never registered
        got = tier.reclaim_orphans(lambda s: s == "registered")
        assert got == ["orphan"]
        assert sorted(tier.segments()) == ["live", "registered"] and len(fake.freed) == 1
        live.release()

    def test_capacity_and_device_memory_exhaustion(self, tmp_path: Path,
                                                   fake: FakeRuntime) -> None:
        tier = GpuTier(tmp_path / "cap", capacity=100)
        tier.create("a", 80).release()
        with pytest.raises(se.TierFull):
            tier.create("b", 40)
        fake.limit = 100
        with pytest.raises(se.TierFull):
            GpuTier(tmp_path / "other").create("c", 40)

    def test_zero_bytes_and_missing(self, tier: GpuTier) -> None:
        with pytest.raises(ValueError):
            tier.create("s1", 0)
        with pytest.raises(se.SegmentMissing) as info:
            tier.open("nope")
        assert "nope" in str(info.value)
        _write(tier, b"q" * 8).release()
        with pytest.raises(ValueError):
            tier.open("s1").to_host(4, 8)

    def test_runtime_errors_name_the_call(self, tier: GpuTier, fake: FakeRuntime) -> None:
        fake.cudaMemcpy = lambda *a: (_Err.cudaErrorInvalidValue,)  # type: ignore[method-assign]
        w = tier.create("s1", 8)
        w.buffer[:] = 1
        with pytest.raises(GpuError, match="cudaMemcpy failed: cudaErrorInvalidValue"):
            w.finish()
        w.abort()


# -- across processes, with the stand-in runtime ------------------------------------------
def _importer(root: str, fake_root: str, sid: str, conn: mp.connection.Connection) -> None:
    install(Path(fake_root))
    tier = GpuTier(root)
    view = tier.open(sid)
    again = tier.open(sid)  # one mapping per process: CUDA opens a handle only once
    fake: FakeRuntime = _cuda._rt
    conn.send((view.ptr == again.ptr, view.ptr in fake.imports, bytes(view.to_host())))
    assert conn.recv() == "deleted"
    conn.send(bytes(view.to_host()))  # still mapped after the owner's delete
    del view, again
    gc.collect()
    conn.send(list(fake.closed))
    with contextlib.suppress(se.SegmentMissing):
        tier.open(sid)
        conn.send("opened a deleted segment")
    conn.send("missing")


def _owner_that_exits(root: str, fake_root: str, conn: mp.connection.Connection) -> None:
    install(Path(fake_root))
    tier = GpuTier(root)
    w = tier.create("dead", 32)
    w.finish()
    w.release()
    conn.send("written")


def test_another_process_maps_and_holds_a_deleted_segment(tmp_path: Path,
                                                          fake: FakeRuntime) -> None:
    tier = GpuTier(tmp_path / "gpu")
    _write(tier, b"IPC!" * 64).release()
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_importer,
                       args=(str(tier.root), str(fake.root.parent), "s1", child))
    proc.start()
    try:
        same, imported, data = parent.recv()
        assert same and imported and data == b"IPC!" * 64
        assert tier.delete("s1") is True
        assert tier.sweep() == 0 and fake.freed == []  # the other process maps it
        parent.send("deleted")
        assert parent.recv() == b"IPC!" * 64
        assert len(parent.recv()) == 1  # its mapping closed once, with its last view
        assert parent.recv() == "missing"
        proc.join(30)
        assert proc.exitcode == 0
        assert tier.sweep() == 1 and len(fake.freed) == 1
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def test_segments_of_an_owner_that_exited(tmp_path: Path, fake: FakeRuntime) -> None:
    tier = GpuTier(tmp_path / "gpu")
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_owner_that_exits,
                       args=(str(tier.root), str(fake.root.parent), child))
    proc.start()
    assert parent.recv() == "written"
    proc.join(30)
    assert proc.exitcode == 0
    assert list(tier.segments()) == [] and tier.used_bytes() == 0  # its memory is gone
    with pytest.raises(se.SegmentMissing):
        tier.open("dead")
    assert tier.reclaim_orphans(lambda s: True) == []  # registered: the catalog decides
    assert tier.reclaim_orphans(lambda s: False) == ["dead"]
    assert os.listdir(tier.root) == []


# -- on a CUDA device ----------------------------------------------------------------------
gpu = pytest.mark.skipif(not GpuTier.available(),
                         reason=f"GPU tier unavailable: {GpuTier.unavailable_reason()}")


def _gpu_reader(root: str, sid: str, conn: mp.connection.Connection) -> None:
    tier = GpuTier(root)
    view = tier.open(sid)
    res: dict[str, Any] = {"ptr": view.ptr, "device": view.device,
                           "host": bytes(view.to_host())}
    try:
        import torch
        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if cuda:
        t = torch.as_tensor(view, device=f"cuda:{view.device}")
        res.update(torch_ptr=t.data_ptr(), torch_bytes=bytes(t.cpu().numpy()),
                   torch_device=str(t.device), torch_dtype=str(t.dtype))
        del t
    conn.send(res)
    assert conn.recv() == "deleted"
    conn.send(bytes(view.to_host(0, 16)))  # still valid after the owner's delete
    del view
    gc.collect()
    conn.send("released")


@pytest.mark.gpu
@gpu
def test_process_b_maps_process_a_segment_without_a_copy(tmp_path: Path) -> None:
    tier = GpuTier(tmp_path / "gpu", device=0)
    data = np.random.default_rng(7).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    w = tier.create("s1", len(data))
    w.buffer[:] = np.frombuffer(data, np.uint8)
    w.finish()
    w.release()
    own = tier.open("s1")
    assert bytes(own.to_host(0, 64)) == data[:64]
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_gpu_reader, args=(str(tier.root), "s1", child))
    proc.start()
    try:
        res = parent.recv()
        assert res["host"] == data
        if "torch_ptr" in res:
            assert res["torch_ptr"] == res["ptr"]  # the tensor is the IPC mapping itself
            assert res["torch_bytes"] == data and res["torch_dtype"] == "torch.uint8"
            assert res["torch_device"].startswith("cuda")
        assert tier.delete("s1") is True
        del own
        gc.collect()
        assert tier.sweep() == 0  # process B still maps it
        parent.send("deleted")
        assert parent.recv() == data[:16]
        assert parent.recv() == "released"
        proc.join(60)
        assert proc.exitcode == 0
        assert tier.sweep() == 1
        assert tier.used_bytes() == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)


@pytest.mark.gpu
@gpu
def test_device_tensors_copied_straight_in(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA")
    tier = GpuTier(tmp_path / "gpu", device=0)
    src = torch.arange(4096, dtype=torch.float32, device="cuda:0")
    w = tier.create("d", src.nbytes)
    dst = torch.as_tensor(w.device_view(), device="cuda:0")
    dst.copy_(src.view(torch.uint8))
    torch.cuda.synchronize()
    w.finish()
    w.release()
    view = tier.open("d")
    got = torch.as_tensor(view, device="cuda:0").view(torch.float32)
    assert got.data_ptr() == view.ptr and torch.equal(got, src)
    del got, dst, view
    gc.collect()
    assert tier.delete("d") and tier.sweep() == 1
