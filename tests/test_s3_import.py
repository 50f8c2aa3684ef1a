"""Imports from object storage: a real S3 API server on 127.0.0.1 (moto's server mode,
started here, with authorization on), or any S3-compatible endpoint named by
``TENSORDB_TEST_S3_ENDPOINT`` (credentials from the standard AWS environment).

What they hold: the bytes of an import from S3 equal a local import of the same files
(the export is byte-identical); a missing object is NotFound, a denied one Unauthorized,
a truncated one CorruptData, an endpoint that stops answering NodeUnavailable, and after
each the store is unchanged; a resumed import fetches only what had not landed (counted
in bytes fetched), and gc reclaims a pending import once it expires."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("boto3", reason="the S3 import tests need boto3 (pip install -e '.[test]')")
safetensors_torch = pytest.importorskip("safetensors.torch")

from conftest import wait_until  # noqa: E402

import storage_engine as se  # noqa: E402
import tensordb  # noqa: E402
from tensordb.client._safetensors_objects import HEAD_READ  # noqa: E402
from tensordb.errors import (  # noqa: E402
    CorruptData,
    InvalidInput,
    NodeUnavailable,
    NotFound,
    Unauthorized,
)

KiB = 1024
REGION = "us-east-1"


@dataclass
class S3:
    endpoint: str
    bucket: str
    admin: dict[str, str]  # storage_options of a key that may write
    reader: dict[str, str]  # of a key that may read
    denied: dict[str, str] | None  # of a real key with no rights (moto only)
    moto: bool

    def client(self) -> Any:
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=self.admin["key"],
                            aws_secret_access_key=self.admin["secret"])

    def options(self, creds: dict[str, str] | None = None,
                endpoint: str | None = None) -> dict[str, Any]:
        return {**(creds or self.reader), "endpoint_url": endpoint or self.endpoint,
                "client_kwargs": {"region_name": REGION}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _moto_keys(endpoint: str, bucket: str) -> tuple[dict[str, str], dict[str, str],
                                                     dict[str, str]]:
    """IAM users on the moto server: an admin (s3:*), a reader (get and list on the
    bucket) and one with no policy; then authorization is turned on."""
    import boto3
    iam = boto3.client("iam", endpoint_url=endpoint, region_name=REGION,
                       aws_access_key_id="setup", aws_secret_access_key="setup")
    keys = []
    # the reader's rights are IAM's (GetObject, ListBucket); moto >= 5.2.6 checks some
    # calls by their API names instead, so those are named too: the same two rights
    reader = ["s3:GetObject", "s3:ListBucket", "s3:HeadObject", "s3:ListObjectsV2",
              "s3:ListObjects"]
    for user, actions in (("admin", ["s3:*"]), ("reader", reader), ("nobody", None)):
        iam.create_user(UserName=user)
        if actions is not None:
            iam.put_user_policy(UserName=user, PolicyName="p", PolicyDocument=json.dumps({
                "Version": "2012-10-17", "Statement": [{
                    "Effect": "Allow", "Action": actions,
                    "Resource": "*" if user == "admin" else
                    [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]}]}))
        k = iam.create_access_key(UserName=user)["AccessKey"]
        keys.append({"key": k["AccessKeyId"], "secret": k["SecretAccessKey"]})
    boto3.client("s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id="setup",
                 aws_secret_access_key="setup").create_bucket(Bucket=bucket)
    import urllib.request
    urllib.request.urlopen(urllib.request.Request(  # moto's INITIAL_NO_AUTH_ACTION_COUNT=0
        f"{endpoint}/moto-api/reset-auth", data=b"0", method="POST",
        headers={"Content-Type": "text/plain"}), timeout=10).read()
    return keys[0], keys[1], keys[2]


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3]:
    external = os.environ.get("TENSORDB_TEST_S3_ENDPOINT")
    bucket = f"tensordb-test-{uuid.uuid4().hex[:12]}"
    if external:
        creds = {"key": os.environ.get("AWS_ACCESS_KEY_ID", ""),
                 "secret": os.environ.get("AWS_SECRET_ACCESS_KEY", "")}
        s = S3(external, bucket, creds, creds, None, moto=False)
        s.client().create_bucket(Bucket=bucket)
        try:
            yield s
        finally:
            c = s.client()
            for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket):
                for o in page.get("Contents", []):
                    c.delete_object(Bucket=bucket, Key=o["Key"])
            c.delete_bucket(Bucket=bucket)
        return
    pytest.importorskip("moto.server", reason="moto[server] is not installed")
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        if not wait_until(lambda: _answers(port), timeout=30):
            pytest.fail("the moto server did not start in 30 s")
        admin, reader, nobody = _moto_keys(endpoint, bucket)
        yield S3(endpoint, bucket, admin, reader, nobody, moto=True)
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def _answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


class Relay:
    """A TCP relay in front of the S3 server, standing in for the endpoint: it stops
    answering (every connection closed, none accepted) once ``budget`` bytes of
    responses have passed, as a server that goes away mid-import."""

    def __init__(self, target: str, budget: int | None = None, port: int = 0) -> None:
        host, _, p = target.removeprefix("http://").partition(":")
        self.target = (host, int(p))
        self.budget = budget
        self.sent = 0
        self.stopped = False
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", port))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped:
            try:
                c, _ = self.listener.accept()
            except OSError:
                return
            u = socket.create_connection(self.target)
            with self._lock:
                self._socks += [c, u]
            threading.Thread(target=self._pump, args=(c, u, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, counted: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
                if counted:
                    with self._lock:
                        self.sent += len(data)
                        over = self.budget is not None and self.sent > self.budget
                    if over:
                        self.stop()
                        return
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def stop(self) -> None:
        self.stopped = True
        try:  # shutdown wakes the thread in accept(), which would keep the port bound
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass


def _model(seed: int, n: int = 12, numel: int = 64 * KiB) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.weight": torch.randn(numel // 4 + i, generator=g) for i in range(n)}
    out["norm.weight"] = torch.ones(7, dtype=torch.bfloat16)
    out["empty"] = torch.zeros(0)
    return out


def _sharded_folder(dst: Path, seed: int, shards: int = 3) -> Path:
    """A Hugging Face style folder: ``shards`` files and the index."""
    tensors = _model(seed)
    names = list(tensors)
    dst.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        safetensors_torch.save_file(part, str(dst / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
         "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")
    return dst


def _upload(s3: S3, folder: Path, prefix: str) -> None:
    c = s3.client()
    for f in sorted(folder.iterdir()):
        c.upload_file(str(f), s3.bucket, f"{prefix}/{f.name}")


def _fetch_plan(folder: Path) -> tuple[int, int]:
    """The tensor bytes of a folder's files, and what an import fetches beside them:
    the index and one read of each file's head (up to HEAD_READ bytes)."""
    overhead = (folder / "model.safetensors.index.json").stat().st_size
    tensor_bytes = 0
    for f in folder.glob("*.safetensors"):
        size = f.stat().st_size
        overhead += min(size, HEAD_READ)
        tensor_bytes += size - 8 - int.from_bytes(f.read_bytes()[:8], "little")
    return tensor_bytes, overhead


