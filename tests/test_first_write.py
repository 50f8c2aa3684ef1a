"""A store's first bytes are written into fresh shared memory without a page fault per
page: a fresh segment file is filled through its descriptor (``pwrite``: the kernel
makes each page as it copies into it), not through a mapping that faults each page in
and zeroes it first. Counted, not timed: minor faults (``getrusage``, every thread) of
a first commit and of a first and second import, against the pages they write."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
import torch
from conftest import open_store, remove_store
from safetensors.torch import save_file

import storage_engine as se
from storage_engine._direct import DIRECT

PAGE = resource.getpagesize()
MiB = 1 << 20
#: faults besides the pages' (Python objects, the catalog's first statements)
FLOOR = 400

pytestmark = pytest.mark.skipif(not se.BATCH_FILL, reason="needs the compiled extension")


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_a_first_commit_takes_no_fault_per_page(tmp_path: Path) -> None:
    nbytes = 64 * MiB
    sd = {f"w{i}": torch.full((nbytes // 16,), float(i)) for i in range(3)}
    small = {"n": torch.arange(10, dtype=torch.float32)}  # gathered into one write
    sd |= {f"s{i}": torch.full((17,), float(i)) for i in range(50)}
    db = open_store(tmp_path)
    try:
        before = faults()
        c = db.commit("m", {**sd, **small})
        took = faults() - before
        pages = c.nbytes // PAGE
        # before, one fault a page (16,000+ here): the populate of a fresh mapping
        assert took <= pages // 16 + FLOOR, (took, pages)
        with db.snapshot("m") as snap:
            for name, t in {**sd, **small}.items():
                assert torch.equal(snap[name], t), name
        assert db.verify() == []
    finally:
        remove_store(db)


def test_a_first_and_a_second_import_take_no_fault_per_page(tmp_path: Path) -> None:
    src = tmp_path / "m.safetensors"
    sd = {"a": torch.full((8 * MiB,), 1.0), "b": torch.full((4 * MiB,), 2.0),
          **{f"n{i}": torch.full((33,), float(i)) for i in range(40)}}
    save_file(sd, str(src))
    db = open_store(tmp_path / "store")
    try:
        for name in ("first", "second"):  # the second: fresh memory again, no re-populate
            before = faults()
            c = db.import_safetensors(name, src)
            took = faults() - before
            pages = c.nbytes // PAGE
            assert took <= pages // 16 + FLOOR, (name, took, pages)
            with db.snapshot(name) as snap:
                for k, t in sd.items():
                    assert torch.equal(snap[k], t), (name, k)
        assert db.verify() == []
    finally:
        remove_store(db)


def test_a_fresh_file_written_in_part_through_its_mapping_stays_right(
        tmp_path: Path) -> None:
    """A fill that mixes both ways (contiguous tensors through the descriptor, a strided
    one through ``buffer``, which then maps the file) holds every byte."""
    db = open_store(tmp_path)
    try:
        base = torch.arange(4 * MiB, dtype=torch.float32).reshape(1024, -1)
        sd = {"flat": torch.full((3 * MiB,), 5.0), "strided": base.t(), "tail": base[:3]}
        db.commit("mixed", sd)
        with db.snapshot("mixed") as snap:
            for k, t in sd.items():
                assert torch.equal(snap[k], t), k
        assert db.verify() == []
    finally:
        remove_store(db)


def test_many_small_tensors_split_over_the_io_threads_come_back_right(
        tmp_path: Path) -> None:
    """16 MiB of 8 KiB tensors: over the 8 MiB at which the I/O threads share a fill,
    and small enough to be gathered into windows. A window pads the gaps between the
    extents it gathers, and each thread writes its own; 937 of these 2,000 tensors came
    back as zeros where one thread's padding covered another's extents."""
    sd = {f"t{i:05d}": torch.full((2048,), float(i)) for i in range(2000)}
    db = open_store(tmp_path)
    try:
        db.commit("m", sd)
        with db.snapshot("m", verify=True) as snap:
            got = snap.state_dict()
            assert [n for n in sd if not torch.equal(got[n], sd[n])] == []
    finally:
        remove_store(db)


@pytest.mark.skipif(not DIRECT, reason="an extension without descriptor writes")
def test_a_gathered_write_never_pads_over_bytes_it_was_not_given(tmp_path: Path) -> None:
    """The native gathering itself: one call writes extents at 0 and 256, another (as
    another I/O thread would) the one at 128 between them, first. The gap the first
    call pads is at most the extent alignment, so the 128-byte extent survives."""
    import os

    import numpy as np

    from storage_engine._direct import pwrite_hash_many

    path = tmp_path / "f"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        src = {o: np.full(64, o // 64 + 1, np.uint8) for o in (0, 128, 256)}

        def write(offs: list[int]) -> None:
            addr = np.array([src[o].ctypes.data for o in offs], np.uint64)
            size = np.full(len(offs), 64, np.uint64)
            pwrite_hash_many(fd, 512, addr, size, np.array(offs, np.uint64),
                             np.empty(len(offs), np.uint64))

        write([128])
        write([0, 256])
        data = np.frombuffer(path.read_bytes(), np.uint8)
        for o, v in src.items():
            assert (data[o:o + 64] == v).all(), o
    finally:
        os.close(fd)
