"""The file tiers against the contract every tier obeys (``storage_engine.testing``), and
what is specific to each; the GPU tier runs the same suite in test_gpu_tier.py."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

import storage_engine as se
from storage_engine.testing import TierTests


class TestHostTier(TierTests):
    def make(self, root: Path, capacity: int | None = None) -> se.Tier:
        return se.HostTier(root, capacity=capacity)

    def test_capabilities(self, tier: se.Tier) -> None:
        assert tier.file_backed and not tier.persistent and not tier.supports_gpu
        assert isinstance(tier, se.Prefaulting)

    def test_spare_is_used_and_renamed(self, tmp_path: Path) -> None:
        tier = se.HostTier(tmp_path / "spare", spare_bytes=1 << 20)
        tier.prefault(1 << 20)
        spares = [n for n in os.listdir(tier.root) if n.startswith("spare-")]
        assert len(spares) == 1
        w = self.write_segment(tier, b"q" * 1000, "fromspare")
        w.release()
        assert os.path.getsize(tier.path("fromspare")) == 1000  # trimmed to the segment
        assert bytes(tier.open("fromspare")[:3]) == b"qqq"
        tier.close()
        assert not [n for n in os.listdir(tier.root) if n.startswith("spare-")]

    def test_a_commit_right_after_another_waits_for_the_refill(self, tmp_path: Path) -> None:
        # back-to-back segments of the spare's size: the second takes the refilled spare
        # instead of faulting a fresh file in beside the refill
        tier = se.HostTier(tmp_path / "again", spare_bytes=8 << 20)
        tier.prefault(8 << 20)
        cold: list[int] = []
        new_file = tier._new_file

        def counting(path, nbytes, *, how="direct"):  # type: ignore[no-untyped-def]
            if how != "lazy":  # a segment's fresh file, not the refill's spare
                cold.append(nbytes)
            return new_file(path, nbytes, how=how)

        tier._new_file = counting  # type: ignore[method-assign]
        for i in range(3):
            w = self.write_segment(tier, bytes([i]) * (6 << 20), f"seg{i}")
            w.release()  # starts the refill; the next create comes at once
        assert cold == []
        small = self.write_segment(tier, b"s" * 100, "small")  # far smaller: does not wait
        small.release()
        assert [bytes(tier.open(f"seg{i}")[:1]) for i in range(3)] == [b"\0", b"\1", b"\2"]
        tier.close()

    def test_close_stops_a_refill_that_is_still_faulting(self, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
        # the refill faults its spare piece by piece and looks at the tier between
        # pieces: once the tier is closed it stops and removes the file, instead of
        # faulting the rest of a spare that close() would only drop
        from storage_engine import _files

        monkeypatch.setattr(_files, "_FAULT_PIECE", 1 << 20)
        tier = se.HostTier(tmp_path / "stop")
        walked: list[int] = []
        real_set = tier._closing.is_set

        def is_set() -> bool:  # the tier is closed while the third piece is due
            walked.append(1)
            if len(walked) == 3:
                tier._closing.set()
            return real_set()

        monkeypatch.setattr(tier._closing, "is_set", is_set)
        tier._make_spare(8 << 20)
        assert len(walked) == 3  # stopped at the third of eight pieces
        assert tier.spare_ready() == 0
        assert not [n for n in os.listdir(tier.root) if n.startswith("spare-")]
        tier.close()
        # and a refill started by a tier with spare_bytes leaves nothing after close()
        busy = se.HostTier(tmp_path / "busy", spare_bytes=64 << 20)
        busy.close()
        assert busy.spare_ready() == 0
        assert not [n for n in os.listdir(busy.root) if n.startswith("spare-")]

    @pytest.mark.deadline
    def test_spare_ready_says_what_the_next_segment_can_take(self, tmp_path: Path) -> None:
        tier = se.HostTier(tmp_path / "ready")
        assert tier.spare_ready() == 0
        tier.prefault(2 << 20)  # waits for it
        assert tier.spare_ready() == 2 << 20
        w = self.write_segment(tier, b"r" * 4096, "taken")
        assert tier.spare_ready() == 0  # the segment took it
        w.release()  # a tier with spare_bytes refills in the background after a release
        deadline = time.monotonic() + 30
        while tier.spare_ready() < 2 << 20:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        tier.close()
        assert tier.spare_ready() == 0


class TestDiskTier(TierTests):
    def make(self, root: Path, capacity: int | None = None) -> se.Tier:
        return se.DiskTier(root, capacity=capacity)

    def test_persistent(self, tier: se.Tier) -> None:
        assert tier.persistent
        assert tier.file_backed and not tier.supports_gpu
        assert not isinstance(tier, se.Prefaulting)


def test_pack_aligns() -> None:
    offsets, total = se.pack([1, 64, 0, 65])
    assert offsets == [0, 64, 128, 128] and total == 256
    assert all(o % se.ALIGN == 0 for o in offsets)


def test_fill_segment_parallel_checksums(tmp_path: Path) -> None:
    tier = se.HostTier(tmp_path / "fill")
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 255, n, dtype=np.uint8) for n in (5 << 20, 3 << 20, 17, 1 << 20)]
    sizes = [a.size for a in arrays]
    offsets, total = se.pack(sizes)
    w = tier.create("f", total)
    sums = se.fill_segment(w, arrays, offsets, sizes)
    w.finish()
    w.release()
    mm = tier.open("f")
    for a, o, s in zip(arrays, offsets, sums, strict=True):
        got = np.frombuffer(mm, np.uint8, count=a.size, offset=o)
        assert np.array_equal(got, a) and s == se.checksum(a)
    tier.close()


@pytest.mark.parametrize("path", ["one-pass", "streamed", "numpy"])
def test_copy_and_checksum_every_size_and_alignment(path: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-pass copy + hash of the extension, the hash-then-stream path (an xxhash
    build that does not export its XXH3 functions) and the numpy path (buffers the
    extension cannot stream: strided, read-only) store the same bytes and the same
    checksum as xxhash, at every length around the streaming threshold and the piece
    sizes, from and to unaligned addresses, and write nothing outside the
    destination."""
    from storage_engine import _checksum

    if path == "one-pass" and not _checksum.ONE_PASS:
        pytest.skip("the xxhash package here does not export its XXH3 functions")
    if path != "one-pass":
        monkeypatch.setattr(_checksum, "_copy_hash", None)
    if path == "numpy":
        monkeypatch.setattr(_checksum, "_streamable", lambda dst, src: False)
    rng = np.random.default_rng(1)
    src_all = rng.integers(0, 256, (5 << 20) + 200, dtype=np.uint8)
    for n in (0, 1, 63, 64, 127, 128, 4095, 4097, (64 << 10) - 1, 64 << 10,
              (64 << 10) + 65, (2 << 20) + 7, (4 << 20) + 100):
        for so, do in ((0, 0), (3, 0), (0, 5), (7, 61)):
            src = src_all[so : so + n]
            dst_all = np.zeros(n + 128, np.uint8)
            dst = dst_all[do : do + n]
            assert _checksum.copy_and_checksum(dst, src) == se.checksum(src)
            assert np.array_equal(dst, src)
            assert not dst_all[:do].any() and not dst_all[do + n :].any()  # no overrun
            dst[:] = 0
            se.copy(dst, src)
            assert np.array_equal(dst, src)
            assert not dst_all[:do].any() and not dst_all[do + n :].any()
    # a strided view is copied right (through numpy: the extension takes contiguous bytes)
    a = np.zeros(1 << 20, np.uint8)
    se.copy(a[::2], src_all[: 1 << 19])
    assert np.array_equal(a[::2], src_all[: 1 << 19]) and not a[1::2].any()