def _state(db: tensordb.Database) -> tuple[list[str], dict[str, int]]:
    return db.collections(), {c: len(db.history(c)) for c in db.collections()}


def _same_bytes(db: tensordb.Database, a: str, b: str) -> None:
    with db.snapshot(a) as sa, db.snapshot(b) as sb:
        assert sorted(sa) == sorted(sb)
        for n in sa:
            assert torch.equal(sa[n], sb[n]), n


# -- the import ----------------------------------------------------------------------
def test_a_sharded_folder_and_a_single_object_import_as_a_local_import_does(
        s3: S3, sqlite_db: tensordb.Database, tmp_path: Path) -> None:
    folder = _sharded_folder(tmp_path / "m", seed=1)
    _upload(s3, folder, "m1")
    db = sqlite_db
    local = db.import_safetensors("local", folder)
    with se.counting() as work:
        remote = db.import_safetensors("remote", f"s3://{s3.bucket}/m1/",
                                       storage_options=s3.options())
    # each tensor's bytes fetched once; beside them one GET of each file's head (its
    # header and what follows, up to HEAD_READ) and the index
    tensor_bytes, overhead = _fetch_plan(folder)
    assert work["object_bytes_fetched"] == tensor_bytes + overhead
    assert remote.version == 1 and local.version == 1
    _same_bytes(db, "local", "remote")
    out = db.export_safetensors("remote", tmp_path / "out")
    for p in out:  # byte-identical to the files uploaded, index included
        assert p.read_bytes() == (folder / p.name).read_bytes(), p.name
    # one object, by its key; small batches (a part each of several tensors)
    key = "model-00001-of-00003.safetensors"
    one = db.import_safetensors("one", f"s3://{s3.bucket}/m1/{key}", batch_bytes=64 * KiB,
                                storage_options={**s3.options(), "part_size": 16 * KiB})
    with db.snapshot("one") as snap:
        ref = safetensors_torch.load_file(str(folder / key))
        assert sorted(snap) == sorted(ref)
        assert all(torch.equal(snap[n], ref[n]) for n in ref)
    assert one.metadata is not None and one.metadata["format"] == "pt"
    # the folder's files (config, tokenizer) come beside the tensors
    (folder / "config.json").write_bytes(b'{"model_type": "llama"}')
    (folder / "tokenizer.json").write_bytes(b'{"version": "1.0"}')
    _upload(s3, folder, "m1f")
    db.import_safetensors("with-files", f"s3://{s3.bucket}/m1f/",
                          storage_options=s3.options())
    with db.snapshot("with-files") as snap:
        assert snap.files() == {"config.json": 23, "tokenizer.json": 18}
        assert snap.file("config.json") == b'{"model_type": "llama"}'
    for p in db.export_safetensors("with-files", tmp_path / "out-files"):
        assert p.read_bytes() == (folder / p.name).read_bytes(), p.name
    (folder / "config.json").unlink()
    (folder / "tokenizer.json").unlink()
    # a second import of the same objects is a new version of the same bytes
    again = db.import_safetensors("remote", f"s3://{s3.bucket}/m1",
                                  storage_options=s3.options())
    assert again.version == 2
    # into the disk tier, and into a segment that reuses a freed host file (its
    # pages exist: written through its mapping, not its descriptor)
    db.import_safetensors("on-disk", f"s3://{s3.bucket}/m1/", tier="disk",
                          storage_options=s3.options())
    _same_bytes(db, "local", "on-disk")
    db.drop("one")
    db.drop("remote")
    db.gc()
    db.import_safetensors("pooled", f"s3://{s3.bucket}/m1/", storage_options=s3.options())
    _same_bytes(db, "local", "pooled")


