"""Weight-sync benchmark: a publisher commits a new version of a ~1 GiB model (every
tensor changed); a subscriber process applies it to its live torch module.

What it measures, all in one run on one host (timestamps are ``time.time()`` of both
processes, compared across a pipe):

* ``memcpy``: numpy ``copyto`` of the model's byte count into a pre-touched
  destination, 1 thread and 2 threads, best of ``--reps``: the physical limit of moving
  the bytes once (the commit and the copy mode's apply copy on the store's 2 I/O
  threads, so their bound is the 2-thread figure);
  beside it, what writing into the store's shared memory allows (``_common.
  measure_shm_write``: from torch tensors into a pre-faulted shared-memory file on two
  threads, a plain copy and the store's copy + checksum, the bound of a commit);
* ``copy mode``: commit start in the publisher (a plain ``db.commit``: no ``prefault``,
  no environment variables) to ``apply()`` done in a subscriber whose
  ``WeightUpdater(mode="copy")`` follows the collection (``db.watch``) and copies every
  tensor into its module;
* ``swap mode``: the same with ``mode="swap"``: the subscriber repoints its module at the
  new version's zero-copy tensors. The commit itself (the publisher's copy into the
  store) is the same in both modes, so the table also shows commit-visible to applied;
* ``disk round trip`` (what users do today): the publisher ``safetensors.torch.save_file``
  to a directory (``--disk-dir``; its page cache stays warm), the subscriber, told by the
  pipe, ``load_file`` + ``load_state_dict``; save start to load done. torch.save/load
  when safetensors is not installed.

The publisher is a trainer that commits every step: the collection keeps 2 versions
(``db.set_retention``) and the publisher runs ``db.gc()`` between steps, which hands the
files of dropped versions to the store's pool; later commits reuse them, so in the steady
state no page is faulted in. The first versions (``--cold``, default 3) of each path,
the disk round trip's included, are printed apart: they pay the page faults of fresh
memory (the disk's, of fresh page-cache pages); every path is judged on the same
number of steady versions.

Each subscriber checks, after every apply, that every tensor holds the version's value
(first and last element). Goals printed beside, on the steady versions: copy mode <= 2 x
memcpy on 2 threads; >= 10 x faster than the disk round trip; swap mode <= 10 ms (commit visible to
applied: the publisher's own copy into the store is a memcpy of the model in any mode).
Without the disk round trip (``--skip-disk``) its two goals print "not measured" and
fail (``_verdict``); the script exits 1 unless every goal is met.

Run:  .venv/bin/python -m benchmarks.weight_sync [--total-mib 1024] [--tensors 224] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

import tensordb
from benchmarks import _common, _verdict
from benchmarks._verdict import Verdict
from engine_bindings import UpdateReport, WeightUpdater

GB = 1e9
MiB = 1 << 20
GOAL_COPY_X_MEMCPY = 2.0
GOAL_X_DISK = 10.0
GOAL_SWAP_MS = 10.0
COLLECTION = "model"

Spec = list[tuple[str, str, tuple[int, ...]]]


# -- the model ----------------------------------------------------------------------------
def model_spec(total_mib: int, tensors: int) -> Spec:
    """Names, dtypes and shapes of a transformer-like model: per layer four square-ish
    projections (float32), two MLP matrices (bfloat16) and a norm (float32), sized so the
    whole is ``total_mib``."""
    per_layer = 7
    layers = max(1, tensors // per_layer)
    budget = total_mib * MiB // layers
    # bytes per layer = 4 * (h*h*4) + 2 * (h*4h*2) + h*4  ~= 32 h^2
    hidden = max(64, int((budget / 32) ** 0.5) // 64 * 64)
    spec: Spec = []
    for i in range(layers):
        p = f"layers.{i}"
        for n in ("q", "k", "v", "o"):
            spec.append((f"{p}.attn.{n}", "float32", (hidden, hidden)))
        spec.append((f"{p}.mlp.up", "bfloat16", (4 * hidden, hidden)))
        spec.append((f"{p}.mlp.down", "bfloat16", (hidden, 4 * hidden)))
        spec.append((f"{p}.norm", "float32", (hidden,)))
    return spec


class Model(torch.nn.Module):
    """Parameters named as in the spec, pre-touched (zeros)."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        for name, dtype, shape in spec:
            *path, leaf = name.split(".")
            mod: torch.nn.Module = self
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, torch.nn.Parameter(
                torch.zeros(shape, dtype=getattr(torch, dtype)), requires_grad=False))


