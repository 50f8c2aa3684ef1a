"""The contract every tier passes, as a pytest suite a tier's tests subclass (zarr's
``StoreTests``): a new tier passes the same tests as the old ones.

    from storage_engine.testing import TierTests

    class TestMyTier(TierTests):
        def make(self, root, capacity=None):
            return MyTier(root, capacity=capacity)

``make`` is the one hook a subclass must give. The others have defaults and may be
overridden: ``stored_bytes`` reads a segment's bytes without going through the tier
under test (the default reads ``tier.path(segment_id)`` of a ``file_backed`` tier),
``write_segment`` writes one through it. Tests that need a capability the tier lacks
(``supports_gpu``, ``persistent``, ``file_backed``) skip, saying which. The package never
imports this module; it is the only one that imports pytest.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ._errors import SegmentMissing, TierFull
from ._tier import Pooling, SegmentView, SegmentWriter, Tier, arrow_buffer

__all__ = ["TierTests"]


class TierTests:
    """The contract of ``Tier``; subclass it and give ``make``."""

    # -- hooks ------------------------------------------------------------------------
    def make(self, root: Path, capacity: int | None = None) -> Tier:
        """A new tier under ``root`` (which may not exist yet), of ``capacity`` bytes."""
        raise NotImplementedError(f"{type(self).__name__} must give make(root, capacity)")

    def stored_bytes(self, tier: Tier, segment_id: str) -> bytes:
        """The bytes of a segment as the medium holds them, read without the tier's
        ``open``: for a ``file_backed`` tier, its file."""
        path = getattr(tier, "path", None)
        if not tier.file_backed or path is None:
            raise pytest.skip.Exception(f"{type(tier).__name__} is not file-backed: give "
                                        f"stored_bytes")
        return Path(path(segment_id)).read_bytes()

    def write_segment(self, tier: Tier, data: bytes, segment_id: str = "s1"
                      ) -> SegmentWriter:
        """Write ``data`` as a segment through ``w.buffer`` and ``finish`` it (not
        released: the caller decides)."""
        w = tier.create(segment_id, len(data))
        w.buffer[:] = np.frombuffer(data, np.uint8)
        w.finish()
        return w

    @pytest.fixture
    def tier(self, tmp_path: Path) -> Iterator[Tier]:
        t = self.make(tmp_path / "tier")
        yield t
        t.close()

    # -- the contract -----------------------------------------------------------------
    def test_roundtrip(self, tier: Tier) -> None:
        self.write_segment(tier, b"abcdefgh" * 100).release()
        view = tier.open("s1")
        assert isinstance(view, SegmentView)
        assert bytes(view.host_bytes(0, 8)) == b"abcdefgh" and len(view) == 800
        assert bytes(view.host_bytes()) == b"abcdefgh" * 100
        assert list(tier.segments()) == ["s1"]

    def test_views_live_where_the_tier_says(self, tier: Tier) -> None:
        self.write_segment(tier, b"d" * 256).release()
        view = tier.open("s1")
        assert view.on_device is tier.supports_gpu
        assert (view.device is not None) == view.on_device

    def test_finish_puts_the_bytes_on_the_medium(self, tier: Tier) -> None:
        data = bytes(range(256)) * 16
        w = self.write_segment(tier, data)
        assert self.stored_bytes(tier, "s1")[: len(data)] == data
        w.release()

    def test_reader_writes_stay_private(self, tier: Tier) -> None:
        if tier.supports_gpu:
            pytest.skip("views of device memory are shared, read-only by convention")
        self.write_segment(tier, b"x" * 4096).release()
        mine = tier.open("s1").host_bytes()
        mine[0:4] = np.frombuffer(b"MINE", np.uint8)  # copy-on-write: stays in ours
        assert bytes(tier.open("s1").host_bytes(0, 4)) == b"xxxx"
        assert self.stored_bytes(tier, "s1")[:4] == b"xxxx"

    def test_mapping_survives_delete(self, tier: Tier) -> None:
        self.write_segment(tier, b"y" * 8192).release()
        view = tier.open("s1")
        assert tier.delete("s1") is True
        assert bytes(view.host_bytes(100, 4)) == b"yyyy"
        with pytest.raises(SegmentMissing):
            tier.open("s1")
        assert tier.delete("s1") is False

    def test_arrow_buffer_is_the_mapping_on_the_host(self, tier: Tier) -> None:
        self.write_segment(tier, bytes(range(256)) * 40).release()
        view = tier.open("s1")
        buf = arrow_buffer(view, 256, 512)
        assert buf.size == 512 and buf.to_pybytes() == bytes(range(256)) * 2
        if not view.on_device:  # over the mapping itself, not a copy of it
            assert buf.address == view.host_bytes(256, 512).ctypes.data
        del view
        assert tier.delete("s1") is True
        assert buf.to_pybytes()[:4] == bytes(range(4))  # the buffer holds its mapping

    def test_missing_segment(self, tier: Tier) -> None:
        with pytest.raises(SegmentMissing) as info:
            tier.open("nope")
        assert "nope" in str(info.value)

    def test_files_are_private(self, tier: Tier) -> None:
        root = getattr(tier, "root", None)
        if root is None:
            raise pytest.skip.Exception(f"{type(tier).__name__} keeps no files (no root)")
        self.write_segment(tier, b"z" * 64).release()
        self.write_segment(tier, b"z" * 64, "s2").release()
        tier.delete("s2")  # a tier with a pool keeps the file in a folder of its own
        root = Path(root)
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
        for folder, dirs, files in os.walk(root):
            for d in dirs:
                assert stat.S_IMODE(os.stat(Path(folder) / d).st_mode) == 0o700
            for name in files:
                assert stat.S_IMODE(os.stat(Path(folder) / name).st_mode) == 0o600

    def test_a_deleted_segment_keeps_its_bytes_under_later_writes(self, tier: Tier) -> None:
        # a reader's view must not see the bytes of segments written after the delete,
        # even where the tier reuses freed storage for them
        self.write_segment(tier, b"k" * 65536, "held").release()
        view = tier.open("held")
        assert tier.delete("held") is True
        for i in range(3):
            self.write_segment(tier, bytes([i]) * 65536, f"after{i}").release()
        assert bytes(view.host_bytes(0, 4)) == b"kkkk"
        assert bytes(view.host_bytes(65532, 4)) == b"kkkk"

    def test_pool_reuses_freed_segments_and_gives_them_back(self, tier: Tier) -> None:
        if not isinstance(tier, Pooling) or tier.pool_limit <= 0:
            pytest.skip(f"the {tier.name} tier keeps no pool of freed segments (optional)")
        self.write_segment(tier, b"p" * 65536, "first").release()
        assert tier.delete("first") is True  # nobody maps it: pooled
        assert tier.pooled_bytes() >= 65536
        before = tier.pool_counters()["claimed"]
        self.write_segment(tier, b"q" * 65536, "second").release()
        assert tier.pool_counters()["claimed"] == before + 1
        assert bytes(tier.open("second").host_bytes(0, 4)) == b"qqqq"
        self.write_segment(tier, b"r" * 4096, "third").release()
        tier.delete("third")
        assert tier.trim_pool(0) > 0 and tier.pooled_bytes() == 0

    def test_orphans_of_live_writers_are_kept(self, tier: Tier) -> None:
        w = tier.create("busy", 4096)  # still locked by us: a writer in progress
        assert tier.reclaim_orphans(lambda sid: False) == []
        w.finish()
        w.release()  # released but never registered: its writer is gone
        assert tier.reclaim_orphans(lambda sid: False) == ["busy"]
        assert list(tier.segments()) == []

    def test_registered_segments_are_not_orphans(self, tier: Tier) -> None:
        self.write_segment(tier, b"r" * 64).release()
        assert tier.reclaim_orphans(lambda sid: True) == []
        assert list(tier.segments()) == ["s1"]

    def test_abort_removes(self, tier: Tier) -> None:
        w = tier.create("gone", 128)
        w.abort()
        w.abort()
        assert list(tier.segments()) == []

    def test_capacity(self, tmp_path: Path) -> None:
        tier = self.make(tmp_path / "cap", capacity=8192)
        self.write_segment(tier, b"a" * 4096).release()
        with pytest.raises(TierFull) as info:
            tier.create("s2", 8192)
        assert info.value.tier == tier.name
        assert list(tier.segments()) == ["s1"]
        tier.close()

    def test_zero_bytes_refused(self, tier: Tier) -> None:
        with pytest.raises(ValueError):
            tier.create("empty", 0)

    def test_peek_and_read_into_agree_with_open(self, tier: Tier) -> None:
        data = bytes(range(256)) * 32
        self.write_segment(tier, data).release()
        got = tier.peek("s1", [(0, 16), (4000, 8)])
        out = np.zeros(100, np.uint8)
        read = tier.read_into("s1", [(1000, out)])
        if got is None and not read:
            pytest.skip(f"the {tier.name} tier has neither peek nor read_into (optional)")
        if got is not None:
            assert got == [data[:16], data[4000:4008]]
            with pytest.raises(SegmentMissing):
                tier.peek("nope", [(0, 1)])
        if read:
            assert bytes(out) == data[1000:1100]
            with pytest.raises(SegmentMissing):
                tier.read_into("nope", [(0, np.zeros(1, np.uint8))])
