"""What runs in a toy engine instance's process: the message loop of
:func:`instance_main` and the measurements of :func:`measure_toy_engine`.

:class:`ToyCluster` starts one process per instance on :func:`instance_main`; the
calibration (``_calibrate``) asks an instance to time its parts where they run, in that
process, with its threads and its store.
"""

from __future__ import annotations

import os
import queue
import statistics
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

import tensordb
from tensordb.errors import InvalidInput

from ._engine import Job, LocalCache, ToyEngine, ToyEngineConfig, open_kv
from ._model import split_blocks

__all__ = ["instance_main", "measure_toy_engine"]


def _timed(fn: Any, reps: int, stat: Any = statistics.mean) -> float:
    """``stat`` (default the mean) of ``reps`` timings of ``fn()`` after one warm-up
    call. The cost grid takes the mean, not the median, because a queue of requests
    feels the slow ones too; a speed probe takes the fastest, because it compares the
    host with itself, and repetitions slowed by something passing (a preemption, the
    allocator faulting pages back in after a cache was emptied) must not rescale a
    whole run."""
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(stat(ts))


def measure_toy_engine(engine: ToyEngine, *, new_tokens: Sequence[int] = (32, 128, 384),
                       past_tokens: Sequence[int] = (0, 256, 1024), reps: int = 3,
                       blocks: int = 16, seed: int = 0, probe: bool = False
                       ) -> dict[str, Any]:
    """Time the pieces a request's TTFT is made of on ``engine``: the model computing
    ``n`` tokens after ``p`` cached ones over the grid ``new_tokens`` x
    ``past_tokens`` (attention makes it grow with ``n * p`` as well as ``n``); per
    block, a local hit (the cache's lookup), stacking cached blocks into the prefill's
    past, a save to the store, a load from it (``match`` + ``get_into``) and a
    migration (the source's ``publish`` plus the target's ``prefetch``).

    Runs in the calling thread for a few seconds; touches the engine's store only under
    keys of its own, removed before it returns, and leaves the local cache as it was.
    ``probe``: only the prefill grid, each point the fastest of its repetitions (a
    speed probe)."""
    if reps < 1 or blocks < 1 or not new_tokens or not past_tokens:
        raise InvalidInput("calibration needs reps >= 1, blocks >= 1 and token grids")
    cfg = engine.cfg
    bt = cfg.block_tokens
    rng = np.random.default_rng(seed)
    model = engine.model
    longest = max(past_tokens) // bt * bt
    prefix = torch.from_numpy(rng.integers(0, cfg.model.vocab, longest + max(new_tokens)))
    cached = split_blocks(model.prefill(prefix[:longest])[1], 0, bt) if longest else []
    prefill = []
    for p in past_tokens:
        nb = p // bt
        for n in new_tokens:
            toks = prefix[nb * bt:nb * bt + n]
            past = torch.stack(cached[:nb]) if nb else None
            t = _timed(lambda toks=toks, past=past: model.prefill(toks, past), reps,
                       min if probe else statistics.mean)
            prefill.append((n, nb * bt, t))
    if probe:
        return {"prefill": prefill}
    shape = cfg.model.block_shape(bt)
    data = [torch.randn(shape, generator=torch.Generator().manual_seed(seed + i))
            for i in range(blocks)]
    keys = [os.urandom(16) for _ in range(blocks)]
    out: dict[str, Any] = {"prefill": prefill, "block_nbytes": cfg.block_nbytes,
                           "threads": torch.get_num_threads()}
    # a local hit: the cache's lookup of a held run of blocks
    local = LocalCache(blocks)
    local.reserve(keys)
    local.fill(keys, data)
    # every cached block, local or loaded, is then stacked into the prefill's past
    out["stack_per_block"] = _timed(lambda: torch.stack(data), reps) / blocks
    out["hit_per_block"] = _timed(lambda: local.lookup(keys), reps) / blocks
    kv = engine.kv
    if kv is None:
        return out
    try:
        t = time.perf_counter()
        kv.put(keys, data)
        out["save_per_block"] = (time.perf_counter() - t) / blocks

        def load() -> None:
            n = kv.match(keys)
            kv.get_into(keys[:n], [torch.empty(shape) for _ in range(n)])

        out["load_per_block"] = _timed(load, reps) / blocks
        # a migration: the source publishes (the store lacks the blocks), the target
        # prefetches them
        saved = engine.cache
        engine.cache = local
        try:
            def move() -> None:
                kv.delete(keys)
                engine.publish(keys)
                engine.prefetch(-1, keys)

            out["transfer_per_block"] = _timed(move, reps) / blocks
        finally:
            engine.cache = saved
            engine.discard(-1)
    finally:
        kv.delete(keys)
    return out


