"""One toy engine instance: the tiny model, a bounded local KV cache in front of the
shared tensordb KV store.

A request's time to first token is made of real work here::

    TTFT = queueing (FIFO, one prefill at a time)
         + KV load  (the leading blocks: the local cache, blocks migrated here, then
                     the store's ``match`` + ``get_into``)
         + prefill  (the model computing the uncached suffix and the first token)

and the new full blocks go into the local cache and (``use_store``) the store, where
any instance can load them. :class:`ToyEngine` does that work in the calling thread
(tests and calibration use it directly); ``_instance.instance_main`` runs one in a
process of its own, taking jobs and control messages from the router (``_cluster``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import tensordb
from tensordb.errors import InvalidInput

from ._model import ModelConfig, TinyDecoder, split_blocks

__all__ = ["Job", "LocalCache", "Served", "ToyEngine", "ToyEngineConfig", "clock",
           "open_kv"]

clock = time.monotonic  # one system-wide clock: the router and instances compare stamps


@dataclass(frozen=True, slots=True)
class ToyEngineConfig:
    """What every instance of a run shares. ``cache_blocks``: the local cache's
    capacity in blocks; ``use_store``: look up and save every request's blocks in the
    shared store (otherwise the store only carries migrations); ``threads``: torch
    threads per instance."""

    model: ModelConfig = field(default_factory=ModelConfig)
    block_tokens: int = 32
    cache_blocks: int = 128
    namespace: str = "router-kv"
    use_store: bool = True
    store_bytes: int = 512 << 20
    threads: int = 1

    def __post_init__(self) -> None:
        for name in ("block_tokens", "store_bytes", "threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidInput(f"toy engine config {name} must be a positive int, not {v!r}")
        if isinstance(self.cache_blocks, bool) or not isinstance(self.cache_blocks, int) \
                or self.cache_blocks < 0:
            raise InvalidInput(f"toy engine config cache_blocks must be an int >= 0, not "
                               f"{self.cache_blocks!r}")

    @property
    def block_nbytes(self) -> int:
        return self.model.block_nbytes(self.block_tokens)


class LocalCache:
    """An instance's bounded LRU of KV blocks, ``key -> tensor``, thread-safe.

    A request *reserves* all its full blocks when its prefill starts (so the router's
    view of the instance counts them from then on, as the simulator does) and *fills*
    them when they are computed. Blocks a request touches are ordered tail first, so
    under pressure a prompt's last blocks go before its first (vLLM's free-queue order,
    and the simulator's)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._d: OrderedDict[bytes, torch.Tensor | None] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._d)

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._d)

    def lookup(self, keys: Sequence[bytes]) -> list[torch.Tensor]:
        """The tensors of the leading keys held and filled (a prefix of ``keys``)."""
        out = []
        with self._lock:
            for k in keys:
                t = self._d.get(k)
                if t is None:
                    break
                out.append(t)
        return out

    def held(self, keys: Sequence[bytes]) -> list[tuple[bytes, torch.Tensor]]:
        """``(key, tensor)`` for each of ``keys`` held and filled, in order."""
        with self._lock:
            return [(k, t) for k in keys if (t := self._d.get(k)) is not None]

    def reserve(self, keys: Sequence[bytes]) -> tuple[list[bytes], list[bytes]]:
        """Make ``keys`` the most recent entries (new ones unfilled), evict beyond
        capacity; returns ``(added, evicted)``: the summary's change."""
        added: list[bytes] = []
        evicted: list[bytes] = []
        with self._lock:
            d = self._d
            for k in reversed(keys):
                if k in d:
                    d.move_to_end(k)
                else:
                    d[k] = None
                    added.append(k)
            while len(d) > self.capacity:
                evicted.append(d.popitem(last=False)[0])
        gone = set(evicted)
        return [k for k in added if k not in gone], [k for k in evicted if k not in added]

    def fill(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> None:
        with self._lock:
            for k, b in zip(keys, blocks, strict=True):
                if k in self._d:
                    self._d[k] = b

    def clear(self) -> None:
        with self._lock:
            self._d.clear()


@dataclass(frozen=True, slots=True)
class Job:
    """One request for an instance: its prompt's token ids and full-block keys.
    ``migrated``: the router moves blocks here first; the prefill waits for them."""

    rid: int
    tokens: np.ndarray
    keys: tuple[bytes, ...]
    arrival: float
    migrated: bool = False


@dataclass(frozen=True, slots=True)
class Served:
    """What an instance did for a request (times from :data:`clock`, durations in
    seconds; counts in blocks)."""

    rid: int
    instance: int
    start: float
    end: float            # the first token is out
    kv_load: float
    prefill: float
    local_blocks: int     # leading blocks from the local cache
    migrated_blocks: int  # further blocks moved here by the router
    loaded_blocks: int    # further blocks loaded from the store
    computed_tokens: int
    saved_blocks: int     # blocks of this request the store lacked, handed to it
    first_token: int


class ToyEngine:
    """The model, a local cache and (optionally) the shared store ``kv``
    (``db.kv(...)``, see :func:`open_kv`). Methods run in the calling thread and may
    take as long as the model does; ``serve`` must not run in two threads at once,
    ``publish`` and ``prefetch`` may run beside it."""

    def __init__(self, cfg: ToyEngineConfig, kv: Any | None = None, instance: int = 0,
                 model: TinyDecoder | None = None) -> None:
        if cfg.use_store and kv is None:
            raise InvalidInput("a toy engine with use_store needs a KV store (db.kv(...))")
        self.cfg = cfg
        self.kv = kv
        self.instance = instance
        self.model = model or TinyDecoder(cfg.model)
        self.cache = LocalCache(cfg.cache_blocks)
        self._shape = cfg.model.block_shape(cfg.block_tokens)
        self._moved: dict[int, dict[bytes, torch.Tensor]] = {}
        self._saves: queue.Queue[tuple[list[bytes], list[torch.Tensor]] | None] | None = None
        self._saver: threading.Thread | None = None

    def start_saver(self) -> None:
        """Save new blocks to the store from a thread of their own, as real engines
        offload KV beside the forward pass: the next prefill need not wait for the
        store."""
        if self._saver is None and self.kv is not None:
            self._saves = queue.Queue()
            self._saver = threading.Thread(target=self._save_loop, name="kv-saver",
                                           daemon=True)
            self._saver.start()

    def _save_loop(self) -> None:
        assert self._saves is not None
        while (item := self._saves.get()) is not None:
            try:
                self.kv.put(*item)
            except Exception:  # a full store is a miss for later readers, not a failure
                pass
            finally:
                self._saves.task_done()
        self._saves.task_done()

    def flush(self) -> None:
        """Wait until every block handed to the saver is in the store."""
        if self._saves is not None:
            self._saves.join()

    def stop_saver(self) -> None:
        if self._saver is not None and self._saves is not None:
            self._saves.put(None)
            self._saver.join()
            self._saver = self._saves = None

    def serve(self, job: Job, on_start: Callable[[list[bytes], list[bytes]], None]
              | None = None) -> Served:
        """Prefill ``job``'s prompt with every block it can load, returning when the
        first token is out (the new blocks are then saved: to the local cache at once,
        to the store before returning, or by the saver thread if it runs).
        ``on_start(added, evicted)`` is told the local cache's change as the prefill
        starts."""
        bt = self.cfg.block_tokens
        start = clock()
        keys = list(job.keys)
        if len(job.tokens) // bt != len(keys):
            raise InvalidInput(f"request {job.rid}: {len(keys)} block keys for "
                               f"{len(job.tokens)} tokens in blocks of {bt}")
        past = self.cache.lookup(keys)
        n_local = len(past)
        moved = self._moved.pop(job.rid, {})
        while len(past) < len(keys) and keys[len(past)] in moved:
            past.append(moved[keys[len(past)]])
        n_moved = len(past) - n_local
        n_loaded = 0
        if self.cfg.use_store and len(past) < len(keys):
            n_store = self.kv.match(keys)
            if n_store > len(past):
                want = keys[len(past):n_store]
                bufs = [torch.empty(self._shape) for _ in want]
                self.kv.get_into(want, bufs)
                past.extend(bufs)
                n_loaded = len(want)
        added, evicted = self.cache.reserve(keys)
        if on_start is not None:
            on_start(added, evicted)
        t_kv = clock()
        nb = len(past)
        if nb * bt == len(job.tokens):  # the whole prompt is cached: recompute its last
            nb -= 1                     # block, whose last token gives the first output
        tokens = torch.from_numpy(np.ascontiguousarray(job.tokens[nb * bt:], np.int64))
        logits, kv_new = self.model.prefill(tokens, torch.stack(past[:nb]) if nb else None)
        first = int(logits.argmax())
        end = clock()
        blocks = past[:nb] + split_blocks(kv_new, nb * bt, bt)
        self.cache.fill(keys, blocks)
        saved = 0
        lo = n_local + n_moved + n_loaded
        if self.cfg.use_store and lo < len(keys):
            if self._saves is not None:
                self._saves.put((keys[lo:], blocks[lo:]))
                saved = len(keys) - lo
            else:
                saved = self.kv.put(keys[lo:], blocks[lo:])
        return Served(job.rid, self.instance, start, end, t_kv - start, end - t_kv, n_local,
                      n_moved, n_loaded, len(tokens), saved, first)

    def publish(self, keys: Sequence[bytes]) -> int:
        """Put the blocks of ``keys`` this instance holds into the store (those it
        already has stay as they are); returns how many the store newly took."""
        held = self.cache.held(keys)
        if not held or self.kv is None:
            return 0
        present = self.kv.contains([k for k, _ in held])
        todo = [(k, t) for (k, t), p in zip(held, present, strict=True) if not p]
        return self.kv.put([k for k, _ in todo], [t for _, t in todo]) if todo else 0

    def prefetch(self, rid: int, keys: Sequence[bytes]) -> int:
        """Load the leading run of ``keys`` the store holds into buffers kept for
        request ``rid`` (its prefill adopts them); returns how many blocks."""
        n = self.kv.match(list(keys)) if self.kv is not None and keys else 0
        bufs = [torch.empty(self._shape) for _ in range(n)]
        if n:
            self.kv.get_into(list(keys[:n]), bufs)
        self._moved[rid] = dict(zip(keys[:n], bufs, strict=True))
        return n

    def discard(self, rid: int) -> None:
        """Drop the blocks prefetched for request ``rid`` (one that will not come)."""
        self._moved.pop(rid, None)

    def reset(self) -> None:
        """Forget every block held here (a new run starts)."""
        self.flush()
        self.cache.clear()
        self._moved.clear()


def open_kv(db: tensordb.Database, cfg: ToyEngineConfig) -> tensordb.KVCache:
    """The shared store of ``cfg``'s namespace (memory only: a block the arena cannot
    hold is evicted, not spilled; the toy engine's blocks are cheaper to recompute than
    to read from disk)."""
    return db.kv(cfg.namespace, cfg.block_tokens, capacity_bytes=cfg.store_bytes,
                 slab_bytes=min(cfg.store_bytes, 16 << 20), spill=False)
