"""A router's view of a KV-event stream: which blocks a store (or an engine) holds.

``KVEventIndex`` subscribes to a ZMQ PUB socket of KV events (a namespace's stream from
``db.kv(..., events=...)``, or a vLLM engine's own ``--kv-events-config`` stream: the
same wire format) and keeps the set of block hashes each medium holds, on a thread of
its own. A gap in the sequence numbers is filled from the publisher's replay socket
when there is one; otherwise (or when the replay no longer has them) the view is
``stale`` until the publisher's next ``AllBlocksCleared``, which starts it afresh.
``prefix_hits`` is the routing question: how many leading blocks of a request it holds.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence

import msgspec
import zmq

from tensordb.client import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

__all__ = ["KVEventIndex"]

_END_SEQ = -1


class KVEventIndex:
    """The blocks a KV-event stream says are held, by medium (``CPU``, ``STORAGE``,
    ``GPU``, ...)."""

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None,
                 topic: str = "") -> None:
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._lock = threading.Lock()
        self._held: dict[str | None, set[Hashable]] = {}
        #: the last sequence number applied (-1: none yet); batches and events seen
        self.seq = -1
        self.batches = 0
        self.events = 0
        self.clears = 0
        #: a gap could not be filled: the view may be wrong until the next clear
        self.stale = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="tensordb-kv-event-index")
        self._thread.start()

    # -- the questions -----------------------------------------------------------------
    def holds(self, block_hash: Hashable, medium: str | None = None) -> bool:
        with self._lock:
            if medium is not None:
                return block_hash in self._held.get(medium, ())
            return any(block_hash in s for s in self._held.values())

    def prefix_hits(self, hashes: Sequence[Hashable], medium: str | None = None) -> int:
        """How many leading ``hashes`` are held (in ``medium``, or in any)."""
        n = 0
        with self._lock:
            sets = [self._held.get(medium, set())] if medium is not None \
                else list(self._held.values())
            for h in hashes:
                if not any(h in s for s in sets):
                    break
                n += 1
        return n

    def blocks(self, medium: str | None = None) -> set[tuple[Hashable, str | None]]:
        """Every (hash, medium) held (of ``medium`` only, when given)."""
        with self._lock:
            return {(h, m) for m, s in self._held.items() if medium in (None, m) for h in s}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sub.close(linger=0)

    def __enter__(self) -> KVEventIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the stream --------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(100):
                continue
            frames = self._sub.recv_multipart()
            if len(frames) != 3:
                continue
            _, seq_b, payload = frames
            seq = int.from_bytes(seq_b, "big", signed=True)
            if self.seq >= 0 and seq > self.seq + 1 and not self._replay(self.seq + 1, seq):
                self.stale = True
            if seq <= self.seq:  # a duplicate (replayed meanwhile)
                continue
            self._apply(seq, payload)

    def _replay(self, first: int, upto: int) -> bool:
        """Batches first..upto-1 from the replay socket; whether all came."""
        if self.replay_endpoint is None:
            return False
        req = self._ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        try:
            req.connect(self.replay_endpoint)
            req.send_multipart((b"", first.to_bytes(8, "big")))
            want = first
            while req.poll(2000):
                _, _, seq_b, payload = req.recv_multipart()
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq == _END_SEQ:
                    break
                if want <= seq < upto:
                    if seq != want:
                        return False
                    self._apply(seq, payload)
                    want += 1
            return want == upto
        finally:
            req.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        batch = self._decoder.decode(payload)
        with self._lock:
            for e in batch.events:
                if isinstance(e, AllBlocksCleared):
                    self._held.clear()
                    self.stale = False
                    self.clears += 1
                elif isinstance(e, BlockStored):
                    held = self._held.setdefault(e.medium, set())
                    held.update(_hashable(h) for h in e.block_hashes)
                elif isinstance(e, BlockRemoved):
                    held = self._held.setdefault(e.medium, set())
                    held.difference_update(_hashable(h) for h in e.block_hashes)
            self.events += len(batch.events)
            self.batches += 1
            self.seq = seq


def _hashable(h: object) -> Hashable:
    return bytes(h) if isinstance(h, (bytes, bytearray, memoryview)) else h  # type: ignore[return-value]
