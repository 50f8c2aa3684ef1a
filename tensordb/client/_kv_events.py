"""KV events: what a namespace's store holds, as the stream KV-aware routers read.

vLLM's engines publish their prefix cache's changes as *KV events* (ZMQ PUB, a msgpack
``KVEventBatch`` of tagged ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
events, each multipart message ``(topic, sequence number, payload)``, and an optional
ROUTER socket that replays missed batches); llm-d's KV-cache indexer and Dynamo's
router subscribe to that stream. ``db.kv(namespace, events=...)`` publishes the same
stream for the namespace's store, in the wire format of the vLLM release the project
pins (0.32: these structs decode with vLLM's own ``KVEventBatch`` decoder), so the same
routers see what the shared store holds beside what each engine's GPU holds. The
medium says where: ``CPU`` (the shared-memory arena), ``STORAGE`` (spilled to disk).

**Who publishes.** Blocks enter and leave the store in whichever process puts,
evicts or deletes, so the processes do not publish themselves: each change is written,
under the store's lock, to an event ring in the store's shared memory (the native
index's ``events.kvx``, neutral records: type, medium, key, metadata), and one process
per namespace (the *publisher*) reads the ring, encodes the wire format (spliced
natively by ``_kv_wire``) and holds the socket and the sequence numbers. Every process that opens the namespace
with ``events=`` runs a publisher thread; one of them claims the role in the store's
header, the others stand by and claim it when the holder's process is gone (the
sequence numbers go on from where it stopped). A publisher that starts, finds the ring
overwritten past what it read (it fell behind by more than the ring), or finds events
lost, sends ``AllBlocksCleared`` and then every block the store holds as
``BlockStored``: a subscriber's view is the store's contents again.

**Block metadata.** ``BlockStored`` names blocks by the engine's block hashes and
carries their token ids, parent hash and block size, which a store of bytes does not
know: ``KVCache.put(..., info=[KVBlockInfo(...), ...])`` passes them (the vLLM connector
does), and the store keeps them with the block (in its metadata) so that the
``BlockRemoved`` of an eviction hours later names the same hashes. A block put without
info is named by its store key, with no tokens.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import msgspec
import zmq

import tensordb.client._kv_wire as _kv_wire
from storage_engine import (
    EVENT_REMOVED,
    EVENT_STORED,
    MEDIUM_DISK,
    MEDIUM_HOST,
    BlockStore,
    RawEvent,
)
from tensordb.errors import InvalidInput

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVBlockInfo", "KVEventBatch",
           "KVEventPublisher", "KVEvents", "close_publisher", "encode_info", "join_meta",
           "open_publisher"]

log = logging.getLogger("tensordb.kv.events")

BlockHash = Union[bytes, int]  # noqa: UP007  (msgspec reads the annotation at runtime)

#: the media of the wire format (vLLM's MEDIUM_CPU and MEDIUM_STORAGE)
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


# -- the wire format (vLLM 0.32's vllm/distributed/kv_events.py) -----------------------
class _KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A KV event: a msgpack map tagged with its class name (``type``)."""


