"""``tensordb demo``: a tour of the store on a throwaway copy, in a few seconds.

It commits a transformer-shaped state_dict, has a second process open it without
copying a byte (and proves it from that process's memory map), shows that a reader's
write stays private, commits a second version that changes one tensor, and prints what
the store shared between the two. Then it compares the routing policies on a generated
multi-turn agent workload in the router's simulator, with and without a shared KV store,
and shows the summary of the KV a node holds that a live router reads from the store.
Everything it creates is removed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

import storage_engine as se
import tensordb
from engine_bindings.router import (
    Costs,
    WorkloadConfig,
    cluster_view,
    generate,
    saturation_rate,
    scaled_policy,
    simulate,
)

from ._display import history_table, human_bytes
from .errors import StoreFull

__all__ = ["run"]

COLLECTION = "demo-llm"
_CHANGED = "model.layers.11.mlp.down_proj.weight"  # the one tensor version 2 changes
_COW = "model.layers.0.self_attn.q_proj.weight"  # the one the reader scribbles on
_CHECKED = ("model.embed_tokens.weight", "model.layers.5.self_attn.v_proj.weight",
            "model.layers.23.post_attention_layernorm.weight", "lm_head.weight")


@dataclass(frozen=True, slots=True)
class _Shape:
    layers: int = 24
    hidden: int = 512
    ffn: int = 1376
    vocab: int = 8192

    def tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype), in the order of a Llama-style state_dict."""
        d, f, bf16, f32 = self.hidden, self.ffn, torch.bfloat16, torch.float32
        out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            "model.embed_tokens.weight": ((self.vocab, d), bf16)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = ((d,), f32)
            for proj in ("q", "k", "v", "o"):
                out[f"{p}self_attn.{proj}_proj.weight"] = ((d, d), bf16)
            out[p + "post_attention_layernorm.weight"] = ((d,), f32)
            out[p + "mlp.gate_proj.weight"] = ((f, d), bf16)
            out[p + "mlp.up_proj.weight"] = ((f, d), bf16)
            out[p + "mlp.down_proj.weight"] = ((d, f), bf16)
        out["model.norm.weight"] = ((d,), f32)
        out["lm_head.weight"] = ((self.vocab, d), f32)  # kept in float32, as some do
        return out

    def nbytes(self) -> int:
        return sum(int(np.prod(s)) * dt.itemsize for s, dt in self.tensors().values())


def _fit(free: int) -> _Shape:
    """The default model, or fewer layers where /dev/shm is small (two versions and a
    margin must fit)."""
    shape = _Shape()
    while shape.layers > 2 and 3 * shape.nbytes() > free:
        shape = _Shape(layers=shape.layers - 2)
    if 3 * shape.nbytes() > free:
        raise StoreFull(f"the demo needs {3 * shape.nbytes() >> 20} MiB free in "
                        f"{se.shm_root()}, which has {free >> 20} MiB")
    return shape


