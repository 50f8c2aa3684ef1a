"""What every benchmark here shares: percentiles, the memcpy limit, a throwaway
PostgreSQL database, the store clean-up, and the CPU other processes take. Scripts import it as
``from benchmarks import _common`` (they run as ``python -m benchmarks.NAME``)."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np

import tensordb


def pctl(xs: list[float], q: float) -> float:
    """The q-quantile of ``xs`` (nearest rank)."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def summary(xs_s: list[float]) -> dict[str, float]:
    """Median, p90 and min of durations given in seconds, in milliseconds."""
    ms = [x * 1e3 for x in xs_s]
    return {"median_ms": statistics.median(ms), "p90_ms": pctl(ms, 0.9), "min_ms": min(ms),
            "n": len(ms)}


def cpu_seconds(pids: list[int]) -> tuple[float, float] | None:
    """``(the host's busy CPU seconds, the CPU seconds of processes pids)`` so far, from
    /proc (all threads of each process); None where there is no /proc. The difference
    of two readings over a wall time is how many cores everything else took meanwhile:
    :func:`other_cores`."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
        mine = 0
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                st = f.read().rsplit(")", 1)[1].split()
            mine += int(st[11]) + int(st[12])  # utime, stime
    except (OSError, ValueError, IndexError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - ticks[3] - ticks[4]) / hz, mine / hz  # less idle and iowait


def other_cores(before: tuple[float, float] | None, after: tuple[float, float] | None,
                wall: float) -> float | None:
    """Cores the host's other processes kept busy on average between two
    :func:`cpu_seconds` readings ``wall`` seconds apart (None without /proc)."""
    if before is None or after is None or wall <= 0:
        return None
    return max(0.0, ((after[0] - before[0]) - (after[1] - before[1])) / wall)


def measure_memcpy(nbytes: int, reps: int) -> dict[str, float]:
    """The physical limit: best time of a numpy copy of ``nbytes`` into a pre-touched
    destination (no page faults), on one thread and split over two."""
    src = np.empty(nbytes, np.uint8)
    src.fill(1)
    dst = np.empty(nbytes, np.uint8)
    dst.fill(0)
    one, two = [], []
    half = nbytes // 2
    with ThreadPoolExecutor(2) as pool:
        for _ in range(reps):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            one.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            list(pool.map(lambda s: np.copyto(dst[s], src[s]),
                          [slice(0, half), slice(half, None)]))
            two.append(time.perf_counter() - t0)
    return {"memcpy_1t_s": min(one), "memcpy_2t_s": min(two)}


@contextmanager
def shm_scratch(nbytes: int) -> Iterator[np.ndarray]:
    """A pre-faulted shared-memory file of ``nbytes`` as a uint8 array, as a store spare
    is (4 KiB pages: see ``shmem_thp``); the file is removed afterwards, and the mapping
    goes with the last view of it."""
    import mmap
    import os

    fd, path = tempfile.mkstemp(prefix="tensordb-bench-shm-", dir="/dev/shm")
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
        dst = np.frombuffer(mm, np.uint8)
        dst[:: mmap.PAGESIZE] = 0
        try:
            yield dst
        finally:
            del dst
            try:
                mm.close()
            except BufferError:  # the caller still holds a view: unmapped when it goes
                pass
    finally:
        os.close(fd)
        os.unlink(path)


def shmem_thp() -> str:
    """This host's transparent-huge-page mode for shared memory."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            return next((w.strip("[]") for w in f.read().split() if w.startswith("[")), "?")
    except OSError:
        return "unknown"


def measure_shm_write(nbytes: int, reps: int) -> dict[str, float]:
    """What writing into the store's memory allows, nothing else (no catalog, no
    allocation): from torch tensors (the allocator's 4 KiB pages, as a model's are) into
    a pre-faulted shared-memory file (``shm_scratch``), on two threads, a plain copy and
    the store's copy with its xxh3 checksum (``copy_and_checksum``). The memcpy of
    ``measure_memcpy`` runs between numpy buffers that the kernel may back with huge
    pages, which shared memory may not get."""
    import torch

    from storage_engine._checksum import copy_and_checksum

    src = torch.ones(nbytes, dtype=torch.uint8).numpy()
    half = nbytes // 2
    parts = [slice(0, half), slice(half, None)]
    plain, hashed = [], []
    with shm_scratch(nbytes) as dst, ThreadPoolExecutor(2) as pool:
        for _ in range(reps):
            t0 = time.perf_counter()
            list(pool.map(lambda s: np.copyto(dst[s], src[s]), parts))
            plain.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            list(pool.map(lambda s: copy_and_checksum(dst[s], src[s]), parts))
            hashed.append(time.perf_counter() - t0)
    return {"shm_copy_2t_s": min(plain), "shm_copy_checksum_2t_s": min(hashed),
            "shmem_thp": shmem_thp()}