def test_missing_denied_and_truncated_objects_give_typed_errors_store_unchanged(
        s3: S3, sqlite_db: tensordb.Database, tmp_path: Path) -> None:
    db = sqlite_db
    db.commit("keep", {"w": torch.ones(3)})
    folder = _sharded_folder(tmp_path / "m", seed=2, shards=1)
    _upload(s3, folder, "m2")
    before = _state(db)
    with pytest.raises(NotFound, match="no-such"):
        db.import_safetensors("x", f"s3://{s3.bucket}/no-such/", storage_options=s3.options())
    with pytest.raises(NotFound):
        db.import_safetensors("x", f"s3://{s3.bucket}/m2/none.safetensors",
                              storage_options=s3.options())
    with pytest.raises(NotFound):  # (a key whose rights cover any bucket: S3 answers a
        # reader with no right to a bucket AccessDenied whether it exists or not)
        db.import_safetensors("x", f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/m/",
                              storage_options=s3.options(s3.admin))
    with pytest.raises(Unauthorized):
        db.import_safetensors("x", f"s3://{s3.bucket}/m2/", storage_options=s3.options(
            {"key": "AKIANOTAKEY0000000000", "secret": "wrong"}))
    if s3.denied is not None:  # a real key without the right to read
        with pytest.raises(Unauthorized):
            db.import_safetensors("x", f"s3://{s3.bucket}/m2/",
                                  storage_options=s3.options(s3.denied))
    # truncated: the object ends inside its tensors
    src = folder / "model-00001-of-00001.safetensors"
    s3.client().put_object(Bucket=s3.bucket, Key="cut/model.safetensors",
                           Body=src.read_bytes()[:-100])
    with pytest.raises(CorruptData, match="truncated|out of bounds|ends"):
        db.import_safetensors("x", f"s3://{s3.bucket}/cut/model.safetensors",
                              storage_options=s3.options())
    s3.client().put_object(Bucket=s3.bucket, Key="cut2/model.safetensors",
                           Body=src.read_bytes()[:5])
    with pytest.raises(CorruptData):
        db.import_safetensors("x", f"s3://{s3.bucket}/cut2/", storage_options=s3.options())
    # bad arguments
    with pytest.raises(InvalidInput, match="nope"):
        db.import_safetensors("x", f"s3://{s3.bucket}/m2/",
                              storage_options={**s3.options(), "nope": 1})
    with pytest.raises(InvalidInput, match="object URLs"):
        db.import_safetensors("x", folder, resume=True)
    with pytest.raises(InvalidInput, match="no bucket"):
        db.import_safetensors("x", "s3:///m2/", storage_options=s3.options())
    with pytest.raises(InvalidInput, match="in place"):
        db.import_safetensors("x", f"s3://{s3.bucket}/m2/", in_place=True,
                              storage_options=s3.options())
    assert _state(db) == before