def instance_main(index: int, cfg: ToyEngineConfig, connect: dict[str, Any], inbox: Any,
                  outbox: Any) -> None:
    """The body of instance process ``index``: build the toy engine, then serve.

    Messages in (``inbox``, in order): ``("job", Job)`` queues a request (a worker
    thread prefills them one at a time, in order); ``("publish", mid, keys)`` and
    ``("prefetch", rid, keys)`` run at once, beside the worker (a migration must not
    wait behind the source's queue); ``("reset",)`` waits for the queue to drain, then
    empties the local cache; ``("calibrate", spec)`` waits for it too, then runs
    :func:`measure_toy_engine` with ``spec``; ``("stop",)`` ends the process. Messages
    out (``outbox``): ``("ready", index)``, ``("start", index, rid, added, evicted)``,
    ``("done", index, Served)``, ``("published", index, mid, n)``, ``("prefetched",
    index, rid, n)``, ``("reset", index)``, ``("calibrated", index, result)``,
    ``("error", index, text)``.
    """
    torch.set_num_threads(cfg.threads)
    db = tensordb.connect(**connect)
    kv = open_kv(db, cfg)
    engine = ToyEngine(cfg, kv, index)
    engine.start_saver()
    jobs: queue.Queue[Job | None] = queue.Queue()
    ready: dict[int, threading.Event] = {}
    ready_lock = threading.Lock()

    def event(rid: int) -> threading.Event:
        with ready_lock:
            return ready.setdefault(rid, threading.Event())

    def work() -> None:
        while (job := jobs.get()) is not None:
            try:
                if job.migrated:
                    event(job.rid).wait()
                with ready_lock:
                    ready.pop(job.rid, None)
                served = engine.serve(job, lambda a, e, r=job.rid: outbox.put(
                    ("start", index, r, a, e)))
                outbox.put(("done", index, served))
            except Exception:  # the router must hear of it, not wait forever
                outbox.put(("error", index, traceback.format_exc()))
            finally:
                jobs.task_done()

    # the first prefill pays for torch's lazy set-up: not a request's time
    engine.model.prefill(torch.zeros(2 * cfg.block_tokens, dtype=torch.int64))
    worker = threading.Thread(target=work, name=f"instance-{index}", daemon=True)
    worker.start()
    outbox.put(("ready", index))
    try:
        while True:
            msg = inbox.get()
            kind = msg[0]
            try:
                if kind == "job":
                    jobs.put(msg[1])
                elif kind == "publish":
                    outbox.put(("published", index, msg[1], engine.publish(msg[2])))
                elif kind == "prefetch":
                    n = engine.prefetch(msg[1], msg[2])
                    event(msg[1]).set()
                    outbox.put(("prefetched", index, msg[1], n))
                elif kind == "reset":
                    jobs.join()
                    engine.reset()
                    outbox.put(("reset", index))
                elif kind == "calibrate":
                    jobs.join()
                    engine.flush()
                    outbox.put(("calibrated", index, measure_toy_engine(engine, **msg[1])))
                elif kind == "stop":
                    break
                else:
                    raise InvalidInput(f"instance {index}: unknown message {kind!r}")
            except Exception:
                outbox.put(("error", index, traceback.format_exc()))
    finally:
        jobs.put(None)
        worker.join(timeout=30)
        engine.stop_saver()
        kv.close()
        db.close()
