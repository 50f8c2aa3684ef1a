"""The router in front of engine processes: a workload, a routing policy, N instances.

:class:`EngineCluster` is the router side, shared by the toy engine and the real
engines (``benchmarks.vllm_engine``): it starts one process per instance on its
``target`` and :meth:`EngineCluster.run` feeds a workload to them through a routing
policy with real wall-clock arrivals. :class:`ToyCluster` runs toy engine instances
(``_instance.instance_main``: the tiny model, a bounded local KV cache, the shared
tensordb KV store).

An instance process speaks one protocol (``_instance.instance_main`` documents it):
jobs, ``reset`` and ``calibrate`` in; ``ready``, ``start`` (its local cache's change),
``done`` (a :class:`Served`), ``reset``, ``calibrated`` and ``error`` out; the toy
engine's migrations add ``publish`` / ``prefetch``.

What the routing policy sees is live, and the same as in the simulator:

* ``prefix_hits``: from each instance's published summary of its local cache (the keys
  it holds; an instance sends the change as each prefill starts), read through
  ``engine_bindings.router.cluster_view`` as a router of real engines reads the nodes'
  ``tensordb.KVNodeSummary``;
* ``queued_tokens``: prompt tokens routed to the instance whose prefill has not ended,
  less what its cache covered when routed; ``running_tokens``: 0 (the toy engine stops
  at the first token); ``load_ewma``: an EWMA of their sum with time constant
  ``ewma_tau``.

A decision that migrates KV runs through the store: the request is queued on the
target at once; the source publishes the blocks it holds (those the store lacks) and
the target prefetches them into buffers of its own while the request waits, then
adopts them when its prefill starts. Token ids are drawn per session from a seed
(:class:`PromptTokens`), so a session's turns share their prefix and every session
shares the system prompt, which is what makes the toy engine's KV keys hit.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import shutil
import tempfile
import threading
import zlib
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

import tensordb
from engine_bindings.router import (
    LoadTracker,
    Request,
    RequestRecord,
    RoutingPolicy,
    SimResult,
    cluster_view,
    get_policy,
)
from tensordb.errors import InvalidInput, NodeUnavailable

from ._engine import Job, Served, ToyEngineConfig, clock, open_kv
from ._instance import instance_main

__all__ = ["EngineCluster", "PromptTokens", "ToyCluster"]

_RUN_MESSAGES = ("start", "done", "published", "prefetched")


class PromptTokens:
    """Deterministic token ids for requests: the first ``shared_prefix_tokens`` of every
    prompt are one stream (the system prompt), the rest a stream per (session,
    context); a turn's prompt is the stream's first ``input_tokens`` ids."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab = vocab
        self.seed = seed
        self._streams: dict[tuple[Hashable, int] | None, np.ndarray] = {}

    def _stream(self, key: tuple[Hashable, int] | None, n: int) -> np.ndarray:
        s = self._streams.get(key)
        if s is None or len(s) < n:
            tag = 0 if key is None else 1 + zlib.crc32(repr(key).encode())
            rng = np.random.default_rng([self.seed, tag])
            # regenerated from the start when it must grow: the same seed, the same ids
            s = rng.integers(0, self.vocab, max(n, 2 * len(s) if s is not None else n),
                             dtype=np.int64)
            self._streams[key] = s
        return s[:n]

    def __call__(self, req: Request) -> np.ndarray:
        shared = self._stream(None, req.shared_prefix_tokens)
        own = self._stream((req.session, req.context), req.input_tokens - len(shared))
        return np.concatenate((shared, own))


class _Inst(LoadTracker):
    """The router's bookkeeping of one instance, and the summary of its local cache the
    instance publishes: exactly the keys it holds (no false positives, unlike a Bloom
    filter), read as a ``BlockSummary``."""

    __slots__ = ("block_tokens", "held")

    def __init__(self, block_tokens: int) -> None:
        super().__init__()
        self.block_tokens = block_tokens
        self.held: set[bytes] = set()

    def prefix_hits(self, keys: Sequence[bytes]) -> int:
        n = 0
        for k in keys:
            if k not in self.held:
                break
            n += 1
        return n


