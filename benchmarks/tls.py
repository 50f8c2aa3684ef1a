"""What TLS costs the node server: segment bytes and plain Flight reads, TLS on against
off, beside the bounds of this host measured in the same run.

One embedded store (SQLite catalog) commits a ``--mib`` MiB tensor; a node server
serves it in this process twice, in clear text and with ``--tls-cert``-style TLS (a
throwaway CA from ``trustme``, the certificate for 127.0.0.1). Measured, GB/s:

* ``tcp``: the loopback bound, a thread ``sendall``s the bytes into a socket and this
  thread ``recv_into``s them into memory faulted in before the clock starts;
* ``tls socket``: the same through Python's ``ssl`` (OpenSSL, TLS 1.3, AES-GCM), the bound
  of any TLS stream on this host: encrypting and decrypting on the same two cores;
* ``data plane``: ``FlightTransport.read_segment_into``, what a pulling node does, into a
  pre-faulted buffer: off (clear), and on (TLS, the client trusting the CA). The first
  read of a fresh transport (connection and handshake included) and the best of
  ``--reps`` after it;
* ``plain Flight``: ``fl.FlightClient.do_get(ticket).read_all()`` of the version, as any
  Flight client reads it, off and on.

The goal: the TLS data plane moves >= 0.8 x the TLS socket bound (TLS's cost is the
cipher's, not ours). Client and server share the host's cores, as in transfer.py.

Run:  .venv/bin/python -m benchmarks.tls [--mib 256] [--reps 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import socket
import ssl
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.flight as fl
import torch

import tensordb
import transport
from benchmarks import _verdict

TOKEN = "bench-token-0123456789abcdef"


def _stream(nbytes: int, reps: int, server_ctx: ssl.SSLContext | None,
            client_ctx: ssl.SSLContext | None) -> list[float]:
    """GB/s of ``reps`` streams of ``nbytes`` over loopback (TLS when contexts given)."""
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)  # faulted in before any clock starts
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def send() -> None:
        for _ in range(reps):
            conn, _ = listener.accept()
            if server_ctx is not None:
                conn = server_ctx.wrap_socket(conn, server_side=True)
            with conn:
                conn.sendall(memoryview(src))
                conn.recv(1)

    t = threading.Thread(target=send, daemon=True)
    t.start()
    out = []
    view = memoryview(dst)
    for _ in range(reps):
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        if client_ctx is not None:
            s = client_ctx.wrap_socket(s, server_hostname="127.0.0.1")
        t0 = time.perf_counter()
        got = 0
        while got < nbytes:
            got += s.recv_into(view[got:])
        out.append(nbytes / (time.perf_counter() - t0) / 1e9)
        s.sendall(b"x")
        s.close()
    t.join()
    listener.close()
    return out


def _segment(db: tensordb.Database) -> str:
    return next(r.segment_id for c, _, r in db.catalog.all_rows()
                if c == "big" and r.segment_id)


def _node(db: tensordb.Database, tls: transport.ServerTLS | None, ca: bytes | None,
          nbytes: int, reps: int) -> dict[str, Any]:
    server = transport.NodeServer(db, token=TOKEN, tls=tls)
    address = f"127.0.0.1:{server.port}"
    sid = _segment(db)
    dst = np.zeros(nbytes, np.uint8)
    try:
        rates = []
        for _ in range(reps + 1):  # the first on a fresh transport: connect + handshake
            client = transport.FlightTransport(TOKEN, 30.0, tls_ca=ca)
            t0 = time.perf_counter()
            client.read_segment_into("a", address, sid, 0, dst, lambda n: None)
            rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
            client.close()
        scheme = "grpc+tls" if tls else "grpc+tcp"
        flight = fl.FlightClient(f"{scheme}://{address}", tls_root_certs=ca) if ca \
            else fl.FlightClient(f"{scheme}://{address}")
        opts = fl.FlightCallOptions(headers=[(b"authorization", f"Bearer {TOKEN}".encode())])
        plain = []
        for _ in range(reps):
            t0 = time.perf_counter()
            table = flight.do_get(fl.Ticket(b'{"collection": "big"}'), opts).read_all()
            plain.append(table.column("nbytes")[0].as_py() / (time.perf_counter() - t0) / 1e9)
            del table
        flight.close()
    finally:
        server.close()
    return {"first": rates[0], "best": max(rates[1:]), "plain_flight": max(plain)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import trustme

    nbytes = args.mib << 20
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    with tempfile.TemporaryDirectory(prefix="tensordb-bench-tls-") as d:
        cp, kp = Path(d) / "cert.pem", Path(d) / "key.pem"
        cp.write_bytes(b"".join(b.bytes() for b in cert.cert_chain_pems))
        kp.write_bytes(cert.private_key_pem.bytes())
        tls = transport.ServerTLS.load(cp, kp)
        ca_pem = ca.cert_pem.bytes()
        client_ctx = ssl.create_default_context(cadata=ca_pem.decode())
        res: dict[str, Any] = {
            "mib": args.mib,
            "tcp": max(_stream(nbytes, args.reps, None, None)),
            "tls_socket": max(_stream(nbytes, args.reps, tls.context(), client_ctx)),
        }
        db = tensordb.connect(home=Path(d) / "store", scrub_interval=0)
        try:
            with db.transaction("big") as tx:
                tx.put("w", torch.ones(nbytes // 4, dtype=torch.float32))
            res["off"] = _node(db, None, None, nbytes, args.reps)
            res["on"] = _node(db, tls, ca_pem, nbytes, args.reps)
        finally:
            db.close()
    on, bound = res["on"]["best"], res["tls_socket"]
    res["verdicts"] = _verdict.to_json([_verdict.within_bound(
        "TLS data plane >= 0.8 x the TLS socket bound", on / bound, 0.8, 1.0,
        f"{on:.2f} GB/s against {bound:.2f} ({on / bound:.2f} x); clear {res['off']['best']:.2f}")])
    return res


def report(res: dict[str, Any]) -> None:
    print(f"loopback, {res['mib']} MiB per read, GB/s (client and server on one host)")
    print(f"  bound  tcp {res['tcp']:.2f}   tls socket {res['tls_socket']:.2f}")
    for key in ("off", "on"):
        r = res[key]
        print(f"  TLS {key:3}  data plane first {r['first']:.2f}  steady {r['best']:.2f}   "
              f"plain Flight {r['plain_flight']:.2f}")
    off, on = res["off"]["best"], res["on"]["best"]
    print(f"  TLS costs the data plane {1 - on / off:.0%} (on / off {on / off:.2f}); "
          f"on / tls socket {on / res['tls_socket']:.2f}")
    from rich.console import Console

    _verdict.print_verdicts(Console(highlight=False), _verdict.from_json(res["verdicts"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256, help="bytes per read, MiB (256)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (3)")
    p.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    args = p.parse_args(argv)
    res = run(args)
    if args.json:
        print(json.dumps(res))
    else:
        report(res)
    return _verdict.exit_code(_verdict.from_json(res["verdicts"]))


if __name__ == "__main__":
    raise SystemExit(main())