def fill(sd: dict[str, torch.Tensor], value: float) -> None:
    for t in sd.values():
        t.fill_(value)


def holds(sd: dict[str, torch.Tensor], value: float) -> bool:
    return all(float(t.reshape(-1)[0]) == value and float(t.reshape(-1)[-1]) == value
               for t in sd.values())


# -- subscribers (child processes) --------------------------------------------------------
def store_subscriber(home: str, spec: Spec, mode: str, last: int,
                     conn: mp.connection.Connection) -> None:
    db = tensordb.connect(home=home)
    module = Model(spec)
    updater = WeightUpdater(db, COLLECTION, module, mode=mode)
    first = updater.apply()  # the version already there: faults everything in once
    conn.send(("ready", first.version, first.seconds))

    def applied(report: UpdateReport) -> None:
        done = time.time()
        ok = holds(module.state_dict(), float(report.version))
        conn.send(("applied", report.version, done, report.seconds, report.bytes_copied,
                   len(report.changed), ok))
        if report.version >= last:
            updater.stop()

    updater.follow(timeout=120, every=True, on_update=applied)
    updater.close()
    db.close()
    conn.send(("done",))


def disk_subscriber(spec: Spec, conn: mp.connection.Connection) -> None:
    module = Model(spec)
    try:
        from safetensors.torch import load_file
    except ImportError:
        load_file = None
    conn.send(("ready",))
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        _, path, version = msg
        if load_file is not None:
            sd = load_file(path)
        else:
            sd = torch.load(path, weights_only=True)
        module.load_state_dict(sd)
        done = time.time()
        del sd
        conn.send(("applied", version, done, holds(module.state_dict(), float(version))))


# -- publisher ------------------------------------------------------------------------------
def measure_memcpy(nbytes: int, reps: int) -> dict[str, float]:
    return _common.measure_memcpy(nbytes, reps + 1)


def run_store_mode(ctx: Any, db: tensordb.Database, home: str, spec: Spec,
                   sd: dict[str, torch.Tensor], mode: str, reps: int,
                   cold: int) -> dict[str, Any]:
    nbytes = sum(t.nbytes for t in sd.values())
    head = db.history(COLLECTION)[0].version
    last = head + reps
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=store_subscriber, args=(home, spec, mode, last, child))
    proc.start()
    runs: list[dict[str, Any]] = []
    try:
        msg = parent.recv()
        assert msg[0] == "ready", msg
        first_apply_s = msg[2]
        for v in range(head + 1, last + 1):
            fill(sd, float(v))
            db.gc()  # the trainer's gc: what retention dropped goes to the pool
            t_start = time.time()
            c = db.commit(COLLECTION, sd, message=f"{mode} {v}")
            t_visible = time.time()
            assert c.version == v and c.written == len(sd)
            msg = parent.recv()
            assert msg[0] == "applied" and msg[1] == v, msg
            _, _, t_done, apply_s, copied, changed, ok = msg
            runs.append({"version": v, "end_to_end_s": t_done - t_start,
                         "commit_s": t_visible - t_start,
                         "visible_to_applied_s": t_done - t_visible, "apply_s": apply_s,
                         "bytes_copied": copied, "changed": changed, "values_ok": ok,
                         "nbytes": nbytes})
        assert parent.recv()[0] == "done"
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    out = summarise(runs[cold:] or runs, first_apply_s=first_apply_s)
    out["cold_runs"] = runs[:cold]
    out["runs"] = runs
    out["values_ok"] = all(r["values_ok"] for r in runs)
    return out


