"""Node-to-node transport benchmark: cluster mode on loopback, real node servers.

What it measures (one throwaway PostgreSQL catalog, node servers as processes):

* ``tcp``: the physical limit of this host's loopback, same run: a sender process writes
  ``--gib`` GiB from a buffer into a plain TCP socket; this process ``recv_into``s them
  straight into a shared-memory file allocated and faulted in before the clock starts
  (as a node's spare is), with the receive buffer the data plane asks for (4 MiB).
  GB/s, best of ``--reps``;
* ``memcpy``: numpy copy of the same bytes (the ceiling under both);
* ``bare Flight``: a Flight server that only streams a shared-memory file the way a node
  serves a segment, and a client that copies and hashes each chunk into pre-faulted
  memory: the ceiling of Flight itself on this host, which is why segment bytes take the
  data plane (``transport._dataplane``) and Flight only the control;
* ``transfer``: node b is told (Flight action ``pull``) to fetch a ``--gib`` GiB segment
  node a wrote: its bytes over the data plane (a TCP stream from a's mapping straight
  into b's host tier), every extent's xxh3 checked as it lands, the replica registered
  in the catalog. Timed by the caller from request to
  answer; best of ``--reps``; the goal is >= 0.9 x raw TCP. Shown as the default
  (parallel byte-range streams, $TENSORDB_PULL_STREAMS) and as one stream;
* ``plain Flight``: what any Arrow Flight client gets (docs/arrow.md, "Flight"): a fresh
  process that imports only pyarrow runs ``fl.FlightClient(address).do_get(ticket)
  .read_all()`` for the ``--gib`` GiB version node a serves, ticket
  ``{"collection": "big", "version": 1}``, with the token and no channel options, as a
  user would. GB/s, best of ``--reps`` in that process; the goal is >= 0.5 x raw TCP.
  Where the bytes are copied: the node puts each tensor's slice of the segment's mapping
  into gRPC as a slice that references it (no copy in the node's process), and the
  kernel copies it into the socket, as raw TCP's sender does; on the client the kernel
  copies it into gRPC's receive slices, and gRPC then gathers a message's slices into
  one contiguous buffer (``grpc_byte_buffer_reader_readall``, called by Arrow's
  ``FlightDataDeserialize``) that the Arrow table points at: one user-space copy more
  than raw TCP, plus HTTP/2 framing and flow control. Bare Flight above does the same
  and then copies and hashes into a spare. Every extent passes the integrity gate
  (docs/storage.md, "Integrity model") on the way: a look at the marks per segment and
  per batch. Beside it, its ceiling: the same reader against a bare Flight server that
  streams the same bytes from a mapping in batches of one tensor (64 MiB) and of 4 MiB,
  no catalog, lease or gate. The client's gathering buffer is its ``malloc`` of the
  message's size, which glibc maps afresh (page faults) for every message over 32 MiB
  and reuses below: that, not the node, bounds a version of 64 MiB tensors;
* ``fan-out``: ``--fanout-mib`` MiB from a to ``--targets`` nodes, (a) as the cascade of
  ``db.replicate`` (every holder serves one more node per round: ceil(log2(N+1))
  rounds), (b) one source sending to each target in turn (what a user scripting
  ``scp``-like copies from the writer would do). Seconds, best of ``--reps``.

Receiving nodes run with ``tensordb serve --spare-bytes`` (a pre-faulted spare for
incoming replicas) and each timed transfer waits until their spares are refilled: the
TCP baseline's destination is likewise allocated and faulted in before its clock starts.

All processes share this host's cores: on a machine with few of them, the cascade's
parallel rounds compete for the same CPUs, so its gain over one source understates what
separate hosts would see (each has its own NIC and cores).

Run:  .venv/bin/python -m benchmarks.transfer [--gib 1] [--fanout-mib 512] [--targets 4]
      [--reps 3] [--json] [--plain-only]

``--plain-only``: raw TCP, the plain Flight read and its ceilings only (node a alone).
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

import benchmarks
import storage_engine as se
import tensordb
from benchmarks import _common, _verdict
from tensordb.catalog import NodeDirectory
from transport import DEFAULT_STREAMS, FlightTransport

GB = 1e9
MiB = 1 << 20
GOAL_VS_TCP = 0.9
GOAL_PLAIN_VS_TCP = 0.5
TOKEN = "bench-token-0123456789"  # 16 characters at least: a node refuses a weak one
PG_SERVER = os.environ.get("TENSORDB_BENCH_PG", "postgres@127.0.0.1:5432")


# -- raw TCP, the physical limit ---------------------------------------------------------
def tcp_sender(port: int, nbytes: int, reps: int) -> None:
    """Child: send ``nbytes`` ``reps`` times, each after a one-byte request."""
    data = np.ones(nbytes, np.uint8)
    with socket.create_connection(("127.0.0.1", port)) as s:
        for _ in range(reps):
            s.recv(1)
            s.sendall(memoryview(data))


def measure_tcp(nbytes: int, reps: int, shm: str) -> list[float]:
    """Seconds per ``nbytes`` received over loopback into a shared-memory file faulted in
    beforehand."""
    with socket.socket() as ls:
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * MiB)  # inherited by conn
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        child = subprocess.Popen(benchmarks.command(__spec__.name, "--tcp-sender",
                                                    str(ls.getsockname()[1]), str(nbytes),
                                                    str(reps)), env=benchmarks.child_env())
        conn, _ = ls.accept()
    times = []
    with conn:
        for i in range(reps):
            path = os.path.join(shm, f"tcp-{i}")
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
            os.posix_fallocate(fd, 0, nbytes)
            mm = mmap.mmap(fd, nbytes)
            os.close(fd)
            np.frombuffer(mm, np.uint8)[:: mmap.PAGESIZE] = 0  # faulted in, as a spare is
            view = memoryview(mm)
            t0 = time.perf_counter()
            conn.send(b"g")
            pos = 0
            while pos < nbytes:
                got = conn.recv_into(view[pos:])
                if not got:
                    raise RuntimeError("the sender hung up")
                pos += got
            times.append(time.perf_counter() - t0)
            view.release()
            mm.close()
            os.unlink(path)
    child.wait()
    return times


# -- bare Flight, the ceiling of the transport itself --------------------------------------
def flight_sender(path: str, chunk: int | None = None) -> None:
    """Child: serve the file at ``path`` over Flight as the node server's segment stream
    does (same schema, same 4 MiB chunks of a copy-on-write mapping; ``chunk``: bytes a
    batch instead), nothing else; print the port."""
    import pyarrow.flight as fl

    from transport._flight_client import SEGMENT_SCHEMA, chunk_batch
    from transport._flight_server import CHUNK_BYTES

    step = chunk or CHUNK_BYTES

    class Bare(fl.FlightServerBase):  # type: ignore[misc]
        def do_get(self, context: Any, ticket: Any) -> Any:
            with open(path, "rb") as fh:
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
            view = memoryview(mm)
            return fl.GeneratorStream(SEGMENT_SCHEMA, (
                chunk_batch(view[lo : lo + step]) for lo in range(0, len(view), step)))

    server = Bare("grpc+tcp://127.0.0.1:0")
    print(server.port, flush=True)
    server.serve()


def measure_flight(nbytes: int, reps: int, shm: str) -> list[float]:
    """Seconds per ``nbytes`` pulled by a bare Flight ``do_get`` (the client's channel
    options) into a shared-memory file faulted in beforehand, each chunk copied and
    hashed as a pull does: no catalog, no ping, no replica to register."""
    import pyarrow.flight as fl
    import xxhash

    from transport._flight_client import CHANNEL_OPTIONS

    src = os.path.join(shm, "flight-src")
    with open(src, "wb") as fh:
        fh.write(np.random.default_rng(0).integers(0, 255, nbytes, np.uint8).tobytes())
    child = subprocess.Popen(benchmarks.command(__spec__.name, "--flight-sender", src),
                             stdout=subprocess.PIPE, text=True, env=benchmarks.child_env())
    times = []
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        client = fl.FlightClient(f"grpc+tcp://127.0.0.1:{port}",
                                 generic_options=CHANNEL_OPTIONS)
        dst = np.zeros(nbytes, np.uint8)  # faulted in, as a spare is
        for _ in range(reps):
            t0 = time.perf_counter()
            reader = client.do_get(fl.Ticket(b"all"))
            pos = 0
            h = xxhash.xxh3_64()
            while True:
                try:
                    chunk = reader.read_chunk()
                except StopIteration:
                    break
                buf = np.frombuffer(chunk.data.column(0).buffers()[2], np.uint8)
                out = dst[pos : pos + len(buf)]
                np.copyto(out, buf)
                h.update(out)
                pos += len(buf)
            times.append(time.perf_counter() - t0)
            assert pos == nbytes
        client.close()
    finally:
        child.kill()
        child.wait()
        os.unlink(src)
    return times


# -- a plain Flight client, as a user runs it -----------------------------------------------
# Runs with -I and the tensordb packages blocked: only pyarrow, as on a host without them.
PLAIN_READER = """
import json, sys, time
BLOCKED = {"tensordb", "storage_engine", "transport", "torch"}
class Block:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ImportError(name)
sys.meta_path.insert(0, Block)
import pyarrow.flight as fl
address, token, ticket, reps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
options = fl.FlightCallOptions(headers=[(b"authorization", f"Bearer {token}".encode())])
client = fl.FlightClient(f"grpc+tcp://{address}")
times, nbytes = [], 0
for _ in range(reps):
    t0 = time.perf_counter()
    table = client.do_get(fl.Ticket(ticket.encode()), options).read_all()
    times.append(time.perf_counter() - t0)
    data = table.column("data")
    nbytes = sum(len(data.chunk(i).buffers()[2] or b"") for i in range(data.num_chunks))
    del table, data