class BlockStored(_KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(_KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None


class AllBlocksCleared(_KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class _SplicedBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A KVEventBatch whose events are their wire bytes already (the same encoding)."""

    ts: float
    events: list[msgspec.Raw]


# -- block metadata ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KVBlockInfo:
    """What an engine knows of a block it puts, for the KV events of the store.

    ``token_ids``: the block's tokens. ``block_hashes``: the engine's hashes of the
    engine blocks it holds (one stored block may hold several engine blocks; vLLM's
    ``BlockStored`` lists them all; default: the store key). ``parent_block_hash``: the
    engine's hash of the block before the first. ``block_size``: tokens per engine
    block (default: tokens per hash). ``lora_id`` / ``lora_name``: the adapter."""

    token_ids: Sequence[int] = ()
    block_hashes: Sequence[BlockHash] = ()
    parent_block_hash: BlockHash | None = None
    block_size: int | None = None
    lora_id: int | None = None
    lora_name: str | None = None


_INFO_SEP = b"\0"
_enc = msgspec.msgpack.Encoder().encode
#: an info blob: this byte, the length of the hashes' msgpack (4 bytes, little-endian),
#: the hashes' msgpack, then the rest of a BlockStored's fields as msgpack key/value
#: pairs: the pieces of its events' wire bytes, so that the publisher splices events
#: instead of decoding and encoding each
_INFO_V1 = b"\x01"
_STORED_HEAD = b"\x88" + _enc("type") + _enc("BlockStored") + _enc("block_hashes")
_REMOVED_HEAD = b"\x83" + _enc("type") + _enc("BlockRemoved") + _enc("block_hashes")
_MEDIUM_TAIL = {MEDIUM_HOST: _enc("medium") + _enc(MEDIUM_CPU),
                MEDIUM_DISK: _enc("medium") + _enc(MEDIUM_STORAGE)}
_CLEARED = msgspec.Raw(_enc(AllBlocksCleared()))


def _rest(parent: BlockHash | None, tokens: list[int], size: int, lora_id: int | None,
          lora_name: str | None) -> bytes:
    """A BlockStored's fields past its hashes, as msgpack pairs (no map header)."""
    return _enc({"parent_block_hash": parent, "token_ids": tokens, "block_size": size,
                 "lora_id": lora_id, "lora_name": lora_name})[1:]


def encode_info(info: KVBlockInfo, what: str = "info", block_tokens: int = 0) -> bytes:
    """A block's info as the bytes the store keeps after its tensor metadata.
    InvalidInput naming the field that is wrong. ``block_tokens``: the block size when
    the info gives neither one nor tokens to count."""
    if not isinstance(info, KVBlockInfo):
        raise InvalidInput(f"{what} must be a KVBlockInfo, not {type(info).__name__}")
    try:
        tokens = [int(t) for t in info.token_ids]
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"{what}.token_ids must be integers: {exc}") from None
    hashes = list(info.block_hashes)
    for h in [*hashes, info.parent_block_hash]:
        if h is not None and (isinstance(h, bool) or not isinstance(h, (bytes, int))):
            raise InvalidInput(f"{what}: a block hash must be bytes or an int, not {h!r}")
    for name in ("block_size", "lora_id"):
        v = getattr(info, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise InvalidInput(f"{what}.{name} must be a non-negative int, not {v!r}")
    if info.lora_name is not None and not isinstance(info.lora_name, str):
        raise InvalidInput(f"{what}.lora_name must be a str, not {info.lora_name!r}")
    size = info.block_size if info.block_size is not None else \
        len(tokens) // max(1, len(hashes)) if tokens else block_tokens
    hashes_enc = _enc(hashes) if hashes else b""
    return (_INFO_V1 + len(hashes_enc).to_bytes(4, "little") + hashes_enc
            + _rest(info.parent_block_hash, tokens, size, info.lora_id, info.lora_name))


def _pieces(raw: bytes) -> tuple[bytes, bytes] | None:
    """An info blob's hashes (msgpack; b"" for none given) and the rest; None when it
    is none this version wrote."""
    if raw[:1] != _INFO_V1 or len(raw) < 5:
        return None
    n = int.from_bytes(raw[1:5], "little")
    return raw[5:5 + n], raw[5 + n:]


def join_meta(meta: bytes, info: bytes) -> bytes:
    return meta + _INFO_SEP + info if info else meta


# -- the publisher ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KVEvents:
    """Where a namespace's KV events go: ``endpoint`` (the PUB socket, bound: e.g.
    ``tcp://*:5557`` or ``ipc:///run/kv-events``), ``replay_endpoint`` (a ROUTER socket
    replaying the last ``buffer_steps`` batches from a sequence number, as vLLM's), and
    the ``topic`` of every message."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000

    @classmethod
    def of(cls, value: Any, namespace: str) -> KVEvents | None:
        """``events=`` of ``db.kv``: None, an endpoint, a mapping of these fields, or a
        KVEvents; InvalidInput naming what is wrong."""
        if value is None or isinstance(value, KVEvents):
            out = value
        elif isinstance(value, str):
            out = cls(value)
        elif isinstance(value, Mapping):
            unknown = set(value) - {"endpoint", "replay_endpoint", "topic", "buffer_steps"}
            if unknown or "endpoint" not in value:
                raise InvalidInput(f"events needs 'endpoint' and takes 'replay_endpoint', "
                                   f"'topic', 'buffer_steps'; got {sorted(value)}",
                                   collection=namespace)
            out = cls(**value)
        else:
            raise InvalidInput(f"events must be an endpoint, a mapping or KVEvents, not "
                               f"{type(value).__name__}", collection=namespace)
        if out is not None:
            for name in ("endpoint", "replay_endpoint"):
                v = getattr(out, name)
                if (v is not None or name == "endpoint") and (
                        not isinstance(v, str)
                        or not v.startswith(("tcp://", "ipc://", "inproc://"))):
                    raise InvalidInput(f"events {name} must be a tcp://, ipc:// or inproc:// "
                                       f"address, not {v!r}", collection=namespace)
            if not isinstance(out.topic, str):
                raise InvalidInput(f"events topic must be a str, not {out.topic!r}",
                                   collection=namespace)
            if isinstance(out.buffer_steps, bool) or not isinstance(out.buffer_steps, int) \
                    or out.buffer_steps < 0:
                raise InvalidInput(f"events buffer_steps must be a non-negative int, not "
                                   f"{out.buffer_steps!r}", collection=namespace)
        return out


END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    """The thread that publishes a store's KV events while this process holds the
    publisher role (see the module's docstring); standing by while another does."""

    #: events per published batch, ring bytes read per step
    BATCH_EVENTS = 1024
    READ_BYTES = 4 << 20

    def __init__(self, store: BlockStore, namespace: str, block_tokens: int,
                 config: KVEvents, *, poll_interval: float = 0.005,
                 standby_interval: float = 0.5, settle: float = 0.3) -> None:
        self.store, self.namespace, self.block_tokens = store, namespace, block_tokens
        self.config = config
        self.poll_interval, self.standby_interval = poll_interval, standby_interval
        self.settle = settle
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._final_clear = False
        self._publishing = threading.Event()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps or 1)
        self._encoder = msgspec.msgpack.Encoder()
        self._no_info = _rest(None, [], block_tokens, None, None)
        self._pieces = (_STORED_HEAD, _REMOVED_HEAD, _MEDIUM_TAIL[MEDIUM_HOST],
                        _MEDIUM_TAIL[MEDIUM_DISK], self._no_info)
        self._topic = config.topic.encode()
        self._seq = 0
        self._pos = 0
        self._lost = 0
        #: counters, for tests and tools
        self.batches = 0
        self.resyncs = 0
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"tensordb-kv-events:{namespace}")
        self._thread.start()

    @property
    def publishing(self) -> bool:
        """Whether this process holds the namespace's publisher role now."""
        return self._publishing.is_set()

    def wait_publishing(self, timeout: float) -> bool:
        return self._publishing.wait(timeout)

    def wake(self) -> None:
        """Publish now rather than at the next poll (a put of this process calls it: its
        events go out at once; other processes' wait for the poll, every 5 ms)."""
        if self._publishing.is_set():
            self._wake.set()

    def _sleep(self, seconds: float) -> None:
        self._wake.wait(seconds)
        self._wake.clear()

    def close(self, *, cleared: bool = False) -> None:
        """Stop the thread, give up the role (another process may claim it).
        ``cleared``: the namespace is being destroyed: say so (AllBlocksCleared) first."""
        self._final_clear = cleared
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._unbind()
        if self._publishing.is_set():
            self._publishing.clear()
            try:
                self.store.events_release()
            except Exception:  # noqa: BLE001  (the store may be closed already)
                log.debug("KV events of %r: release failed", self.namespace, exc_info=True)

    # -- the loop ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._publishing.is_set():
                    if not self._take_role():
                        self._sleep(self.standby_interval)
                    continue
                if not self._step():
                    self._sleep(self.poll_interval)
                self._serve_replay()
            except Exception:  # noqa: BLE001  (keep publishing; say why it stuttered)
                log.exception("KV events of %r: the publisher failed; retrying",
                              self.namespace)
                self._sleep(self.standby_interval)
        if self._publishing.is_set():
            try:
                if self._final_clear:
                    self._send([_CLEARED])
                else:
                    self._step()  # what happened up to the close
            except Exception:  # noqa: BLE001
                log.debug("KV events of %r: last step failed", self.namespace, exc_info=True)

    def _take_role(self) -> bool:
        got = self.store.events_claim()
        if got is None:
            return False
        try:
            self._bind()
        except zmq.ZMQError as exc:  # the address is taken (another publisher's?)
            log.warning("KV events of %r: cannot bind %s: %s", self.namespace,
                        self.config.endpoint, exc)
            self.store.events_release()
            self._unbind()
            return False
        snap, self._pos, self._lost, self._seq = got
        self._publishing.set()
        # subscribers of a publisher that died reconnect every 100 ms (ZMQ's default):
        # give them time to, so that they see the announcement
        self._stop.wait(self.settle)
        self._announce(snap)
        return True

    def _resync(self) -> None:
        """Everything afresh: AllBlocksCleared, then every block the store holds."""
        got = self.store.events_claim()
        if got is None:  # another process took the role meanwhile
            self._lose_role()
            return
        snap, self._pos, self._lost, _ = got
        self._announce(snap)

    def _announce(self, snap: list[RawEvent]) -> None:
        self.resyncs += 1
        events: list[msgspec.Raw] = [_CLEARED]
        events.extend(self._event(e) for e in snap)
        self._send(events)

    def _step(self) -> bool:
        """Publish what the ring holds since the last step, a batch at a time: the
        store's neutral records spliced into wire bytes natively (``_kv_wire``) from
        each block's info; False when it held nothing."""
        sent = False
        while True:
            got = self.store.events_take(self._pos, self.BATCH_EVENTS, self._seq)
            if got is None:
                self._lose_role()
                return sent
            records, _, pos, lost, overrun = got
            spliced = _kv_wire.splice(records, *self._pieces)
            if spliced is None:  # records that break the layout: as an overrun
                overrun = True
                spliced = (b"", 0, False)
            wire, count, cleared = spliced
            if overrun or lost != self._lost or cleared:
                self._resync()
                return True
            self._pos = pos
            if not count:
                return sent
            self._send_wire(wire)
            sent = True
            if count < self.BATCH_EVENTS:
                self.store.events_read(self._pos, 0, self._seq)  # keep the sequence
                return True

    def _lose_role(self) -> None:
        self._publishing.clear()
        self._unbind()

    # -- events on the wire ----------------------------------------------------------
    def _event(self, raw: RawEvent) -> msgspec.Raw:
        """An event's wire bytes, spliced from the pieces its block's info keeps (a
        block without info: named by its key, no tokens, the namespace's block size)."""
        kind, medium, key, meta = raw
        pieces = _pieces(meta.partition(_INFO_SEP)[2])
        if pieces is None:
            hashes, rest = _enc([key]), self._no_info
        else:
            hashes, rest = pieces[0] or _enc([key]), pieces[1]
        if kind == EVENT_REMOVED:
            return msgspec.Raw(_REMOVED_HEAD + hashes + _MEDIUM_TAIL[medium])
        assert kind == EVENT_STORED, kind
        return msgspec.Raw(_STORED_HEAD + hashes + rest + _MEDIUM_TAIL[medium])

    def _send_wire(self, events: bytes) -> None:
        """One batch whose events are a msgpack array already."""
        assert self._pub is not None
        payload = b"\x92" + self._encoder.encode(time.time()) + events
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.batches += 1

    def _send(self, events: list[msgspec.Raw]) -> None:
        assert self._pub is not None
        for lo in range(0, len(events), self.BATCH_EVENTS):
            payload = self._encoder.encode(_SplicedBatch(
                ts=time.time(), events=events[lo:lo + self.BATCH_EVENTS]))
            seq = self._seq
            self._seq += 1
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self.batches += 1
        # the sequence number goes into the store's header at once: a publisher that
        # takes over after this one dies goes on from there
        self.store.events_read(self._pos, 0, self._seq)

    # -- sockets -----------------------------------------------------------------------
    def _bind(self) -> None:
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.set_hwm(100_000)
        self._pub = pub
        pub.bind(self.config.endpoint)
        if self.config.replay_endpoint is not None:
            rep = self._ctx.socket(zmq.ROUTER)
            rep.setsockopt(zmq.LINGER, 0)
            self._replay = rep
            rep.bind(self.config.replay_endpoint)

    def _unbind(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None

    def _serve_replay(self) -> None:
        """Answer replay requests (a start sequence number, 8 bytes big-endian) with the
        buffered batches from there, then the end marker: as vLLM's publisher does."""
        rep = self._replay
        while rep is not None and rep.poll(0):
            frames = rep.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in self._buffer:
                if seq >= first:
                    rep.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"),
                                        payload))
            rep.send_multipart((client, b"", b"", END_SEQ, b""))


# -- one publisher per store and process ------------------------------------------------
_lock = threading.Lock()
_publishers: dict[int, tuple[KVEventPublisher, int]] = {}


def open_publisher(store: BlockStore, namespace: str, block_tokens: int,
                   config: KVEvents) -> KVEventPublisher:
    """This process's publisher thread for ``store`` (shared by its KVCaches: a second
    thread reading the same ring would publish every event twice). InvalidInput when
    one runs already with another endpoint."""
    with _lock:
        got = _publishers.get(id(store))
        if got is not None:
            pub, n = got
            if pub.config != config:
                raise InvalidInput(f"KV namespace {namespace!r} publishes its events to "
                                   f"{pub.config.endpoint} in this process already, not "
                                   f"{config.endpoint}", collection=namespace)
            _publishers[id(store)] = (pub, n + 1)
            return pub
        pub = KVEventPublisher(store, namespace, block_tokens, config)
        _publishers[id(store)] = (pub, 1)
        return pub


def close_publisher(store: BlockStore, *, cleared: bool = False) -> None:
    """Let go of one use of this process's publisher of ``store``; the last stops it
    (``cleared``: the store is being destroyed, which it announces)."""
    with _lock:
        got = _publishers.get(id(store))
        if got is None:
            return
        pub, n = got
        if n > 1:
            _publishers[id(store)] = (pub, n - 1)
            return
        del _publishers[id(store)]
    pub.close(cleared=cleared)