def run_disk(ctx: Any, spec: Spec, sd: dict[str, torch.Tensor], reps: int,
             disk_dir: str, cold: int) -> dict[str, Any]:
    try:
        from safetensors.torch import save_file
        how = "safetensors save_file -> load_file + load_state_dict"
    except ImportError:
        save_file = None
        how = "torch.save -> torch.load + load_state_dict"
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=disk_subscriber, args=(spec, child))
    proc.start()
    runs = []
    old: str | None = None
    try:
        assert parent.recv()[0] == "ready"
        for v in range(1, reps + 1):
            fill(sd, float(200 + v))  # exact in bfloat16
            path = os.path.join(disk_dir, f"step-{v}.safetensors")
            t_start = time.time()
            if save_file is not None:
                save_file(sd, path)
            else:
                torch.save(sd, path)
            t_saved = time.time()
            parent.send(("load", path, 200 + v))
            msg = parent.recv()
            assert msg[0] == "applied" and msg[1] == 200 + v, msg
            runs.append({"version": v, "end_to_end_s": msg[2] - t_start,
                         "commit_s": t_saved - t_start,
                         "visible_to_applied_s": msg[2] - t_saved, "values_ok": msg[3]})
            if old is not None:
                os.unlink(old)
            old = path
        parent.send(("stop",))
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        if old is not None and os.path.exists(old):
            os.unlink(old)
    out = summarise(runs[cold:] or runs)  # its steady versions, as the store's are
    out["cold_runs"] = runs[:cold]
    out["runs"] = runs
    out["values_ok"] = all(r["values_ok"] for r in runs)
    out["how"] = how
    return out