class EngineCluster:
    """``instances`` engine processes sharing one tensordb store, behind one router.

    Each runs ``target(index, cfg, connect_kw, inbox, outbox, *self._target_args())`` (a
    function importable by name). ``cfg`` is the engine's configuration: the router reads its
    ``block_tokens``, ``cache_blocks``, ``namespace`` and ``use_store``. ``home``
    (default: a temporary directory, removed on close) and ``url`` pick the store, as
    ``tensordb.connect`` does. Processes start in ``start_method`` mode (``forkserver``,
    preloading ``preload``, or ``spawn``: a forked torch is not safe) and stay up across
    runs; ``close`` (or the context manager) stops them and removes what the runs
    stored. The ``ready`` message of each instance may carry a dict about it
    (``self.info[i]``). Not thread-safe: one run at a time."""

    def __init__(self, instances: int, cfg: Any, target: Any, *, vocab: int,
                 home: str | Path | None = None, url: str | None = None,
                 start_method: str = "forkserver", timeout: float = 120.0,
                 preload: Sequence[str] = ()) -> None:
        if isinstance(instances, bool) or not isinstance(instances, int) or instances < 1:
            raise InvalidInput(f"instances must be a positive int, not {instances!r}")
        if start_method not in ("forkserver", "spawn"):
            raise InvalidInput(f"start_method must be 'forkserver' or 'spawn', not "
                               f"{start_method!r}")
        self.n = instances
        self.cfg = cfg
        self.vocab = vocab
        self.timeout = timeout
        self._procs: list[Any] = []
        self._tmp = None if home is not None else Path(
            tempfile.mkdtemp(prefix="tensordb-engines-"))
        root = Path(home) if home is not None else self._tmp
        assert root is not None
        self.connect_kw: dict[str, Any] = {"url": url, "home": root, "data_dir": root / "data"}
        self.db = tensordb.connect(**self.connect_kw)
        #: the router's keys of a prompt's full blocks (``kv.keys``); the toy engine
        #: stores its blocks here too
        self.kv = self._open_kv()
        self._stored: list[bytes] = []
        self._prepare()
        ctx = mp.get_context(start_method)
        if start_method == "forkserver" and preload:
            ctx.set_forkserver_preload(list(preload))
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(instances)]
        self._procs = [ctx.Process(target=target, name=f"tensordb-instance-{i}",
                                   args=(i, cfg, self.connect_kw, self._inboxes[i],
                                         self._outbox, *self._target_args()), daemon=True)
                       for i in range(instances)]
        self.info: list[dict[str, Any]] = [{} for _ in range(instances)]
        try:
            for p in self._procs:
                p.start()
            for msg in self._expect("ready", instances):
                if len(msg) > 2:
                    self.info[msg[1]] = msg[2]
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        """The instances' process ids."""
        return [p.pid for p in self._procs if p.pid is not None]

    def _open_kv(self) -> tensordb.KVCache:
        """The namespace the router keys prompts in (``cfg.namespace``); it stores
        nothing here, so its arena is small."""
        return self.db.kv(self.cfg.namespace, self.cfg.block_tokens, capacity_bytes=16 << 20,
                          spill=False)

    def _prepare(self) -> None:
        """Set-up in the router's process before the instances start (none here)."""

    def _target_args(self) -> tuple[Any, ...]:
        """The instances' arguments after the common ones (none here)."""
        return ()

    # -- messages ----------------------------------------------------------------------
    def _get(self, stop: threading.Event | None = None) -> tuple[Any, ...] | None:
        """The next message from the instances (None once ``stop`` is set); raises
        NodeUnavailable when one died, failed or none answered within the timeout."""
        deadline = clock() + self.timeout
        while stop is None or not stop.is_set():
            try:
                msg = self._outbox.get(timeout=0.25)
            except queue.Empty:
                dead = [p.name for p in self._procs if not p.is_alive()]
                if dead or clock() > deadline:
                    raise NodeUnavailable(f"engine instances {dead or 'all'} "
                                          f"{'died' if dead else 'did not answer'}") from None
                continue
            if msg[0] == "error":
                raise NodeUnavailable(f"engine instance {msg[1]} failed:\n{msg[2]}")
            return msg
        return None

    def _expect(self, kind: str, count: int) -> list[tuple[Any, ...]]:
        out = []
        while len(out) < count:
            msg = self._get()
            assert msg is not None
            if msg[0] == kind:
                out.append(msg)
            elif msg[0] not in _RUN_MESSAGES:  # those are late news of a run that failed
                raise NodeUnavailable(f"engine cluster: expected {kind!r} from the instances, "
                                      f"got {msg[0]!r}")
        return out

    def _broadcast(self, *msg: Any) -> None:
        for q in self._inboxes:
            q.put(msg)

    def reset(self) -> None:
        """Every instance drops its local cache, and the store forgets the blocks of
        the last run (its arena stays allocated, so a run does not pay for fresh
        shared-memory pages): the router's namespace here, an instance's own where it
        stores elsewhere."""
        self._broadcast("reset")
        self._expect("reset", self.n)
        if self._stored:
            self.kv.delete(self._stored)
            self._stored = []

    def calibrate(self, instance: int = 0, **spec: Any) -> dict[str, Any]:
        """Run the engine's measurements (the toy engine's ``measure_toy_engine``)
        inside instance ``instance`` (its own process, threads and store) with ``spec``
        and return them."""
        self._inboxes[instance].put(("calibrate", spec))
        return self._expect("calibrated", 1)[0][2]

    def calibrate_all(self, **spec: Any) -> list[dict[str, Any]]:
        """As :meth:`calibrate`, in every instance at once (they share the CPU as in
        a loaded run)."""
        self._broadcast("calibrate", spec)
        return [m[2] for m in sorted(self._expect("calibrated", self.n), key=lambda m: m[1])]

    # -- a run ----------------------------------------------------------------------
    def run(self, requests: Sequence[Request], policy: str | RoutingPolicy, *,
            ewma_tau: float = 5.0, seed: int = 0) -> SimResult:
        """Feed ``requests`` (sorted by arrival; arrivals in seconds from the start) to
        the instances through ``policy`` in real time, on empty caches and an empty
        store namespace; returns when every request has its first token. Records are
        in arrival order, with the TTFT split into queueing, KV load and prefill."""
        pol = get_policy(policy)
        pol.reset()
        if ewma_tau <= 0:
            raise InvalidInput(f"ewma_tau must be > 0, got {ewma_tau}")
        for i in range(1, len(requests)):
            if requests[i].arrival < requests[i - 1].arrival:
                raise InvalidInput(f"requests must be sorted by arrival: request {i} "
                                   f"(session {requests[i].session!r}) comes too early")
        self.reset()
        toks = PromptTokens(self.vocab, seed)
        jobs = []
        for r in requests:
            t = toks(r)
            jobs.append((t, tuple(self.kv.keys(t))))
        self._stored = sorted({k for _, keys in jobs for k in keys})
        run = _Run(self, requests, jobs, pol, ewma_tau)
        collector = threading.Thread(target=run.collect, name="router-collect", daemon=True)
        collector.start()
        try:
            run.feed()
        finally:
            collector.join()
        if run.failure:
            raise run.failure[0]
        return SimResult(pol.name, run.records())

    def close(self) -> None:
        """Stop the instances and remove the run's store namespaces (idempotent)."""
        procs, self._procs = [p for p in self._procs if p.pid is not None], []  # started
        for p, q in zip(procs, self._inboxes, strict=False):  # procs: [] once closed
            if p.is_alive():
                q.put(("stop",))
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        if getattr(self, "db", None) is not None:
            try:
                self.kv.destroy()
            finally:
                shm = self.db.config.shm_dir
                self.db.close()
                self.db = None  # type: ignore[assignment]
                shutil.rmtree(shm, ignore_errors=True)
                if self._tmp is not None:
                    shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> EngineCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ToyCluster(EngineCluster):
    """``instances`` toy engine processes sharing one tensordb store.

    ``home``, ``url``, ``start_method`` and ``timeout`` as :class:`EngineCluster`
    (forkserver by default, with torch imported once for all instances).
    ``warm_bytes`` of the store's arena are faulted in before the instances start
    (default: half the arena, at most 64 MiB); runs that store more than that pay page
    faults in their first slabs that later runs do not."""

    def __init__(self, instances: int, engine: ToyEngineConfig | None = None, *,
                 home: str | Path | None = None, url: str | None = None,
                 start_method: str = "forkserver", timeout: float = 120.0,
                 warm_bytes: int | None = None) -> None:
        if warm_bytes is not None and (isinstance(warm_bytes, bool) or
                                       not isinstance(warm_bytes, int) or warm_bytes < 0):
            raise InvalidInput(f"warm_bytes must be an int >= 0, not {warm_bytes!r}")
        cfg = engine or ToyEngineConfig()
        self._warm_bytes = (min(cfg.store_bytes // 2, 64 << 20) if warm_bytes is None
                            else min(warm_bytes, cfg.store_bytes))
        super().__init__(instances, cfg, instance_main, vocab=cfg.model.vocab, home=home,
                         url=url, start_method=start_method, timeout=timeout,
                         preload=["torch", "tensordb", "benchmarks.toy_engine._instance"])

    def _open_kv(self) -> tensordb.KVCache:
        return open_kv(self.db, self.cfg)

    def _prepare(self) -> None:
        self._warm(self._warm_bytes)

    def __enter__(self) -> ToyCluster:
        return self

    def _warm(self, nbytes: int) -> None:
        """Have the store's arena take its shared-memory pages now: the first blocks
        into a fresh slab pay for faulting it in, which is set-up, not a request's
        time."""
        block = torch.zeros(self.cfg.model.block_shape(self.cfg.block_tokens))
        keys = [b"warm-%d" % i for i in range(max(1, nbytes // self.cfg.block_nbytes))]
        for lo in range(0, len(keys), 64):
            self.kv.put(keys[lo:lo + 64], [block] * len(keys[lo:lo + 64]))
        self.kv.delete(keys)


class _Run:
    """One run of :meth:`ToyCluster.run`: the router's view of each instance, what was
    served, and the migrations in flight. The arrival loop (:meth:`feed`, the caller's
    thread) and the collector (:meth:`collect`, a thread of its own) share it under
    ``lock``."""

    def __init__(self, cluster: ToyCluster, requests: Sequence[Request],
                 jobs: list[tuple[np.ndarray, tuple[bytes, ...]]], policy: RoutingPolicy,
                 ewma_tau: float) -> None:
        self.cluster = cluster
        self.requests = requests
        self.jobs = jobs
        self.pol = policy
        self.tau = ewma_tau
        self.bt = cluster.cfg.block_tokens
        self.insts = [_Inst(self.bt) for _ in range(cluster.n)]
        self.lock = threading.Lock()
        self.served: dict[int, Served] = {}
        self.est: dict[int, int] = {}
        self.pending: dict[int, tuple[int, int, tuple[bytes, ...]]] = {}  # mid -> target
        self.failure: list[BaseException] = []
        self.done = threading.Event()
        self.stop = threading.Event()
        self.t0 = clock() + 0.05

    def collect(self) -> None:
        """The instances' news until every request is served, the run is stopped or
        an instance fails (the failure is handed to the arrival loop)."""
        try:
            while len(self.served) < len(self.requests):
                msg = self.cluster._get(self.stop)
                if msg is None:
                    return
                with self.lock:
                    self._on_message(msg)
        except BaseException as exc:  # handed to the arrival loop
            self.failure.append(exc)
        finally:
            self.done.set()

    def _on_message(self, msg: tuple[Any, ...]) -> None:
        kind, inst = msg[0], self.insts[msg[1]]
        if kind == "start":
            inst.held.difference_update(msg[4])
            inst.held.update(msg[3])
        elif kind == "done":
            s: Served = msg[2]
            inst.advance(s.end - self.t0, self.tau)
            inst.queued -= self.est[s.rid]
            self.served[s.rid] = s
        elif kind == "published":
            target, rid, keys = self.pending.pop(msg[2])
            self.cluster._inboxes[target].put(("prefetch", rid, keys))

    def _route(self, rid: int, req: Request) -> tuple[int, int | None, tuple[bytes, ...]]:
        """Route request ``rid`` on the live view (the caller holds the lock) and count
        it in its instance's queue; returns ``(target, source, keys to move)``."""
        keys = self.jobs[rid][1]
        now = req.arrival
        n, bt = self.cluster.n, self.bt
        for inst in self.insts:
            inst.advance(now, self.tau)
        view = cluster_view(self.insts, keys, time=now, loads=self.insts,
                            session=req.session)
        dec = self.pol.route(req, view)
        tgt, src = dec.instance, dec.migrate_from
        if not 0 <= tgt < n or (src is not None and not 0 <= src < n):
            raise InvalidInput(f"policy {self.pol.name!r} chose instance {tgt} "
                               f"(migrating from {src}) of {n}")
        states = view.instances
        cover = states[tgt].prefix_hits // bt
        n_move = 0
        if src is not None:
            n_move = max(0, states[src].prefix_hits // bt - cover)
            if dec.blocks:
                n_move = min(n_move, dec.blocks)
        move_keys = keys[cover:cover + n_move]
        self.est[rid] = req.input_tokens - (cover + n_move) * bt
        self.insts[tgt].queued += self.est[rid]
        self.insts[tgt].seen[req.session] = now
        if n_move:
            self.pending[rid] = (tgt, rid, move_keys)
        return tgt, src, move_keys

    def feed(self) -> None:
        """Each request at its arrival time: routed, then sent to its instance (and a
        migration's source told to publish). Stops early when the collector ends; on
        any error the run is stopped and no migrated request is left waiting."""
        inboxes = self.cluster._inboxes
        try:
            for rid, req in enumerate(self.requests):
                delay = self.t0 + req.arrival - clock()
                if delay > 0 and self.done.wait(delay):
                    break
                tokens, keys = self.jobs[rid]
                with self.lock:
                    tgt, src, move_keys = self._route(rid, req)
                inboxes[tgt].put(("job", Job(rid, tokens, keys, self.t0 + req.arrival,
                                             migrated=bool(move_keys))))
                if move_keys:
                    assert src is not None
                    inboxes[src].put(("publish", rid, move_keys))
        except BaseException:
            self.stop.set()  # late news of this run is dropped by the next reset
            with self.lock:  # no migrated request may wait for a prefetch that never comes
                for target, rid, _ in self.pending.values():
                    inboxes[target].put(("prefetch", rid, ()))
            raise

    def records(self) -> list[RequestRecord]:
        """A record per request, in arrival order (every request was served)."""
        bt, t0 = self.bt, self.t0
        out = []
        for rid, req in enumerate(self.requests):
            s = self.served[rid]
            arrival = t0 + req.arrival
            out.append(RequestRecord(
                req.session, req.turn, req.arrival, s.instance, s.start - t0,
                s.end - arrival, req.input_tokens, (s.local_blocks + s.migrated_blocks) * bt,
                s.loaded_blocks * bt, s.migrated_blocks,
                queue=s.start - arrival, kv_load=s.kv_load, prefill=s.prefill))
        return out
