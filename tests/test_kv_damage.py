"""A KV namespace whose files were damaged outside the store: a process that opens it
and reads it is never killed, and every failure it sees is a ``tensordb.errors`` class.

The probe: a namespace of 500 blocks (some spilled to disk, some with metadata past
their records, an event ring written) is closed; then, in a copy of its files, one file
(the table or records file, ``index.kvx``, the event ring or a slab) is damaged (64 random bytes at
random offsets, a truncation, or a 4 KiB run of 0xff), and a fresh child process opens
the copy and runs match / contains / get / get_into / put / delete and reads the ring.
The children come from a forkserver that imported tensordb only (no namespace open
before the damage): a child killed by a signal fails the test, so does a hang.
``TENSORDB_KV_DAMAGE_TRIALS`` runs more trials per (file, damage) than the default 5.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import shutil
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import open_store

from tensordb import KVCache
from tensordb.config import Config

CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "tensordb", "conftest"])

NS = "probe"
NBLOCKS = 500
FILES = ("table", "index", "ring", "slab")
DAMAGES = ("bytes", "truncate", "ff")
PER_CASE = int(os.environ.get("TENSORDB_KV_DAMAGE_TRIALS", "5"))


def _keys() -> list[bytes]:
    return [i.to_bytes(4, "big") * 4 for i in range(1, NBLOCKS + 1)]


def _sizes() -> list[int]:
    rng = random.Random(7)
    return [rng.choice((600, 1024, 2048, 3000)) for _ in range(NBLOCKS)]


def _cache(db: Any) -> KVCache:
    return KVCache(db, NS, block_tokens=4, capacity_bytes=640 << 10, slab_bytes=64 << 10)


def _build(home: Path) -> tuple[Path, Path]:
    """The namespace, closed: its shared-memory and spill directories."""
    from tensordb.client._kv_events import KVBlockInfo

    db = open_store(home)
    kv = _cache(db)
    kv.store.events_claim()  # the ring is written from here on
    keys, sizes = _keys(), _sizes()
    for lo in range(0, NBLOCKS, 50):
        blocks = [torch.full((sizes[i],), i % 251, dtype=torch.uint8)
                  for i in range(lo, lo + 50)]
        info = [KVBlockInfo(token_ids=list(range(i, i + 12))) if i % 3 == 0 else None
                for i in range(lo, lo + 50)]
        kv.put(keys[lo:lo + 50], blocks, info=info)
    stats = kv.store.stats()
    assert stats.disk_blocks > 0 and stats.host_blocks > 0, stats
    kv.store.events_release()
    shm, disk = kv.shm_dir, kv.disk_dir
    kv.close()
    db.close()
    return shm, disk


def _child(home: str, out: str) -> None:
    """Open the namespace at ``home`` and use it; every outcome into ``out``."""
    import tensordb
    from tensordb.client._kv_namespace import typed_errors
    from tensordb.errors import TensorDBError

    got: list[list[Any]] = []

    def run(op: str, fn: Any) -> Any:
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - what the probe records
            got.append([op, type(exc).__module__ + "." + type(exc).__qualname__,
                        isinstance(exc, TensorDBError), str(exc)[:300]])
            return None
        got.append([op, "ok", True, ""])
        return value

    def save() -> None:
        Path(out).write_text(json.dumps(got))

    db = tensordb.connect(home=home, data_dir=home + "/data")
    kv = run("open", lambda: _cache(db))
    save()
    if kv is None:
        return
    keys, sizes = _keys(), _sizes()
    run("match", lambda: kv.match(keys))
    run("contains", lambda: kv.contains(keys))
    for lo in range(0, NBLOCKS, 100):
        run("get", lambda lo=lo: [t.sum() for t in kv.get(keys[lo:lo + 100])])
    outs = [torch.empty(sizes[i], dtype=torch.uint8) for i in range(0, NBLOCKS, 7)]
    run("get_into", lambda: kv.get_into(keys[::7], outs))
    save()

    def events() -> None:
        with typed_errors(NS, "local"):
            kv.store.events_claim()
            kv.store.events_read(0, 1 << 24, 0)
            kv.store.events_take(0, 1 << 20, 0)

    run("events", events)
    new = [bytes([0xEE, i]) * 8 for i in range(64)]
    run("put", lambda: kv.put(new, [torch.full((2048,), 3, dtype=torch.uint8)] * 64))
    run("delete", lambda: kv.delete(keys[:40]))
    run("match2", lambda: kv.match(new))
    run("get_into2", lambda: kv.get_into(new[:8], [torch.empty(2048, dtype=torch.uint8) for _ in range(8)]))
    save()
    run("close", kv.close)
    db.close()
    save()


def _target(files: dict[str, list[Path]], which: str, rng: random.Random) -> Path:
    return rng.choice(files[which])


def _damage(path: Path, kind: str, rng: random.Random) -> str:
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        if kind == "bytes":
            for _ in range(64):
                fh.seek(rng.randrange(size))
                fh.write(bytes([rng.randrange(256)]))
            return f"64 random bytes of {size}"
        if kind == "truncate":
            cut = rng.randrange(size)
            fh.truncate(cut)
            return f"cut to {cut} of {size}"
        at = rng.randrange(max(1, size - 4096))
        fh.seek(at)
        fh.write(b"\xff" * min(4096, size - at))
        return f"0xff x 4096 at {at} of {size}"


def _files(root: Path) -> dict[str, list[Path]]:
    return {"table": sorted([*root.glob("table-*.kvx"), *root.glob("records-*.kvx")]),
            "index": [root / "index.kvx"],
            "ring": [root / "events.kvx"], "slab": sorted((root / "slabs").glob("*.slab"))}


def _trial(base: Path, shm: Path, disk: Path, name: str, which: str | None, kind: str,
           seed: int) -> dict[str, Any]:
    """Copy the namespace for a child of its own, damage one file of the copy, run it."""
    home = base / name
    cfg = Config.resolve(home=home, data_dir=home / "data")
    root = cfg.shm_dir / "kv" / NS
    shutil.copytree(shm, root)
    shutil.copytree(disk, cfg.data_dir / "kv" / NS)
    what = "undamaged"
    if which is not None:
        rng = random.Random(seed)
        path = _target(_files(root), which, rng)
        what = f"{path.name}: {_damage(path, kind, rng)}"
    out = home / "out.json"
    p = CTX.Process(target=_child, args=(str(home), str(out)))
    p.start()
    p.join(60)
    hung = p.is_alive()
    if hung:
        p.kill()
        p.join()
    got = json.loads(out.read_text()) if out.exists() else []
    shutil.rmtree(cfg.shm_dir, ignore_errors=True)
    return {"file": which, "damage": kind, "what": what, "exitcode": p.exitcode,
            "hung": hung, "ops": got}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, Path]]:
    base = tmp_path_factory.mktemp("kvdamage")
    shm, disk = _build(base / "origin")
    yield base, shm, disk
    shutil.rmtree(Config.resolve(home=base / "origin", data_dir=base / "origin" / "data"
                                 ).shm_dir, ignore_errors=True)


def _signal_name(code: int | None) -> str:
    return signal.Signals(-code).name if code is not None and code < 0 else str(code)


def test_undamaged_copy_opens_and_serves(built: tuple[Path, Path, Path]) -> None:
    base, shm, disk = built
    r = _trial(base, shm, disk, "clean", None, "", 0)
    assert r["exitcode"] == 0 and not r["hung"], r
    ops = {op: outcome for op, outcome, _, _ in r["ops"]}
    assert all(v == "ok" for v in ops.values()), [o for o in r["ops"] if o[1] != "ok"]
    assert {"open", "match", "get", "get_into", "events", "put", "close"} <= ops.keys()


def test_damaged_files_never_kill_the_reader(built: tuple[Path, Path, Path]) -> None:
    base, shm, disk = built
    results = []
    for which in FILES:
        for kind in DAMAGES:
            for k in range(PER_CASE):
                seed = FILES.index(which) * 1000 + DAMAGES.index(kind) * 100 + k
                results.append(_trial(base, shm, disk, f"{which}-{kind}-{k}", which, kind,
                                      seed))
    killed = [r for r in results if r["exitcode"] != 0 or r["hung"]]
    untyped = [(r["what"], op) for r in results for op in r["ops"] if not op[2]]
    per_file = Counter(f"{r['file']}/{r['damage']}:{_signal_name(r['exitcode'])}"
                       for r in killed)
    failures = Counter(op[1] for r in results for op in r["ops"] if op[1] != "ok")
    summary = (f"{len(killed)} of {len(results)} children killed or hung "
               f"({dict(per_file)}; "
               + ", ".join(f"{r['what']}: {_signal_name(r['exitcode'])}"
                           + (" (hung)" if r["hung"] else "") for r in killed[:12])
               + f"); failures seen: {dict(failures)}")
    print(summary)
    print("untyped:", untyped[:10])
    assert not killed, summary
    assert not untyped, untyped[:10]
    # damage is damage, never the caller's bad input; and the probes reached the checks
    assert not failures["tensordb.errors.InvalidInput"], summary
    assert failures["tensordb.errors.CorruptData"], summary