def test_an_endpoint_that_stops_mid_import_leaves_a_pending_import_that_resumes(
        s3: S3, sqlite_db: tensordb.Database, tmp_path: Path) -> None:
    db = sqlite_db
    db.commit("model", {"old": torch.ones(2)})
    folder = _sharded_folder(tmp_path / "m", seed=3)
    _upload(s3, folder, "m3")
    nbytes, overhead = _fetch_plan(folder)
    before = _state(db)
    relay = Relay(s3.endpoint, budget=overhead + nbytes // 2)  # half the tensors' bytes
    opts = {**s3.options(endpoint=relay.endpoint), "max_concurrency": 2,
            "part_size": 32 * KiB, "config_kwargs": {"retries": {"max_attempts": 1}}}
    url = f"s3://{s3.bucket}/m3/"
    with se.counting() as first, pytest.raises(NodeUnavailable):
        db.import_safetensors("model", url, storage_options=opts, batch_bytes=128 * KiB)
    assert relay.stopped
    assert _state(db) == before  # no version appeared
    with db.snapshot("model") as snap:
        assert list(snap) == ["old"]
    landed = first["object_bytes_fetched"]
    assert 0 < landed - overhead < nbytes
    # the endpoint is back (on the same port); the resume fetches only what had not
    # landed in a committed batch, and the version is the whole folder
    relay = Relay(s3.endpoint, port=relay.port)
    try:
        with se.counting() as second:
            commit = db.import_safetensors("model", url, storage_options=opts,
                                           batch_bytes=128 * KiB, resume=True)
    finally:
        relay.stop()
    assert commit.version == 2
    resumed = second["object_bytes_fetched"] - overhead
    # at least the batch of 128 KiB that landed whole is not fetched again; what was
    # fetched of the batch the stop cut off is
    assert resumed <= nbytes - 128 * KiB
    assert landed - overhead + resumed >= nbytes
    db.import_safetensors("local", folder)
    _same_bytes(db, "model", "local")
    with db.snapshot("model") as snap:
        assert "old" not in snap  # the files' names exactly


def test_gc_reclaims_a_pending_import_once_it_expires(
        s3: S3, sqlite_db: tensordb.Database, tmp_path: Path) -> None:
    db = sqlite_db
    folder = _sharded_folder(tmp_path / "m", seed=4)
    _upload(s3, folder, "m4")
    nbytes, overhead = _fetch_plan(folder)
    relay = Relay(s3.endpoint, budget=overhead + nbytes // 2)
    opts = {**s3.options(endpoint=relay.endpoint), "max_concurrency": 2,
            "part_size": 32 * KiB, "config_kwargs": {"retries": {"max_attempts": 1}}}
    url = f"s3://{s3.bucket}/m4/"
    with pytest.raises(NodeUnavailable):
        db.import_safetensors("model", url, storage_options=opts, batch_bytes=128 * KiB,
                              pending_ttl=1.0)
    assert db.gc().segments_deleted == 0  # pending: kept
    time.sleep(1.2)  # past the pending import's deadline
    report = db.gc()
    assert report.segments_deleted >= 1 and report.bytes_freed > 0, report
    # nothing to resume: the import starts again and fetches everything
    with se.counting() as work:
        db.import_safetensors("model", f"s3://{s3.bucket}/m4/", storage_options=s3.options(),
                              resume=True)
    assert work["object_bytes_fetched"] == nbytes + overhead


def test_the_cli_imports_from_s3_with_credentials_from_the_environment(
        s3: S3, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from tensordb import cli

    folder = _sharded_folder(tmp_path / "m", seed=5, shards=2)
    _upload(s3, folder, "m5")
    env = {"AWS_ACCESS_KEY_ID": s3.reader["key"], "AWS_SECRET_ACCESS_KEY": s3.reader["secret"],
           "AWS_DEFAULT_REGION": REGION, "COLUMNS": "200", "TENSORDB_HOME": None}
    home = tmp_path / "store"
    r = CliRunner(env=env).invoke(cli.app, ["--home", str(home), "import", "m",
                                            f"s3://{s3.bucket}/m5/", "--endpoint-url",
                                            s3.endpoint])
    assert r.exit_code == 0, r.output
    assert "m version 1" in r.output
    r = CliRunner(env=env).invoke(cli.app, ["--home", str(home), "import", "x", str(folder),
                                            "--resume"])
    assert r.exit_code != 0 and "s3://" in r.output


def test_an_object_replaced_during_a_read_is_corrupt_data_never_mixed(s3: S3) -> None:
    """Every GET names the ETag read at the start (If-Match): bytes of a newer object
    are refused, not mixed with the old one's."""
    from tensordb.client._object_store import ObjectStore

    c = s3.client()
    c.put_object(Bucket=s3.bucket, Key="swap/x.bin", Body=b"a" * 1000)
    with ObjectStore(f"s3://{s3.bucket}/swap/", s3.options()) as store:
        obj = store.head("swap/x.bin")
        assert store.read(obj, 10, 5, "probe") == b"aaaaa"
        c.put_object(Bucket=s3.bucket, Key="swap/x.bin", Body=b"b" * 1000)
        with pytest.raises(CorruptData, match="changed"):
            store.read(obj, 10, 5, "probe")