def _populate_once(nbytes: int, threads: int) -> float:
    """Seconds to write ``nbytes`` into a fresh shared-memory file on ``threads``
    threads (every page faulted in, zeroed by the kernel, then written once)."""
    import mmap

    fd, path = tempfile.mkstemp(prefix="tensordb-bench-populate-", dir="/dev/shm")
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
        dst = np.frombuffer(mm, np.uint8)
        step = -(-nbytes // threads)
        parts = [slice(i, min(nbytes, i + step)) for i in range(0, nbytes, step)]
        with ThreadPoolExecutor(threads) as pool:
            t0 = time.perf_counter()
            list(pool.map(np.ndarray.fill, [dst[s] for s in parts], [1] * len(parts)))
            took = time.perf_counter() - t0
        del dst
        mm.close()
    finally:
        os.close(fd)
        os.unlink(path)
    return took


def measure_populate(nbytes: int = 256 << 20, reps: int = 3) -> dict[str, float]:
    """The populate bound, the one every benchmark prints: GB/s at which this host
    makes new shared-memory pages, a fresh tmpfs file (``/dev/shm``) written once, the
    best of ``reps`` (each a new file, removed after). ``populate_1t_gbps`` on one
    thread, the bound a single writer meets; ``populate_all_gbps`` on every core, the
    one printed beside it. A fresh store's first bytes pay it; its steady state (pooled
    segments) must not."""
    threads = max(1, os.cpu_count() or 1)
    one = min(_populate_once(nbytes, 1) for _ in range(reps))
    every = min(_populate_once(nbytes, threads) for _ in range(reps))
    return {"populate_1t_gbps": nbytes / one / 1e9, "populate_all_gbps": nbytes / every / 1e9,
            "populate_threads": threads, "populate_bytes": nbytes}


def populate_text(p: dict[str, float]) -> str:
    """The populate bound as printed beside a figure."""
    return (f"populate bound {p['populate_1t_gbps']:.2f} GB/s on one thread, "
            f"{p['populate_all_gbps']:.2f} on {p['populate_threads']:g}")


class PgUnavailable(Exception):
    """No PostgreSQL server answers; the message says why (the benchmark skips it)."""


@contextmanager
def temp_pg_database(server: str) -> Iterator[tuple[str, str]]:
    """A fresh database on ``server`` (user@host:port), dropped afterwards: yields its
    SQLAlchemy URL and the server version. Raises PgUnavailable if none answers."""
    from sqlalchemy import create_engine, text

    name = f"tensordb_bench_{uuid.uuid4().hex[:12]}"
    try:
        admin = create_engine(f"postgresql+psycopg://{server}/postgres",
                              isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})
        with admin.connect() as conn:
            version = conn.execute(text("SHOW server_version")).scalar()
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # noqa: BLE001 - any failure to reach the server skips
        raise PgUnavailable(f"PostgreSQL at {server} does not answer: "
                            f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from exc
    try:
        yield f"postgresql+psycopg://{server}/{name}", str(version)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def remove_store(db: tensordb.Database | None) -> None:
    """Close a benchmark's store and remove its shared-memory directory."""
    if db is not None:
        db.close()
        shutil.rmtree(db.config.shm_dir, ignore_errors=True)


@contextmanager
def temp_pg_store(server: str, prefix: str, tmp_dir: str | None = None
                  ) -> Iterator[tuple[tensordb.Database, str]]:
    """A store on a throwaway PostgreSQL database (see temp_pg_database), its data in a
    temporary directory; yields it and the server version, removes everything after."""
    with temp_pg_database(server) as (url, version):
        tmp = tempfile.mkdtemp(prefix=prefix, dir=tmp_dir)
        db = None
        try:
            db = tensordb.connect(url, data_dir=tmp, home=tmp)
            yield db, version
        finally:
            remove_store(db)
            shutil.rmtree(tmp, ignore_errors=True)