def _model(shape: _Shape, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for name, (s, dtype) in shape.tensors().items():
        if len(s) == 1:  # a norm's scale: ones, slightly perturbed
            sd[name] = torch.ones(s, dtype=dtype).add_(torch.randn(s, generator=g), alpha=0.01)
        else:
            sd[name] = torch.empty(s, dtype=dtype).normal_(0.0, 0.02, generator=g)
    return sd


def _digest(t: torch.Tensor) -> str:
    return se.checksum(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _memcpy_gbps(nbytes: int = 64 << 20) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # first touch of dst's pages is not part of a copy
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def _populate_gbps(root: Path, nbytes: int) -> float:
    """GB/s at which one thread writes a fresh shared-memory file of ``nbytes`` once (the
    kernel makes, zeroes and maps each page first): the most a first write into new
    shared memory gets on this machine (benchmarks/_common.measure_populate's one-thread
    figure). The file is removed after."""
    import mmap

    fd, path = tempfile.mkstemp(prefix="tensordb-demo-populate-", dir=root)
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as mm:
            pages = np.frombuffer(mm, np.uint8)
            t = time.perf_counter()
            pages.fill(1)
            took = time.perf_counter() - t
            del pages
    finally:
        os.close(fd)
        os.unlink(path)
    return nbytes / took / 1e9


def _fmt_s(s: float) -> str:
    if s < 1:
        return f"{s * 1000:.0f} ms"
    return f"{s:.2f} s" if s < 100 else f"{s / 60:.0f} min"


# -- the second process ----------------------------------------------------------------
def _mappings(root: str) -> list[tuple[int, int, str, str]]:
    """(start, end, perms, path) of this process's mappings of segment files under
    ``root`` (the store's other shared files, such as the integrity counter, are not
    tensors' bytes)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            path = parts[5].rstrip("\n") if len(parts) == 6 else ""
            if path.startswith(root + "/") and path.endswith(".seg"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi, parts[1], path))
    return out


@dataclass(frozen=True, slots=True)
class _Read:
    """What the second process saw, sent back to the first as JSON."""

    pid: int
    version: int
    tensors: int
    nbytes: int
    inside: int  # tensors whose bytes lie inside a mapping of the store's shm files
    maps: list[str]  # "perms file" of those mappings
    checks: dict[str, bool]  # name -> checksum matches the committed one
    import_s: float
    open_s: float
    check_s: float


def _reader(collection: str, expected: dict[str, str]) -> _Read:
    """Run in the second process: open the head, map every tensor, check a few."""
    t0 = time.perf_counter()
    import tensordb

    with tensordb.connect() as db:  # the store named by $TENSORDB_HOME
        t1 = time.perf_counter()
        with db.snapshot(collection) as snap:
            sd = snap.state_dict()
            version = snap.version
        t2 = time.perf_counter()
        checks = {name: _digest(sd[name]) == digest for name, digest in expected.items()}
        t3 = time.perf_counter()
        maps = _mappings(str(db.config.shm_dir))
    inside = sum(1 for t in sd.values()
                 if any(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi
                        for lo, hi, _, _ in maps))
    return _Read(pid=os.getpid(), version=version, tensors=len(sd),
                 nbytes=sum(t.nbytes for t in sd.values()), inside=inside,
                 maps=sorted({f"{perms} {Path(path).name}" for _, _, perms, path in maps}),
                 checks=checks, import_s=t1 - t0, open_s=t2 - t1, check_s=t3 - t2)


def _reader_main() -> None:
    collection, expected = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps(asdict(_reader(collection, expected))))


def _second_process(home: Path, collection: str, expected: dict[str, str]
                    ) -> tuple[_Read, float]:
    env = dict(os.environ, TENSORDB_HOME=str(home))
    code = "from tensordb._demo import _reader_main; _reader_main()"
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, collection, json.dumps(expected)],
                          env=env, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"the reader process failed ({proc.returncode}):\n{proc.stderr}")
    return _Read(**json.loads(proc.stdout.strip().splitlines()[-1])), wall


# -- routing ---------------------------------------------------------------------------
_ROUTING_POLICIES = (("round_robin", "in turn"),
                     ("least_load", "fewest queued tokens"),
                     ("cache_aware", "where the prefix is"),
                     ("migrate", "ditto; moves KV off a busy one"))
_INSTANCES = 4
_SESSIONS = 300
_LOAD = 0.7  # of the saturation rate: busy, with queues that still drain


def _routing(out: Console) -> dict[str, dict[str, dict[str, float]]]:
    """Part 6: the routing policies in the simulator, with and without a shared KV
    store, on a generated agent workload."""
    cfg = WorkloadConfig(sessions=_SESSIONS, seed=0)
    costs = Costs()
    rate = _LOAD * saturation_rate(generate(cfg), costs, _INSTANCES)
    reqs = generate(replace(cfg, rate=rate))
    out.print(f"\n[bold]6. Routing[/bold]: {len(reqs):,} requests of {cfg.sessions} agent "
              f"sessions ({cfg.min_turns}-{cfg.max_turns} turns, each prompt extending "
              f"the last, a {cfg.system_prompt_tokens:,}-token system prompt shared by all) "
              f"over {_INSTANCES} instances with {costs.cache_capacity_blocks:,} KV blocks "
              f"each, at {_LOAD:.0%} of the rate that saturates them, in the simulator "
              f"(engine_bindings.router.simulate), under each routing policy: with a shared "
              f"KV store like this one (an instance loads a block another computed) and "
              f"without.")
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name, _ in _ROUTING_POLICIES:
        results[name] = {
            where: simulate(reqs, scaled_policy(name), instances=_INSTANCES, costs=costs,
                            shared_store=shared).summary()
            for where, shared in (("store", True), ("alone", False))}
    table = Table(title="time to first token", title_justify="left", box=box.SIMPLE_HEAD,
                  show_edge=False, pad_edge=False)
    for col in ("policy", "routes", "median", "p90", "KV at hand", "migrations",
                "no store: median", "p90"):
        table.add_column(col, justify="left" if col in ("policy", "routes") else "right")
    for name, what in _ROUTING_POLICIES:
        st, alone = results[name]["store"], results[name]["alone"]
        table.add_row(name, what, _fmt_s(st["ttft_median"]), _fmt_s(st["ttft_p90"]),
                      f"{st['local_hit_rate']:.0%}", str(st["migrations"]),
                      _fmt_s(alone["ttft_median"]), _fmt_s(alone["ttft_p90"]))
    out.print(table)
    best = min(results, key=lambda n: results[n]["store"]["ttft_p90"])
    base = results["least_load"]["store"]
    out.print(f"   (KV at hand: prompt tokens in the instance's own cache or migrated there.) "
              f"Without the store a routing policy blind to where KV is recomputes "
              f"it and the queues run away; with it any instance loads what another "
              f"computed. {best} has the shortest tail: p90 "
              f"{_fmt_s(results[best]['store']['ttft_p90'])} against least_load's "
              f"{_fmt_s(base['ttft_p90'])}. (benchmarks/routing.py sweeps the load; docs/"
              f"routing.md says how to evaluate a routing policy on a trace of your own.)")
    return results


def _node_summary(out: Console, db: tensordb.Database) -> None:
    """Part 6, continued: what a live router reads of a node, from this store."""
    bt = 16
    kv = db.kv("demo-router", block_tokens=bt, capacity_bytes=4 << 20, slab_bytes=1 << 20)
    try:
        keys = kv.keys(np.arange(6 * bt, dtype=np.int64))  # a prompt of six blocks
        kv.put(keys[:4], [torch.zeros(bt, 8) for _ in range(4)])
        summary = kv.stats()
        state = cluster_view([summary], keys).instances[0]
    finally:
        kv.destroy()
    out.print(f"   A live router sees each node through its KV store's own summary: this "
              f"store's db.kv(...).stats() is a tensordb.KVNodeSummary ({summary.blocks} "
              f"blocks, a {len(summary.bloom):,}-byte Bloom filter of their keys), and "
              f"cluster_view turns it into what a routing policy reads: a six-block prompt "
              f"of which this node holds the first {state.prefix_hits // bt} blocks, "
              f"prefix_hits = {state.prefix_hits} tokens.")


# -- the tour --------------------------------------------------------------------------
def run(console: Console | None = None) -> None:
    """Run the tour on a temporary store, printing to ``console``; removes the store."""
    out = console or Console(highlight=False)
    t_start = time.perf_counter()
    home = Path(tempfile.mkdtemp(prefix="tensordb-demo-"))
    db = None
    shm_dir: Path | None = None
    try:
        # the demo's store is on the host tier whatever the environment asks for
        db = tensordb.connect(home=home, default_tier="host", host_capacity=None,
                              spare_bytes=0)
        shm_dir = db.config.shm_dir
        out.print("[bold]tensordb demo[/bold]: a throwaway store")
        out.print(f"  catalog and disk tier: {escape(str(home))}")
        out.print(f"  shared-memory tier:    {escape(str(shm_dir))}")

        # 1. a model
        t = time.perf_counter()
        shape = _fit(shutil.disk_usage(shm_dir).free)
        sd = _model(shape)
        t_gen = time.perf_counter() - t
        total = sum(v.nbytes for v in sd.values())
        by_dtype: dict[str, int] = {}
        for v in sd.values():
            key = str(v.dtype).removeprefix("torch.")
            by_dtype[key] = by_dtype.get(key, 0) + v.nbytes
        out.print(f"\n[bold]1. A model[/bold]: a transformer-shaped state_dict with "
                  f"{shape.layers} layers, {len(sd)} tensors, {human_bytes(total)} ("
                  + ", ".join(f"{human_bytes(n)} {k}" for k, n in by_dtype.items())
                  + f"), made in {_fmt_s(t_gen)}.")

        # 2. commit version 1
        memcpy = _memcpy_gbps()
        t = time.perf_counter()
        c1 = db.commit(COLLECTION, sd, message="initial weights")
        t_c1 = time.perf_counter() - t
        populate = _populate_gbps(shm_dir.parent, c1.nbytes)
        out.print(f"\n[bold]2. Commit[/bold]: db.commit({COLLECTION!r}, state_dict) published "
                  f"version {c1.version}: {human_bytes(c1.nbytes)} in {_fmt_s(t_c1)}, "
                  f"{c1.nbytes / t_c1 / 1e9:.2f} GB/s (a plain memory copy on this machine: "
                  f"{memcpy:.2f} GB/s; writing a fresh shared-memory file of that size on one "
                  f"thread, the most a first write into new shared memory gets here: "
                  f"{populate:.2f} GB/s). The bytes now live in shared memory, checksummed; "
                  f"a first commit's time is mostly the kernel making fresh pages, which a "
                  f"writer that commits often reuses (gc pools freed segments) or keeps ready "
                  f"with db.prefault.")

        # 3. a second process reads it
        expected = {n: _digest(sd[n]) for n in _CHECKED}
        r, wall = _second_process(home, COLLECTION, expected)
        checks = r.checks
        ok = all(checks.values()) and r.inside == r.tensors
        out.print(f"\n[bold]3. A second process[/bold] (pid {r.pid}) opened version "
                  f"{r.version} and got all {r.tensors} tensors ({human_bytes(r.nbytes)}) "
                  f"as torch tensors in {_fmt_s(r.open_s)}.")
        out.print(f"   {r.inside} of {r.tensors} tensors' data pointers lie inside its "
                  f"mappings of the store's shared-memory files ({', '.join(r.maps)}: "
                  f"'p' = private, copy-on-write): not one byte was copied.")
        out.print(f"   The checksums of {len(checks)} tensors match what was committed: "
                  + ("[green]yes[/green]" if all(checks.values()) else
                     "[red]NO: " + ", ".join(n for n, good in checks.items() if not good)
                     + "[/red]"))
        out.print(f"   (Process start-up, Python and torch imports included, took "
                  f"{_fmt_s(wall)} of wall time; importing tensordb and connecting "
                  f"{_fmt_s(r.import_s)}.)")
        if not ok:
            raise RuntimeError("the second process did not see the committed bytes zero-copy")

        # 4. a reader's write stays private
        mine = db.get(COLLECTION, _COW)
        before = float(mine[0, 0])
        mine.fill_(42.0)
        with db.snapshot(COLLECTION) as snap:
            again = snap[_COW]
            unchanged = _digest(again) == _digest(sd[_COW])
            after = float(again[0, 0])
        out.print(f"\n[bold]4. Copy-on-write[/bold]: this process took {_COW} with db.get "
                  f"and wrote 42 into it (its [0, 0] was {before:.4f}, now "
                  f"{float(mine[0, 0]):g}).")
        out.print(f"   A fresh snapshot reads [0, 0] = {after:.4f}, checksum "
                  + ("unchanged: [green]the store never saw the write[/green]." if unchanged
                     else "[red]CHANGED[/red]."))
        if not unchanged:
            raise RuntimeError("a reader's write reached the store")
        del mine, again

        # 5. version 2 changes one tensor
        sd2 = dict(sd)
        sd2[_CHANGED] = sd[_CHANGED] * 0.5
        t = time.perf_counter()
        c2 = db.commit(COLLECTION, sd2, message="fine-tune: one tensor changed")
        t_c2 = time.perf_counter() - t
        shared = c2.nbytes - c2.written_nbytes
        out.print(f"\n[bold]5. Version 2[/bold]: db.commit of the whole state_dict with one "
                  f"tensor changed took {_fmt_s(t_c2)}. It wrote {c2.written} tensor "
                  f"({human_bytes(c2.written_nbytes)}) and shares the other "
                  f"{c2.tensors - c2.written} ({human_bytes(shared)}, "
                  f"{100 * shared / c2.nbytes:.1f}%) with version 1.\n")
        out.print(history_table(db.history(COLLECTION), title=f"history of {COLLECTION}"))

        timings = Table(title="timings", title_justify="left", box=box.SIMPLE_HEAD,
                        show_edge=False, pad_edge=False, collapse_padding=True)
        timings.add_column("step")
        timings.add_column("time", justify="right")
        timings.add_column("rate", justify="right")
        timings.add_row("commit v1 (full model)", _fmt_s(t_c1),
                        f"{c1.nbytes / t_c1 / 1e9:.2f} GB/s")
        timings.add_row("second process: open + map all tensors", _fmt_s(r.open_s), "no copy")
        timings.add_row(f"second process: checksum {len(r.checks)} tensors",
                        _fmt_s(r.check_s), "")
        timings.add_row("second process: start-up, imports", _fmt_s(wall), "")
        timings.add_row("commit v2 (one tensor changed)", _fmt_s(t_c2),
                        f"{human_bytes(c2.written_nbytes)} written")
        timings.add_row("memcpy on this machine (reference)", "", f"{memcpy:.2f} GB/s")
        timings.add_row("fresh shared memory written once, one thread (reference)", "",
                        f"{populate:.2f} GB/s")
        t = time.perf_counter()
        _routing(out)
        _node_summary(out, db)
        t_route = time.perf_counter() - t
        timings.add_row(f"routing: {len(_ROUTING_POLICIES)} routing policies x 2, simulated",
                        _fmt_s(t_route), "")
        out.print()
        out.print(timings)
        out.print(
            "\n[bold]What happened[/bold]\n"
            "- A commit copies the tensors once into shared memory and records them in a "
            "catalog; readers see a whole version or none of it.\n"
            "- Any process on this host maps those bytes instead of loading a file: a "
            "model is in memory once, however many engines use it.\n"
            "- What a reader writes into its tensors stays in its own private copy of "
            "the page; the store does not change.\n"
            "- A new version stores only what changed and shares the rest, so frequent "
            "weight updates cost what they change.\n"
            "- A router that knows which engine holds a session's KV sends the next turn "
            "there, or moves the KV through the store, instead of recomputing it; the "
            "store's own summary of each node's KV tells it where that is.\n"
            "- Try it on your own store: tensordb ls, log, show, tag, gc, verify.")
        out.print(f"\ndone in {time.perf_counter() - t_start:.1f} s; the demo store is "
                  f"removed.")
    finally:
        if db is not None:
            db.close()
        shutil.rmtree(home, ignore_errors=True)
        if shm_dir is not None:
            shutil.rmtree(shm_dir, ignore_errors=True)
