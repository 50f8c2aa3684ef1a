"""torch bindings: modules loaded zero-copy, module commits, tensor-parallel views."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import tensordb
from engine_bindings import (
    commit_module,
    load_module,
    shard,
    shard_bounds,
    shard_state_dict,
)
from tensordb.errors import InvalidInput, NotFound


class Tiny(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(12, 8)
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 12, bias=False)
        self.lm_head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.full((8,), float(seed)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self.proj(self.embed(ids)) * self.scale))


def _shm_ranges(db: tensordb.Database) -> list[tuple[int, int]]:
    out = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].strip().startswith(str(db.config.shm_dir) + "/"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi))
    return out


def _in_store(db: tensordb.Database, t: torch.Tensor) -> bool:
    return any(lo <= t.data_ptr() < hi for lo, hi in _shm_ranges(db))


def test_load_module_is_zero_copy(db: tensordb.Database) -> None:
    src, dst = Tiny(1), Tiny(2)
    c = commit_module(db, "tiny", src, message="init")
    assert c.tensors == len(src.state_dict())
    report = load_module(db, "tiny", dst)
    assert report.version == 1 and report.zero_copy and not report.copied
    assert set(report.assigned) == set(src.state_dict())
    for name, t in dst.state_dict().items():
        assert _in_store(db, t), name
        assert torch.equal(t, src.state_dict()[name]), name
    assert isinstance(dst.proj.weight, nn.Parameter) and dst.proj.weight.requires_grad
    assert dst.lm_head.weight is dst.embed.weight  # still tied
    ids = torch.arange(5)
    assert torch.equal(dst(ids), src(ids))
    # the module's writes stay private (copy-on-write): the store keeps its bytes
    with torch.no_grad():
        dst.proj.weight.add_(1.0)
    assert torch.equal(db.get("tiny", "proj.weight"), src.proj.weight)


def test_load_module_into_a_meta_module(db: tensordb.Database) -> None:
    src = Tiny(1)
    commit_module(db, "tiny", src)
    with torch.device("meta"):
        dst = Tiny(2)
    assert dst.proj.weight.is_meta
    report = load_module(db, "tiny", dst)
    assert report.zero_copy and all(_in_store(db, t) for t in dst.state_dict().values())
    assert dst.lm_head.weight is dst.embed.weight
    assert torch.equal(dst(torch.arange(4)), src(torch.arange(4)))
    with torch.device("meta"):
        half = Tiny(2).half()
    with pytest.raises(InvalidInput, match="meta"):
        load_module(db, "tiny", half)


def test_load_module_copies_what_it_cannot_map(db: tensordb.Database) -> None:
    src = Tiny(1)
    commit_module(db, "tiny", src)
    dst = Tiny(2)
    dst.proj.double()  # dtype differs: copy_ converts
    report = load_module(db, "tiny", dst)
    assert set(report.copied) == {"proj.weight", "proj.bias"}
    assert "norm.weight" in report.assigned and not report.zero_copy
    assert dst.proj.weight.dtype == torch.float64 and not _in_store(db, dst.proj.weight)
    assert torch.equal(dst.proj.weight, src.proj.weight.double())
    everything = load_module(db, "tiny", Tiny(3), assign=False)
    assert not everything.assigned and len(everything.copied) == len(src.state_dict())
    with pytest.raises(InvalidInput, match="proj.weight"):
        load_module(db, "tiny", dst, assign=True)


def test_load_module_checks_before_touching_the_module(db: tensordb.Database) -> None:
    commit_module(db, "tiny", Tiny(1))
    db.commit("tiny", {"extra": torch.ones(1)})
    dst = Tiny(2)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(InvalidInput, match="extra"):
        load_module(db, "tiny", dst)
    for k, v in dst.state_dict().items():
        assert torch.equal(v, before[k]) and not _in_store(db, v), k
    report = load_module(db, "tiny", dst, strict=False)
    assert report.unexpected == ("extra",) and report.missing == ()
    with pytest.raises(NotFound):
        load_module(db, "nope", dst)
    with pytest.raises(InvalidInput):
        load_module(db, "tiny", {"a": 1})  # type: ignore[arg-type]


@pytest.fixture
def wrong(db: tensordb.Database) -> None:
    sd = Tiny(1).state_dict()
    sd["proj.weight"] = torch.zeros(4, 8)
    db.commit("wrong", sd)


def test_load_module_shape_mismatch(db: tensordb.Database, wrong: None) -> None:
    dst = Tiny(2)
    with pytest.raises(InvalidInput, match="proj.weight") as info:
        load_module(db, "wrong", dst)
    assert info.value.tensor == "proj.weight"
    assert not _in_store(db, dst.norm.weight)


def test_load_module_by_version_and_tag(db: tensordb.Database) -> None:
    m = Tiny(1)
    commit_module(db, "tiny", m)
    db.tag("tiny", "first")
    with torch.no_grad():
        m.norm.weight.fill_(3.0)
    commit_module(db, "tiny", m)
    dst = Tiny(2)
    assert load_module(db, "tiny", dst, tag="first").version == 1
    assert torch.equal(dst.norm.weight, torch.ones(8))
    assert load_module(db, "tiny", dst).version == 2
    assert torch.equal(dst.norm.weight, torch.full((8,), 3.0))


def test_commit_module_stores_only_what_changed(db: tensordb.Database) -> None:
    m = Tiny(1)
    c1 = commit_module(db, "tiny", m)
    assert c1.written == c1.tensors == len(m.state_dict())
    with torch.no_grad():
        m.proj.bias.add_(1.0)
    c2 = commit_module(db, "tiny", m, message="step 1")
    assert (c2.version, c2.written, c2.tensors) == (2, 1, c1.tensors)
    assert c2.written_nbytes == m.proj.bias.nbytes and c2.message == "step 1"
    assert commit_module(db, "tiny", m).written == 0


# -- tensor-parallel reads -------------------------------------------------------------
FULL_SHAPE = (10, 7, 6)


@pytest.fixture
def full(db: tensordb.Database) -> torch.Tensor:
    t = torch.arange(420, dtype=torch.float32).reshape(FULL_SHAPE)
    db.commit("tp", {"pad": torch.ones(3), "w": t, "b": torch.arange(10.0)})
    return t


def _chunks(t: torch.Tensor, n: int, dim: int) -> list[torch.Tensor]:
    parts = list(torch.chunk(t, n, dim))
    while len(parts) < n:  # torch.chunk returns fewer parts: those ranks get empty views
        parts.append(t.narrow(dim, t.shape[dim], 0))
    return parts


def test_shards_are_views_equal_to_chunk(db: tensordb.Database, full: torch.Tensor) -> None:
    whole = db.get("tp", "w")
    base = whole.data_ptr() - whole.untyped_storage().data_ptr()  # offset in the segment
    for world_size, dim in itertools.product([1, 2, 3, 4, 8], [0, 1, 2, -1]):
        expected = _chunks(full, world_size, dim)
        for rank in range(world_size):
            s = shard(db, "tp", "w", rank=rank, world_size=world_size, dim=dim)
            assert s.shape == expected[rank].shape and torch.equal(s, expected[rank])
            start, length = shard_bounds(full.shape[dim], rank, world_size)
            assert length == s.shape[dim]
            if s.numel():
                assert _in_store(db, s)
                # a view of the same bytes: same segment offset as the slice of the whole
                assert s.data_ptr() - s.untyped_storage().data_ptr() == \
                    base + start * whole.stride(dim) * whole.element_size()
                assert s.stride() == whole.stride()


def test_shard_errors(db: tensordb.Database, full: torch.Tensor) -> None:
    for kw in ({"rank": -1, "world_size": 2}, {"rank": 2, "world_size": 2},
               {"rank": 0, "world_size": 0}, {"rank": 0, "world_size": 2, "dim": 3},
               {"rank": 0, "world_size": 2, "dim": -4}, {"rank": True, "world_size": 2},
               {"rank": 0, "world_size": 2.0}):
        with pytest.raises(InvalidInput):
            shard(db, "tp", "w", **kw)  # type: ignore[arg-type]
    db.commit("tp", {"s": torch.tensor(1.0)})
    with pytest.raises(InvalidInput, match="0-d"):
        shard(db, "tp", "s", rank=0, world_size=1)
    with pytest.raises(NotFound):
        shard(db, "tp", "nope", rank=0, world_size=1)


def test_shard_state_dict(db: tensordb.Database, full: torch.Tensor) -> None:
    db.commit("tp", {"layers.0.q.weight": torch.arange(24.0).reshape(6, 4),
                     "layers.0.o.weight": torch.arange(24.0).reshape(4, 6)})
    plan = {"*.q.weight": 0, "*.o.weight": 1, "w": 2, "b": None}
    for rank in range(2):
        sd = shard_state_dict(db, "tp", rank=rank, world_size=2, plan=plan)
        assert set(sd) == {"pad", "w", "b", "layers.0.q.weight", "layers.0.o.weight"}
        assert torch.equal(sd["w"], full.chunk(2, 2)[rank])
        q, o = torch.arange(24.0).reshape(6, 4), torch.arange(24.0).reshape(4, 6)
        assert torch.equal(sd["layers.0.q.weight"], q[3 * rank : 3 * rank + 3])
        assert torch.equal(sd["layers.0.o.weight"], o[:, 3 * rank : 3 * rank + 3])
        assert torch.equal(sd["b"], torch.arange(10.0)) and torch.equal(sd["pad"], torch.ones(3))
        assert all(_in_store(db, t) for t in sd.values())
    # views outlive their snapshot, a drop and a gc: they keep their mapping
    v1 = shard_state_dict(db, "tp", rank=1, world_size=2, plan={"w": 0}, version=1)
    assert "layers.0.q.weight" not in v1
    db.drop("tp")
    db.gc()
    assert torch.equal(v1["w"], full[5:])
    with pytest.raises(InvalidInput):
        shard_state_dict(db, "x", rank=0, world_size=1, plan={"w": "0"})  # type: ignore[dict-item]
    with pytest.raises(InvalidInput):
        shard_state_dict(db, "x", rank=1, world_size=1, plan={})
