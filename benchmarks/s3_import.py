"""Import from object storage: ``db.import_safetensors("m", "s3://bucket/prefix/")`` from a
real S3 API server on 127.0.0.1 (moto's server mode, started here), against the raw
rate of the same server and the peer a user would pick instead.

A sharded folder of ``--mib`` MiB (``--shards`` files and the index) is uploaded once.
Then, each in a fresh process, ``--reps`` times:

- **raw GETs**: the same objects fetched with parallel ranged GETs (botocore, the same
  concurrency as the import) into one preallocated buffer, at the import's part size
  and at the largest range the import asks for in one GET (a tensor of up to
  ``WHOLE_PARTS`` parts): what the server and the client library can give, with
  nothing stored; the better of the two is the bound;
- **tensordb**: the import into a fresh store (default settings, no ``prefault``): the
  headers read and checked, every tensor fetched straight into its extent and hashed as
  it lands, one version committed;
- **Run:ai Model Streamer** (``runai-model-streamer-s3``): the same objects streamed into
  memory, tensor by tensor (what vLLM's ``--load-format runai_streamer`` reads).

Also measured in the same run: loopback TCP (one stream, ``socket.sendall`` to a reader
on 127.0.0.1), the bound under any HTTP server here, and each run's CPU seconds. On a
host of 2 cores the server (moto is Python) takes most of them: the raw GETs are its
rate, and whatever CPU a client spends beyond them (the import writes and hashes every
byte into shared memory, whose fresh pages cost ~1.3-1.5 GB/s here) is taken from it.
Figures are the best of ``--reps`` runs, interleaved, with the median beside. Goals: the import >= 0.9 x raw GETs
and >= 1 x the Run:ai streamer; and the imported bytes byte-identical to a local import
of the same files (the export compared file by file).

Run:  .venv/bin/python -m benchmarks.s3_import [--mib 256] [--shards 2] [--reps 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import _common, _verdict
from tensordb.client._safetensors_objects import WHOLE_PARTS

REGION = "us-east-1"
BUCKET = "bench"
PREFIX = "model"
CONCURRENCY = 16
PART = 8 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_moto(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    out = open(log, "wb")  # noqa: SIM115 (the server's, closed when it ends)
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the moto server did not start in 30 s")


def make_folder(dst: Path, mib: int, shards: int) -> int:
    """A Hugging Face style sharded folder of about ``mib`` MiB; its tensor bytes."""
    from safetensors.torch import save_file

    dst.mkdir(parents=True)
    per = (mib << 20) // shards
    g = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    total = 0
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        left, i = per, 0
        while left > 0:  # a mix like a model's: big matrices and small vectors
            n = min(left, (16 << 20) if i % 4 else (64 << 10))
            tensors[f"s{s}.t{i}"] = torch.randint(-128, 127, (n // 2,), dtype=torch.int16,
                                                  generator=g).view(torch.bfloat16)
            left -= n
            i += 1
        save_file(tensors, str(dst / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.nbytes for t in tensors.values())
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2,
        sort_keys=True) + "\n")
    return total


def client(endpoint: str) -> Any:
    import boto3
    from botocore.config import Config
    return boto3.client("s3", endpoint_url=endpoint, region_name=REGION,
                        aws_access_key_id="bench", aws_secret_access_key="bench",
                        config=Config(max_pool_connections=CONCURRENCY))


def upload(endpoint: str, folder: Path) -> None:
    c = client(endpoint)
    c.create_bucket(Bucket=BUCKET)
    for f in sorted(folder.iterdir()):
        c.upload_file(str(f), BUCKET, f"{PREFIX}/{f.name}")


# -- the runs, each in a process of its own ------------------------------------------
def run_raw(endpoint: str, part: int = PART) -> dict[str, float]:
    """Parallel ranged GETs of ``part`` bytes of every .safetensors object into one
    buffer."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    t0 = time.perf_counter()  # a client and a listing, as any loader needs
    c = client(endpoint)
    objs = [o for o in c.list_objects_v2(Bucket=BUCKET, Prefix=PREFIX + "/")["Contents"]
            if o["Key"].endswith(".safetensors")]
    total = sum(o["Size"] for o in objs)
    buf = np.empty(total, np.uint8)
    jobs, base = [], 0
    for o in objs:
        for lo in range(0, o["Size"], part):
            jobs.append((o["Key"], lo, min(o["Size"], lo + part), base + lo))
        base += o["Size"]

    def get(job: tuple[str, int, int, int]) -> None:
        key, lo, hi, at = job
        body = c.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={lo}-{hi - 1}")["Body"]
        view = memoryview(buf[at:at + hi - lo])
        done = 0
        while done < hi - lo:
            got = body.readinto(view[done:])
            if not got:
                raise RuntimeError("short read")
            done += got

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(get, jobs))
    return {"seconds": time.perf_counter() - t0, "bytes": float(total)}