def test_without_the_extension_the_import_says_how_to_build_it() -> None:
    """A package whose extension is missing (never built, or built for another Python)
    does not import: the ImportError names the extension and the rebuild."""
    import subprocess
    import sys

    code = ("import sys\nsys.modules['storage_engine._stream'] = None\n"
            "try:\n    import storage_engine\nexcept ImportError as exc:\n"
            "    print(exc)\nelse:\n    print('imported')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parent.parent).stdout
    assert "storage_engine._stream" in out and "pip install -e ." in out, out


def test_the_extension_is_built_and_checks_its_buffers() -> None:
    """The extension is required (``import storage_engine`` fails without it, naming the
    fix); its copies refuse buffers of other lengths and read-only destinations."""
    assert se.STREAMING
    from storage_engine import _stream

    with pytest.raises(ValueError, match="dst holds 5 bytes, src 4"):
        _stream.stream_copy(bytearray(5), b"abcd")
    with pytest.raises(TypeError):
        _stream.stream_copy(b"read-only", b"read-only")
    with pytest.raises(ValueError, match="dst holds 3 bytes, src 4"):
        _stream.stream_copy_hash(bytearray(3), b"abcd")


def test_holder_liveness() -> None:
    me = se.current_holder()
    assert se.holder_alive(me) is True
    boot, pid, ticks = me.rsplit(":", 2)
    assert se.holder_alive(f"{boot}:{pid}:{int(ticks) + 1}") is False
    assert se.holder_alive(f"another-host:{pid}:{ticks}") is None
    assert se.holder_alive("garbage") is False


def test_full_tmpfs_raises_tier_full_not_sigbus(tmp_path: Path) -> None:
    import subprocess

    mnt = tmp_path / "tiny"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                         capture_output=True)
    if res.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        tier = se.HostTier(mnt / "host")
        with pytest.raises(se.TierFull):
            tier.create("big", 8 << 20)
        assert list(tier.segments()) == []
        w = tier.create("fits", 1 << 20)  # the failed attempt left nothing behind
        w.buffer[:] = 7
        w.finish()
        w.release()
        tier.close()
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