def summarise(runs: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": runs, **extra}
    for key in ("end_to_end_s", "commit_s", "visible_to_applied_s", "apply_s"):
        vals = [r[key] for r in runs if key in r]
        if vals:
            out[key.replace("_s", "_best_s")] = min(vals)
            out[key.replace("_s", "_median_s")] = statistics.median(vals)
    out["values_ok"] = all(r["values_ok"] for r in runs)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = model_spec(args.total_mib, args.tensors)
    sd = {name: torch.zeros(shape, dtype=getattr(torch, dtype)) for name, dtype, shape in spec}
    nbytes = sum(t.nbytes for t in sd.values())
    res: dict[str, Any] = {"tensors": len(sd), "bytes": nbytes,
                           "dtypes": sorted({d for _, d, _ in spec}),
                           "loadavg_before": os.getloadavg()[0]}
    mc = measure_memcpy(nbytes, args.reps)
    res["memcpy_s"], res["memcpy_2t_s"] = mc["memcpy_1t_s"], mc["memcpy_2t_s"]
    res["shm_write"] = _common.measure_shm_write(nbytes, args.reps + 1)
    ctx = mp.get_context("spawn")
    home = tempfile.mkdtemp(prefix="tensordb-bench-sync-", dir=args.tmp_dir)
    disk_dir = tempfile.mkdtemp(prefix="tensordb-bench-sync-disk-", dir=args.disk_dir)
    db = tensordb.connect(home=home)
    try:
        fill(sd, 1.0)
        t0 = time.perf_counter()
        db.commit(COLLECTION, sd, message="initial")
        res["first_commit_s"] = time.perf_counter() - t0  # a fresh store: every page faults
        db.set_retention(COLLECTION, 2)  # the trainer keeps two versions
        cold = min(args.cold, args.reps - 1)
        res["copy"] = run_store_mode(ctx, db, home, spec, sd, "copy", args.reps, cold)
        res["swap"] = run_store_mode(ctx, db, home, spec, sd, "swap", args.reps, cold)
        res["pool"] = db.tier("host").pool_counters()  # type: ignore[attr-defined]
        db.gc()
        if not args.skip_disk:
            res["disk"] = run_disk(ctx, spec, sd, args.reps, disk_dir, cold)
            res["disk_dir"] = disk_dir
    finally:
        db.close()
        shutil.rmtree(db.config.shm_dir, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(disk_dir, ignore_errors=True)
    res["loadavg_after"] = os.getloadavg()[0]
    mc = res["memcpy_s"]
    res["copy"]["x_memcpy"] = res["copy"]["end_to_end_median_s"] / mc
    res["swap"]["x_memcpy"] = res["swap"]["end_to_end_median_s"] / mc
    # the commit and the copy apply both copy on the I/O threads (2): their bound
    res["copy"]["x_memcpy_2t"] = res["copy"]["end_to_end_median_s"] / res["memcpy_2t_s"]
    if "disk" in res:
        for mode in ("copy", "swap"):
            res[mode]["x_faster_than_disk"] = (res["disk"]["end_to_end_median_s"]
                                               / res[mode]["end_to_end_median_s"])
        res["disk"]["x_memcpy"] = res["disk"]["end_to_end_median_s"] / mc
    res["goals"] = goals(res)
    return res


def goals(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each goal's verdict (``_verdict`` JSON) by key; without the disk round trip its
    goals are not measured."""
    x = res["copy"]["x_memcpy_2t"]
    swap_ms = res["swap"]["visible_to_applied_median_s"] * 1e3
    out: dict[str, Verdict] = {
        "copy_x_memcpy": _verdict.at_most(
            f"copy mode end to end <= {GOAL_COPY_X_MEMCPY:g} x memcpy 2 threads", x,
            GOAL_COPY_X_MEMCPY, f"{x:.2f} x"),
        "swap_visible_to_applied": _verdict.at_most(
            f"swap mode visible -> applied <= {GOAL_SWAP_MS:g} ms", swap_ms, GOAL_SWAP_MS,
            f"{swap_ms:.1f} ms")}
    for mode in ("copy", "swap"):
        xd = res[mode].get("x_faster_than_disk")
        out[f"{mode}_x_disk"] = _verdict.at_least(
            f"{mode} mode >= {GOAL_X_DISK:g} x faster than the disk round trip", xd,
            GOAL_X_DISK, "" if xd is None else f"{xd:.1f} x",
            reason="the disk round trip did not run (--skip-disk)")
    ok = all(res[k]["values_ok"] for k in ("copy", "swap", "disk") if k in res)
    out["values_ok"] = _verdict.judge("every applied module holds its version's values", ok)
    return {k: v.to_json() for k, v in out.items()}


def verdicts(res: dict[str, Any]) -> dict[str, Verdict]:
    return {k: Verdict(g["goal"], g["state"], g["detail"]) for k, g in res["goals"].items()}


def print_report(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=130)
    mc = res["memcpy_s"]
    g = verdicts(res)
    con.print(f"[bold]weight sync[/]: {res['tensors']} tensors ({', '.join(res['dtypes'])}) = "
              f"{res['bytes'] / GB:.3f} GB, every tensor changed each version; median of "
              f"{len(res['copy']['runs']) - len(res['copy']['cold_runs'])} steady versions "
              f"(best beside); GB = 1e9 bytes")
    t = Table(title="publish-to-applied latency (publisher's commit start -> subscriber's "
                    "apply done)")
    for col in ("path", "end to end", "best", "commit / save", "visible -> applied",
                "x memcpy", "x faster than disk", "goal"):
        t.add_column(col, justify="left" if col in ("path", "goal") else "right")
    t.add_row("memcpy of the model's bytes, 1 thread", f"{mc * 1e3:.1f} ms", "", "", "",
              "1.00", "", f"{res['bytes'] / mc / GB:.2f} GB/s")
    mc2 = res["memcpy_2t_s"]
    t.add_row("memcpy, 2 threads (the copy mode's bound)", f"{mc2 * 1e3:.1f} ms", "", "", "",
              f"{mc2 / mc:.2f}", "", f"{res['bytes'] / mc2 / GB:.2f} GB/s")
    w = res.get("shm_write")
    if w:
        for key, label in (("shm_copy_2t_s", "copy into shared memory, 2 threads"),
                           ("shm_copy_checksum_2t_s",
                            "copy + checksum into shared memory, 2 threads (a commit's "
                            "bound)")):
            t.add_row(label, f"{w[key] * 1e3:.1f} ms", "", "", "", f"{w[key] / mc:.2f}", "",
                      f"{res['bytes'] / w[key] / GB:.2f} GB/s")

    def ms(x: float) -> str:
        return f"{x * 1e3:.1f} ms"

    for key, label in (("copy", "tensordb, copy mode"), ("swap", "tensordb, swap mode")):
        r = res[key]
        disk_x = f"{r['x_faster_than_disk']:.1f}" if "x_faster_than_disk" in r else ""
        if key == "copy":
            goal = (f"<= {GOAL_COPY_X_MEMCPY} x memcpy 2t ({r['x_memcpy_2t']:.2f} x) "
                    f"{g['copy_x_memcpy'].mark()}")
        else:
            goal = (f"visible->applied <= {GOAL_SWAP_MS:g} ms "
                    f"{g['swap_visible_to_applied'].mark()}")
        disk = g[f"{key}_x_disk"]
        goal += f"; >= {GOAL_X_DISK:g} x disk " + (
            "[yellow]not measured[/]" if disk.state == _verdict.NOT_MEASURED else disk.mark())
        t.add_row(label, ms(r["end_to_end_median_s"]), ms(r["end_to_end_best_s"]),
                  ms(r["commit_median_s"]), ms(r["visible_to_applied_median_s"]),
                  f"{r['x_memcpy']:.2f}", disk_x, goal)
    if "disk" in res:
        r = res["disk"]
        t.add_row(f"today: {r['how']}", ms(r["end_to_end_median_s"]), ms(r["end_to_end_best_s"]),
                  ms(r["commit_median_s"]), ms(r["visible_to_applied_median_s"]),
                  f"{r['x_memcpy']:.2f}", "1.0", "")
    con.print(t)
    for key in ("copy", "swap"):
        r = res[key]
        con.print(f"{key} mode: apply() alone {ms(r['apply_median_s'])} median; first apply "
                  f"(whole model, cold) {ms(r['first_apply_s'])}; bytes copied per version "
                  f"{r['runs'][0]['bytes_copied']:,}; tensors changed {r['runs'][0]['changed']}")
    con.print(f"every applied module held exactly its version's values: {g['values_ok'].met}")
    con.print(f"cold: the first commit into the fresh store {ms(res['first_commit_s'])}; "
              "the first versions of each path (end to end / commit or save), before the "
              "pool holds freed files (and the disk's page cache the files' pages), apart:")
    for key in ("copy", "swap", "disk"):
        if key not in res:
            continue
        con.print(f"  {key}: " + ", ".join(
            f"v{r['version']} {ms(r['end_to_end_s'])} / {ms(r['commit_s'])}"
            for r in res[key]["cold_runs"]))
        con.print(f"  {key}, steady versions: " + ", ".join(
            f"v{r['version']} {ms(r['end_to_end_s'])} / {ms(r['commit_s'])}"
            for r in res[key]["runs"][len(res[key]["cold_runs"]):]))
    p = res.get("pool", {})
    con.print(f"publisher's pool: {p.get('claimed', 0)} commits reused a freed file "
              f"({p.get('mapping_reused', 0)} through the publisher's own mapping of it); "
              "no prefault, no environment variables")
    if w:
        con.print(f"shared memory here gets 4 KiB pages (transparent huge pages for shmem: "
                  f"{w['shmem_thp']}); the memcpy row's buffers may get huge pages")
    if "disk_dir" in res:
        con.print(f"disk round trip directory: {res['disk_dir']} (page cache warm)")
    con.print(f"1-min load average before/after: {res['loadavg_before']:.2f} / "
              f"{res['loadavg_after']:.2f} (other processes on the host skew the figures)")
    _verdict.print_verdicts(con, g.values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--total-mib", type=int, default=1024, help="model size in MiB (1024)")
    p.add_argument("--tensors", type=int, default=224, help="about how many tensors (224)")
    p.add_argument("--reps", type=int, default=8, help="versions published per path (8)")
    p.add_argument("--cold", type=int, default=3,
                   help="first versions of each store mode printed apart as cold (3)")
    p.add_argument("--skip-disk", action="store_true", help="skip the disk round trip")
    p.add_argument("--tmp-dir", default=None, help="where the temporary store goes")
    p.add_argument("--disk-dir", default=None, help="where the safetensors files go")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = p.parse_args(argv)
    res = run(args)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print_report(res)
    return _verdict.exit_code(verdicts(res).values())


if __name__ == "__main__":
    sys.exit(main())