def run_import(endpoint: str, home: str) -> dict[str, float]:
    import tensordb

    db = tensordb.connect(home=home, data_dir=home + "/data")
    try:
        t0 = time.perf_counter()
        db.import_safetensors("model", f"s3://{BUCKET}/{PREFIX}/", storage_options={
            "endpoint_url": endpoint, "key": "bench", "secret": "bench",
            "client_kwargs": {"region_name": REGION}, "max_concurrency": CONCURRENCY,
            "part_size": PART})
        seconds = time.perf_counter() - t0
        with db.snapshot("model") as snap:
            nbytes = sum(nb for _, _, nb in snap.info().values())
    finally:
        _common.remove_store(db)
    return {"seconds": seconds, "bytes": float(nbytes)}


def run_runai(endpoint: str) -> dict[str, float]:
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": REGION,
                       "AWS_EC2_METADATA_DISABLED": "true",
                       "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"})
    from runai_model_streamer import SafetensorsStreamer

    c = client(endpoint)
    keys = sorted(o["Key"] for o in c.list_objects_v2(Bucket=BUCKET, Prefix=PREFIX + "/")
                  ["Contents"] if o["Key"].endswith(".safetensors"))
    t0 = time.perf_counter()
    nbytes = 0
    with SafetensorsStreamer() as s:
        s.stream_files([f"s3://{BUCKET}/{k}" for k in keys])
        for _, t in s.get_tensors():
            nbytes += t.nbytes
    return {"seconds": time.perf_counter() - t0, "bytes": float(nbytes)}


def loopback_gbps(nbytes: int = 1 << 30) -> float:
    """One TCP stream over 127.0.0.1: sendall to a reader that discards."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    chunk = b"\0" * (1 << 20)

    def sink() -> None:
        c, _ = srv.accept()
        buf = bytearray(1 << 20)
        while c.recv_into(buf):
            pass
        c.close()

    t = threading.Thread(target=sink)
    t.start()
    s = socket.create_connection(srv.getsockname())
    t0 = time.perf_counter()
    for _ in range(nbytes // len(chunk)):
        s.sendall(chunk)
    s.close()
    t.join()
    srv.close()
    return nbytes / (time.perf_counter() - t0) / 1e9


def child(kind: str, endpoint: str, home: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-m", "benchmarks.s3_import", "--child", kind,
                          "--endpoint", endpoint, "--home", home],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{kind}: {out.stderr.strip()[-2000:]}")
    res: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return res


def identical(endpoint: str, folder: Path, work: Path) -> bool:
    """The import's export equals the uploaded files, byte for byte; so does a local
    import's."""
    import tensordb

    home = str(work / "check")
    db = tensordb.connect(home=home, data_dir=home + "/data")
    try:
        db.import_safetensors("remote", f"s3://{BUCKET}/{PREFIX}/", storage_options={
            "endpoint_url": endpoint, "key": "bench", "secret": "bench",
            "client_kwargs": {"region_name": REGION}})
        db.import_safetensors("local", folder)
        a = db.export_safetensors("remote", work / "out-remote")
        b = db.export_safetensors("local", work / "out-local")
        return len(a) == len(b) == len(list(folder.iterdir())) and all(
            p.read_bytes() == (folder / p.name).read_bytes() ==
            (work / "out-local" / p.name).read_bytes() for p in a)
    finally:
        _common.remove_store(db)