print(json.dumps({"seconds": times, "bytes": nbytes,
                  "leaked": sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)}))
"""


def measure_plain_flight(address: str, collection: str, version: int, reps: int,
                         nbytes: int) -> list[float]:
    """Seconds per whole-version ``do_get(...).read_all()`` from a fresh pyarrow-only
    process (best of ``reps`` there: the first includes the connection)."""
    ticket = json.dumps({"collection": collection, "version": version})
    out = subprocess.run([sys.executable, "-I", "-c", PLAIN_READER, address, TOKEN, ticket,
                          str(reps)], capture_output=True, text=True, check=True, cwd="/")
    res = json.loads(out.stdout)
    assert res["leaked"] == [], res["leaked"]
    assert res["bytes"] == nbytes, (res["bytes"], nbytes)
    return [float(t) for t in res["seconds"]]


def measure_plain_ceiling(nbytes: int, reps: int, shm: str, batch: int) -> list[float]:
    """The plain reader's ``read_all()`` against a bare Flight server streaming the same
    bytes in batches of ``batch`` bytes (``TENSOR_BYTES``: one version tensor each) from
    a mapping, with no catalog, lease or integrity gate: what pyarrow's client makes of
    such a stream on this host (the bound of the node's figure)."""
    src = os.path.join(shm, "plain-src")
    with open(src, "wb") as fh:
        fh.write(np.random.default_rng(1).integers(0, 255, nbytes, np.uint8).tobytes())
    child = subprocess.Popen(benchmarks.command(__spec__.name, "--flight-sender", src,
                                                str(batch)),
                             stdout=subprocess.PIPE, text=True, env=benchmarks.child_env())
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        return measure_plain_flight(f"127.0.0.1:{port}", "bare", 0, reps, nbytes)
    finally:
        child.kill()
        child.wait()
        os.unlink(src)


# -- node servers -------------------------------------------------------------------------
Nodes = dict[str, tuple[subprocess.Popen[str], str]]  # name -> (process, address)


def start_nodes(url: str, root: str, names: list[str], spare: dict[str, int]) -> Nodes:
    """Node servers; ``spare``: the pre-faulted spare each receiving node keeps."""
    procs = {}
    for n in names:
        cmd = [sys.executable, "-m", "tensordb.cli", "--home", f"{root}/{n}", "serve",
               "--catalog", url, "--node", n, "--data-dir", f"{root}/{n}/data", "--port", "0",
               "--token", TOKEN, "--spare-bytes", str(spare.get(n, 0))]
        procs[n] = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    out = {}
    deadline = time.monotonic() + 300
    for n, p in procs.items():
        assert p.stdout is not None
        while True:
            if time.monotonic() > deadline or p.poll() is not None:
                raise RuntimeError(f"node {n} did not start")
            if select.select([p.stdout], [], [], 1.0)[0]:
                out[n] = (p, json.loads(p.stdout.readline())["address"])
                break
    return out


def await_spares(client: FlightTransport, nodes: Nodes, names: list[str], need: int,
                 timeout: float = 120.0) -> None:
    """Wait until each of ``names`` has a pre-faulted spare of ``need`` bytes again (the
    node refills it in the background after a pull used it), as the TCP baseline's
    destination is faulted in before its clock starts."""
    deadline = time.monotonic() + timeout
    for n in names:
        while client.ping(n, nodes[n][1]).get("spare_ready", 0) < need:
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {n} did not refill its spare in {timeout:g} s")
            time.sleep(0.05)


def stop_nodes(nodes: Nodes) -> None:
    for p, _ in nodes.values():
        p.terminate()
    for p, _ in nodes.values():
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def forget(directory: NodeDirectory, root: str, url: str, segment: str, nodes: list[str]) -> None:
    """Remove ``nodes``' replicas of ``segment`` (row, then file), to time a transfer again."""
    for n in nodes:
        directory.drop_replica(segment, n)
        cfg = tensordb.Config.resolve(url, home=f"{root}/{n}", data_dir=f"{root}/{n}/data")
        for tier in (cfg.shm_dir, cfg.data_dir):
            try:
                os.unlink(os.path.join(tier, f"{segment}.seg"))
            except FileNotFoundError:
                pass


#: the size of each tensor of the versions committed (``commit_bytes``)
TENSOR_BYTES = 64 * MiB


def commit_bytes(db: tensordb.Database, collection: str, nbytes: int) -> str:
    """Commit ``nbytes`` of float32 tensors (64 MiB each); returns the segment id."""
    each = TENSOR_BYTES
    tensors = {f"layer.{i:04d}": torch.rand(min(each, nbytes - i * each) // 4)
               for i in range(math.ceil(nbytes / each))}
    db.commit(collection, tensors)
    directory = NodeDirectory(db.catalog.engine)
    (seg,) = [s for s, _ in directory.version_segments(db.catalog.require(collection).id, 1)]
    return seg


def run(args: argparse.Namespace) -> dict[str, Any]:
    nbytes = int(args.gib * (1 << 30))
    fan_bytes = args.fanout_mib * MiB
    res: dict[str, Any] = {"bytes": nbytes, "fanout_bytes": fan_bytes, "targets": args.targets,
                           "reps": args.reps, "cpus": os.cpu_count()}
    res.update(_common.measure_memcpy(nbytes, 2))
    shm = tempfile.mkdtemp(prefix="tensordb-bench-tcp-", dir="/dev/shm")
    try:
        res["tcp_s"] = measure_tcp(nbytes, args.reps, shm)
        if not args.plain_only:
            res["flight_bare_s"] = measure_flight(nbytes, args.reps, shm)
        res["plain_ceiling_s"] = measure_plain_ceiling(nbytes, args.reps, shm, TENSOR_BYTES)
        res["plain_ceiling_4mib_s"] = measure_plain_ceiling(nbytes, args.reps, shm, 4 * MiB)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    if args.plain_only:
        return run_plain(args, res)
    targets = [f"t{i}" for i in range(1, args.targets + 1)]
    spares = {"b": se.HostTier.spare_for(nbytes),
              **{t: se.HostTier.spare_for(fan_bytes) for t in targets}}
    with node_cluster(res, ["a", "b", *targets], spares) as (url, root, nodes, a):
        directory = NodeDirectory(a.catalog.engine)
        client = FlightTransport(TOKEN, timeout=30)
        seg = commit_bytes(a, "big", nbytes)
        res["transfer_s"], res["transfer_1stream_s"] = [], []
        for _ in range(args.reps):
            for key, streams in (("transfer_s", None), ("transfer_1stream_s", 1)):
                forget(directory, root, url, seg, ["b"])
                await_spares(client, nodes, ["b"], nbytes)
                t0 = time.perf_counter()
                client.request_pull("b", nodes["b"][1], [seg], "a", streams=streams)
                res[key].append(time.perf_counter() - t0)
        forget(directory, root, url, seg, ["b"])
        res["plain_flight_s"] = measure_plain_flight(nodes["a"][1], "big", 1, args.reps,
                                                     nbytes)
        fan = commit_bytes(a, "fan", fan_bytes)
        res["cascade_s"], res["sequential_s"] = [], []
        for _ in range(args.reps):
            forget(directory, root, url, fan, targets)
            await_spares(client, nodes, targets, fan_bytes)
            t0 = time.perf_counter()
            a.replicate("fan", to=targets)
            res["cascade_s"].append(time.perf_counter() - t0)
            res["cascade_rounds"] = len(a.last_replication.rounds)
            forget(directory, root, url, fan, targets)
            await_spares(client, nodes, targets, fan_bytes)
            t0 = time.perf_counter()
            for t in targets:
                client.request_pull(t, nodes[t][1], [fan], "a")
            res["sequential_s"].append(time.perf_counter() - t0)
    return res


def run_plain(args: argparse.Namespace, res: dict[str, Any]) -> dict[str, Any]:
    """``--plain-only``: node a alone, serving the ``--gib`` GiB version to the plain
    Flight reader (raw TCP measured beforehand, in the same run)."""
    with node_cluster(res, ["a"], {}) as (_url, _root, nodes, a):
        commit_bytes(a, "big", res["bytes"])
        res["plain_flight_s"] = measure_plain_flight(nodes["a"][1], "big", 1, args.reps,
                                                     res["bytes"])
    return res


@contextmanager
def node_cluster(res: dict[str, Any], names: list[str], spares: dict[str, int]
                 ) -> Iterator[tuple[str, str, Nodes, tensordb.Database]]:
    """Node servers ``names`` (the first one's store opened here too) on a throwaway
    PostgreSQL catalog, each with the pre-faulted spare ``spares`` gives it: yields
    (catalog URL, their root directory, the nodes, the first node's store); everything
    is stopped and removed afterwards. Records the server's version in ``res``."""
    with _common.temp_pg_database(PG_SERVER) as (url, version):
        res["postgres"] = version
        root = tempfile.mkdtemp(prefix="tensordb-bench-transport-")
        nodes: Nodes = {}
        a = None
        try:
            tensordb.connect(url, node="setup", home=f"{root}/setup").close()
            nodes = start_nodes(url, root, names, spares)
            a = tensordb.connect(url, node=names[0], home=f"{root}/{names[0]}",
                                 data_dir=f"{root}/{names[0]}/data", token=TOKEN)
            yield url, root, nodes, a
        finally:
            if a is not None:
                a.close()
            stop_nodes(nodes)
            for n in ("setup", *names):
                cfg = tensordb.Config.resolve(url, home=f"{root}/{n}",
                                              data_dir=f"{root}/{n}/data")
                shutil.rmtree(cfg.shm_dir, ignore_errors=True)
            shutil.rmtree(root, ignore_errors=True)


def report(res: dict[str, Any]) -> None:
    n, fan = res["bytes"], res["fanout_bytes"]
    tcp = n / min(res["tcp_s"]) / GB
    mem = n / res["memcpy_1t_s"] / GB
    print(f"transport on loopback, {os.cpu_count()} CPUs, PostgreSQL {res['postgres']}; "
          f"best of {res['reps']}")
    print(f"  memcpy 1 thread            {mem:8.2f} GB/s   (ceiling)")
    print(f"  raw TCP socket copy        {tcp:8.2f} GB/s   (physical limit, same run)")
    if "transfer_s" not in res:  # --plain-only
        _report_plain(res, tcp)
        return
    flight = n / min(res["transfer_s"]) / GB
    bare = n / min(res["flight_bare_s"]) / GB
    print(f"  bare Flight do_get         {bare:8.2f} GB/s   = {bare / tcp:.2f} x raw TCP: "
          f"the same stream and copy + hash, nothing else (Flight's own ceiling)")
    ratio = flight / tcp
    print(f"  node-to-node pull          {flight:8.2f} GB/s   = {ratio:.2f} x raw TCP "
          f"(goal >= {GOAL_VS_TCP}: {'met' if ratio >= GOAL_VS_TCP else 'NOT met'}); "
          f"{n / (1 << 30):g} GiB, checksummed and registered, "
          f"{DEFAULT_STREAMS} range stream(s) (the default on {os.cpu_count()} CPUs)")
    one = n / min(res["transfer_1stream_s"]) / GB
    print(f"  ... as a single stream     {one:8.2f} GB/s   = {one / tcp:.2f} x raw TCP")
    _report_plain(res, tcp)
    c, s = min(res["cascade_s"]), min(res["sequential_s"])
    print(f"  fan-out {fan / MiB:g} MiB to {res['targets']} nodes: cascade {c:.2f} s "
          f"({res['cascade_rounds']} rounds), one source in turn {s:.2f} s "
          f"({s / c:.2f} x the cascade's time)")


def _report_plain(res: dict[str, Any], tcp: float) -> None:
    plain = res["bytes"] / min(res["plain_flight_s"]) / GB
    verdict = "met" if plain / tcp >= GOAL_PLAIN_VS_TCP else "NOT met"
    print(f"  plain Flight read_all()    {plain:8.2f} GB/s   = {plain / tcp:.2f} x raw TCP "
          f"(goal >= {GOAL_PLAIN_VS_TCP}: {verdict}); a pyarrow-only process, the whole "
          f"version as a table, every extent through the integrity gate, no checksum")
    bound = res["bytes"] / min(res["plain_ceiling_s"]) / GB
    print(f"  ... its ceiling            {bound:8.2f} GB/s   = {bound / tcp:.2f} x raw TCP; "
          f"the node at {plain / bound:.2f} x it: the same reader, a bare server streaming "
          f"{TENSOR_BYTES // MiB} MiB batches from a mapping (no catalog, lease or gate)")
    small = res["bytes"] / min(res["plain_ceiling_4mib_s"]) / GB
    print(f"  ... ceiling, 4 MiB batches {small:8.2f} GB/s   = {small / tcp:.2f} x raw TCP: "
          f"pyarrow's client gathers each message into one malloc'd buffer; glibc maps "
          f"one over 32 MiB afresh each time (page faults), reuses smaller ones")


GOALS = (f"node-to-node pull >= {GOAL_VS_TCP} x raw TCP",
         f"plain Flight read_all() >= {GOAL_PLAIN_VS_TCP} x raw TCP")


def goals(res: dict[str, Any]) -> list[_verdict.Verdict]:
    """The two goals the report marks, as verdicts (in ``--json``; the exit status stays
    0): the pull and a plain Flight client against raw TCP, best of the runs each."""
    n = res["bytes"]
    tcp = n / min(res["tcp_s"]) / GB
    plain = n / min(res["plain_flight_s"]) / GB
    out = [_verdict.at_least(GOALS[1], plain / tcp, GOAL_PLAIN_VS_TCP,
                             f"{plain / tcp:.2f} x: {plain:.2f} against {tcp:.2f} GB/s")]
    if "transfer_s" not in res:  # --plain-only
        return [_verdict.not_measured(GOALS[0], "--plain-only"), *out]
    pull = n / min(res["transfer_s"]) / GB
    return [_verdict.at_least(GOALS[0], pull / tcp, GOAL_VS_TCP,
                              f"{pull / tcp:.2f} x: {pull:.2f} against {tcp:.2f} GB/s"), *out]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--flight-sender":
        flight_sender(argv[1], int(argv[2]) if len(argv) > 2 else None)
        return 0
    if argv and argv[0] == "--tcp-sender":
        tcp_sender(int(argv[1]), int(argv[2]), int(argv[3]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="node-to-node transfer size (1)")
    p.add_argument("--fanout-mib", type=int, default=512, help="fan-out size in MiB (512)")
    p.add_argument("--targets", type=int, default=4, help="fan-out target nodes (4)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (3)")
    p.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    p.add_argument("--plain-only", action="store_true",
                   help="raw TCP and the plain Flight read_all() only (one node)")
    args = p.parse_args(argv)
    try:
        res = run(args)
    except _common.PgUnavailable as exc:
        if args.json:
            print(json.dumps({"skipped": str(exc), "goals": _verdict.to_json(
                [_verdict.not_measured(g, f"no PostgreSQL catalog: {exc}") for g in GOALS])}))
        else:
            print(f"skipped: {exc}")
        return 0
    if args.json:
        print(json.dumps({**res, "goals": _verdict.to_json(goals(res))}, indent=2))
    else:
        report(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