def run(mib: int, shards: int, reps: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="tensordb-s3bench-"))
    proc, endpoint = start_moto(work / "moto.log")
    try:
        folder = work / "folder"
        nbytes = make_folder(folder, mib, shards)
        upload(endpoint, folder)
        res: dict[str, Any] = {"mib": mib, "shards": shards, "tensor_bytes": nbytes,
                               "concurrency": CONCURRENCY, "part_bytes": PART,
                               "loopback_gbps": loopback_gbps(),
                               **_common.measure_populate()}
        # the raw bound at the import's part size and at the largest range it asks
        # for in one GET (a tensor of up to WHOLE_PARTS parts): the better one is the bound
        runs: dict[str, list[float]] = {"raw": [], "raw-whole": [], "tensordb": [],
                                        "runai": []}
        errors: dict[str, str] = {}
        for r in range(reps):  # interleaved, so a slow spell of the host hits all alike
            for kind in runs:
                if kind in errors:
                    continue
                home = str(work / f"store-{r}")
                try:
                    got = child(kind, endpoint, home)
                    runs[kind].append(got["bytes"] / got["seconds"] / 1e6)
                except Exception as exc:  # a peer that does not run is reported, not fatal
                    errors[kind] = str(exc).splitlines()[-1][:300]
                shutil.rmtree(home, ignore_errors=True)
        res["mb_s"] = {k: max(v) if v else None for k, v in runs.items()}
        raws = [x for x in (res["mb_s"]["raw"], res["mb_s"]["raw-whole"]) if x is not None]
        res["raw_bound_mb_s"] = max(raws) if raws else None
        res["median_mb_s"] = {k: sorted(v)[len(v) // 2] if v else None
                              for k, v in runs.items()}
        res["all_mb_s"] = runs
        res["errors"] = errors
        res["identical"] = identical(endpoint, folder, work)
        return res
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)


def goals(res: dict[str, Any]) -> list[_verdict.Verdict]:
    mb = res["mb_s"]
    ours = mb["tensordb"]
    out = []
    if ours is None:
        return [_verdict.not_measured("import from S3", res["errors"].get("tensordb", "?"))]
    out.append(_verdict.faster_than_peer(
        "S3 import >= 0.9 x raw parallel ranged GETs", ours, res["raw_bound_mb_s"], 0.9,
        res["errors"].get("raw", "the raw GETs did not run")))
    out.append(_verdict.faster_than_peer(
        "S3 import >= 1 x Run:ai Model Streamer", ours, mb["runai"], 1.0,
        res["errors"].get("runai", "runai-model-streamer-s3 is not installed")))
    out.append(_verdict.judge("the S3 import's export is byte-identical to the files",
                              res["identical"]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--child", choices=["raw", "raw-whole", "tensordb", "runai"],
                   help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--home", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        import resource
        fn = {"raw": lambda: run_raw(a.endpoint),
              "raw-whole": lambda: run_raw(a.endpoint, WHOLE_PARTS * PART),
              "runai": lambda: run_runai(a.endpoint),
              "tensordb": lambda: run_import(a.endpoint, a.home)}[a.child]
        before = resource.getrusage(resource.RUSAGE_SELF)
        got = fn()
        after = resource.getrusage(resource.RUSAGE_SELF)
        got["cpu_seconds"] = (after.ru_utime - before.ru_utime) + (after.ru_stime -
                                                                   before.ru_stime)
        print(json.dumps(got))
        return 0
    res = run(a.mib, a.shards, a.reps)
    verdicts = goals(res)
    if a.json:
        print(json.dumps({**res, "goals": _verdict.to_json(verdicts)}, indent=2))
        return 0
    from rich.console import Console

    console = Console()
    mb = res["mb_s"]

    def fig(k: str) -> str:
        if mb[k] is None:
            return f"did not run ({res['errors'][k]})"
        return f"{mb[k]:.0f} MB/s (median {res['median_mb_s'][k]:.0f})"

    console.print(f"S3 import of {res['tensor_bytes'] / 2**20:.0f} MiB in {res['shards']} "
                  f"objects from moto on 127.0.0.1 ({CONCURRENCY} GETs of "
                  f"{PART >> 20} MiB in flight); best of {a.reps}, each a fresh process")
    console.print(f"  loopback TCP, one stream    {res['loopback_gbps']:.2f} GB/s")
    pop_s = res["tensor_bytes"] / (res["populate_1t_gbps"] * 1e9)
    console.print(f"  shared memory: {_common.populate_text(res)} ({pop_s:.2f} s of one core "
                  f"for these bytes, which the import pays and the raw GETs into anonymous "
                  f"memory do not, beside the server on the same cores)")
    console.print(f"  raw parallel ranged GETs    {fig('raw')}, of {PART >> 20} MiB")
    console.print(f"  raw parallel ranged GETs    {fig('raw-whole')}, of "
                  f"{(WHOLE_PARTS * PART) >> 20} MiB")
    console.print(f"  tensordb import             {fig('tensordb')}")
    console.print(f"  Run:ai Model Streamer       {fig('runai')}")
    _verdict.print_verdicts(console, verdicts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
