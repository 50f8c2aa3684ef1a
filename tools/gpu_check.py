"""`make gpu`: the GPU tier's tests and benchmarks on a CUDA host, in one report.

A GPU host may be lent for minutes, with no package registry, so everything is ready
before it is: ``prepare`` makes the venv (``.venv-gpu``), ``run`` runs the GPU tier's
tests and benchmarks within one overall timeout and writes the report, and ``wheels``
fills, on a host with a registry, the wheelhouse an offline GPU host installs from.

    python tools/gpu_check.py prepare [--venv .venv-gpu] [--wheels .whl-gpu]
    python tools/gpu_check.py wheels [--dest .whl-gpu] [--python-version 3.12]
    .venv-gpu/bin/python tools/gpu_check.py run [--timeout 420] [--out DIR]
    .venv/bin/python tools/gpu_check.py run --standin      # the same flow on the stand-in

``prepare`` picks one of two ways:

* *layered*, where the base python (``$GPU_BASE_PYTHON``, else ``python3``) already has
  a CUDA build of torch, as a GPU image has: a venv of that python that sees its
  packages (a ``.pth`` file adds its site directories after the venv's own), into which
  pip installs only what is missing, ``--no-index`` from the wheelhouse when there is
  one. cuda-python is installed only when ``cuda.bindings`` does not import already;
* *fresh* elsewhere: a venv with ``torch==2.14.1`` (a CUDA build) and cuda-python from
  the package index, then ``-e '.[test,gpu]'``.

cuda-python's major follows the driver: the CUDA version ``nvidia-smi`` reports (12 or
13; a CUDA 12 driver cannot load cuda-python 13), else pyproject's ``gpu`` extra.

``run`` writes ``gpu-report.json``, ``gpu-report.md`` and ``gpu-run.log`` into ``$OUT``
when it is set, else ``./gpu-report/`` (``--out`` overrides both), and rewrites them
after every step, so a run cut short still leaves what it measured. Sections: facts
(nvidia-smi, driver, torch, cuda-python, whether the GPU tier can run), tests (the
``gpu`` marker over tests/, and the GPU-tier test files' other tests: counts, failures,
skip reasons), benchmarks (their figures and goal verdicts, ``benchmarks._verdict``).
``--standin`` puts the stand-in CUDA runtime (tests/cuda_standin.py) in place of
cuda-python where a step can use it, at tiny sizes; what it cannot run (real device
copies, torch CUDA tensors) is reported "not measured" with the reason.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-gpu"
WHEELS = ROOT / ".whl-gpu"
TORCH = "torch==2.14.1"  # the CUDA build the engines' venvs use (from local disk here)
DEFAULT_TIMEOUT_S = 420  # tests and benchmarks; preparing the venv comes before
TIER_FILES = ["tests/test_gpu_tier.py", "tests/test_kv_gpu.py",
              "tests/test_arrow.py::test_gpu_tier_rows_come_back_as_host_copies"]
KV_GPU_STANDIN_WHY = ("it copies torch CUDA tensors, which need a device: the stand-in "
                      "replaces the CUDA runtime only")

#: what the ``wheels`` command fetches for an offline GPU host: the project's
#: requirements (and the build's) that a GPU image lacks; torch, numpy, pyarrow, jax,
#: pytest, hypothesis and cuda-bindings are in such images (see tools' docs in
#: docs/testing.md). Their own requirements come along.
OFFLINE_WHEELS = [
    "setuptools>=74.1", "wheel", "sqlalchemy>=2.0", "alembic>=1.13", "lark>=1.1",
    "lmdb>=1.4", "tenacity>=8.2", "psycopg[binary]>=3.1", "apscheduler>=3.10,<4",
    "pyzmq>=25", "msgspec>=0.18", "xxhash>=3.4", "typer>=0.12", "prometheus_client>=0.20",
    "safetensors>=0.4",
]


# -- the driver and the cuda-python it takes --------------------------------------------
def nvidia_smi() -> dict[str, Any]:
    """What nvidia-smi says of the GPUs and the driver; ``error`` when it cannot say."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"error": "nvidia-smi is not on the PATH"}
    fields = ["name", "driver_version", "memory.total", "pci.bus_id", "compute_cap"]
    try:
        q = subprocess.run([exe, f"--query-gpu={','.join(fields)}",
                            "--format=csv,noheader"], capture_output=True, text=True,
                           timeout=30)
        head = subprocess.run([exe], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"error": f"nvidia-smi failed: {type(exc).__name__}: {exc}"}
    if q.returncode != 0:
        return {"error": f"nvidia-smi exited {q.returncode}: "
                         f"{(q.stderr or q.stdout).strip()[:300]}"}
    gpus = [dict(zip(fields, (c.strip() for c in line.split(",")), strict=False))
            for line in q.stdout.splitlines() if line.strip()]
    return {"gpus": gpus, "driver_version": gpus[0]["driver_version"] if gpus else None,
            "cuda_version": cuda_version_of(head.stdout)}


def cuda_version_of(smi_text: str) -> str | None:
    """The "CUDA Version: 13.0" of nvidia-smi's header: the newest CUDA the driver runs."""
    m = re.search(r"CUDA Version:\s*([0-9]+(?:\.[0-9]+)?)", smi_text)
    return m.group(1) if m else None


def cuda_major(smi: dict[str, Any]) -> int | None:
    """The CUDA major the driver runs: from its CUDA version, else its driver version
    (580 and later run CUDA 13, 525 and later CUDA 12)."""
    if smi.get("cuda_version"):
        return int(str(smi["cuda_version"]).split(".")[0])
    drv = smi.get("driver_version")
    if not drv:
        return None
    branch = int(str(drv).split(".")[0])
    return 13 if branch >= 580 else 12 if branch >= 525 else None


def extra_spec(extra: str = "gpu") -> str:
    """pyproject's requirement for cuda-python in the ``gpu`` extra."""
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(rf'^{extra}\s*=\s*\[\s*"(cuda-python[^"]*)"', text, re.M)
    return m.group(1) if m else "cuda-python>=12.6"


def cuda_python_spec(major: int | None, default: str | None = None) -> str:
    """The cuda-python for a driver of CUDA ``major``: 12.x on a CUDA 12 driver (13 does
    not load there), 13.x on a CUDA 13 one; the extra's requirement when unknown."""
    if major == 12:
        return "cuda-python>=12.6,<13"
    if major == 13:
        return "cuda-python>=13,<14"
    return default or extra_spec()


# -- preparing the venv ------------------------------------------------------------------
_PROBE = r"""
import json, site, sys
out = {"python": sys.version.split()[0], "executable": sys.executable,
       "site": site.getsitepackages()}
try:
    import torch
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
except Exception as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"
try:
    import cuda.bindings.runtime  # noqa: F401
    out["cuda_bindings"] = True
except Exception:
    try:
        import cuda.cudart  # noqa: F401
        out["cuda_bindings"] = True
    except Exception:
        out["cuda_bindings"] = False
try:
    import pip  # noqa: F401
    out["pip"] = True
except Exception:
    out["pip"] = False
print(json.dumps(out))
"""


def probe_python(python: str) -> dict[str, Any] | None:
    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True,
                             timeout=180)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def _sh(cmd: list[str], log: list[str]) -> None:
    log.append("$ " + " ".join(cmd))
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def _venv_site(venv: Path) -> Path:
    found = sorted((venv / "lib").glob("python3*/site-packages"))
    if not found:
        raise SystemExit(f"{venv}: no site-packages")
    return found[0]


def _make_venv(base: str, venv: Path, log: list[str]) -> list[str]:
    """A venv of ``base``; returns the pip command that installs into it."""
    if not (venv / "bin" / "python").exists():
        try:
            _sh([base, "-m", "venv", str(venv)], log)
        except subprocess.CalledProcessError:  # no ensurepip: the base's pip serves
            shutil.rmtree(venv, ignore_errors=True)
            _sh([base, "-m", "venv", "--without-pip", str(venv)], log)
    py = str(venv / "bin" / "python")
    if subprocess.run([py, "-c", "import pip"], capture_output=True).returncode == 0:
        return [py, "-m", "pip"]
    return [base, "-m", "pip", "--python", py]


def _requirements(extras: str) -> list[str]:
    import tomllib

    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(proj["dependencies"])
    for extra in extras.split(","):
        reqs += proj["optional-dependencies"][extra]
    return reqs


def _install_project(pip: list[str], index: list[str], build: list[str], extras: str,
                     venv: Path, log: list[str]) -> str:
    """``-e .[extras]``; where that fails (the C extension does not build, say), the
    requirements alone and the checkout on the path: the store then copies with numpy
    (``storage_engine.STREAMING`` is False), and the run still runs."""
    try:
        _sh([*pip, "install", "-q", *index, *build, "-e", f".[{extras}]"], log)
        return "editable"
    except subprocess.CalledProcessError as exc:
        why = f"the editable install failed (exit {exc.returncode})"
    _sh([*pip, "install", "-q", *index, *_requirements(extras)], log)
    (_venv_site(venv) / "_tensordb_checkout.pth").write_text(f"{ROOT}\n")
    return f"from the checkout, without the C extension: {why}"


def prepare(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    venv = Path(args.venv).resolve()
    wheels = Path(args.wheels).resolve() if args.wheels else None
    smi = nvidia_smi()
    spec = args.cuda_python or cuda_python_spec(cuda_major(smi))
    base = args.base or os.environ.get("GPU_BASE_PYTHON") or shutil.which("python3") \
        or sys.executable
    info = probe_python(base) or {}
    layered = bool(info.get("torch_cuda")) or args.layered
    # the wheelhouse is made for a GPU image's python (``wheels``): a fresh venv, whose
    # torch and cuda-python come from the index, does not use it
    offline = (layered and wheels is not None and wheels.is_dir()
               and any(wheels.glob("*.whl")))
    index = ["--no-index", "--find-links", str(wheels)] if offline else []
    log: list[str] = []
    pip = _make_venv(base if layered else (args.python or sys.executable), venv, log)
    if layered:
        # the base's packages (its CUDA torch) after the venv's own; addsitedir also
        # reads the .pth files there
        dirs = [d for d in info.get("site", []) if Path(d).is_dir()]
        (_venv_site(venv) / "_gpu_base.pth").write_text(
            "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n")
        extras = "test" if info.get("cuda_bindings") else "test,gpu"
        # the build's own setuptools in the venv: an isolated build would still see
        # the base's (older) one first, through the .pth
        _sh([*pip, "install", "-q", *index, "setuptools>=74.1", "wheel"], log)
        build = ["--no-build-isolation"]
        if not info.get("cuda_bindings"):
            _sh([*pip, "install", "-q", *index, spec], log)
    else:
        _sh([*pip, "install", "-q", "--upgrade", "pip"], log)
        _sh([*pip, "install", "-q", *index, TORCH], log)
        _sh([*pip, "install", "-q", *index, spec], log)
        extras = "test,gpu"
        build = []
    project = _install_project(pip, index, build, extras, venv, log)
    after = probe_python(str(venv / "bin" / "python")) or {}
    stamp = {"mode": "layered" if layered else "fresh", "base": base,
             "base_python": info.get("python"), "offline": offline,
             "cuda_python_spec": spec, "cuda_python_installed": extras == "test,gpu",
             "project": project,
             "nvidia_smi": smi, "torch": after.get("torch"),
             "torch_cuda": after.get("torch_cuda"),
             "cuda_bindings_import": after.get("cuda_bindings"), "commands": log,
             "seconds": round(time.monotonic() - t0, 1),
             "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    (venv / ".installed").write_text(json.dumps(stamp, indent=2) + "\n")
    print(f"prepared {venv.name} ({stamp['mode']}{', offline' if offline else ''}) in "
          f"{stamp['seconds']} s: torch {stamp['torch']} (CUDA {stamp['torch_cuda']}), "
          f"{spec}, cuda.bindings imports: {stamp['cuda_bindings_import']}")
    return 0


def wheels(args: argparse.Namespace) -> int:
    """Download, for an offline GPU host's python, the wheels ``prepare`` installs there."""
    dest = Path(args.dest).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    ver = args.python_version
    plats = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64"]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
           "--python-version", ver, "--implementation", "cp", "-d", str(dest)]
    for p in plats:
        cmd += ["--platform", p]
    cmd += OFFLINE_WHEELS + list(args.extra)
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    got = sorted(dest.glob("*.whl"))
    mib = sum(p.stat().st_size for p in got) / (1 << 20)
    print(f"{len(got)} wheels, {mib:.1f} MiB, in {dest} (carry it to the GPU host)")
    return 0


# -- the run -------------------------------------------------------------------------
_FACTS = r"""
import importlib, importlib.metadata as md, json, platform, sys, tempfile
from pathlib import Path
standin = sys.argv[1] == "1"
out = {"python": platform.python_version(), "executable": sys.executable,
       "platform": platform.platform(), "packages": {}}
for name in ("torch", "cuda-python", "cuda-bindings", "cuda-core", "numpy", "tensordb"):
    try:
        out["packages"][name] = md.version(name)
    except md.PackageNotFoundError:
        out["packages"][name] = None
try:
    import torch
    t = {"version": torch.__version__, "cuda_build": torch.version.cuda,
         "cuda_available": torch.cuda.is_available()}
    if t["cuda_available"]:
        t["device_count"] = torch.cuda.device_count()
        t["device"] = torch.cuda.get_device_name(0)
        t["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    out["torch"] = t
except Exception as exc:
    out["torch"] = {"error": f"{type(exc).__name__}: {exc}"}
cp = {}
for mod in ("cuda.bindings.runtime", "cuda.cudart"):
    try:
        importlib.import_module(mod)
        cp["module"] = mod
        break
    except Exception as exc:
        cp.setdefault("errors", []).append(f"{mod}: {type(exc).__name__}: {exc}")
out["cuda_python"] = cp
tier = {"runtime": "cuda-python"}
if standin:
    sys.path.insert(0, "tests")
    from cuda_standin import install
    install(Path(tempfile.mkdtemp(prefix="tensordb-standin-facts-")))
    tier["runtime"] = "stand-in (tests/cuda_standin.py)"
import storage_engine
from storage_engine import GpuTier
out["c_extension"] = bool(storage_engine.STREAMING)
tier["available"] = GpuTier.available()
tier["unavailable_reason"] = GpuTier.unavailable_reason()
out["gpu_tier"] = tier
print(json.dumps(out))
"""


class Run:
    """One run's report, rewritten after every step."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out or os.environ.get("OUT") or ROOT / "gpu-report")
        self.out.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.timeout
        self.logf = open(self.out / "gpu-run.log", "w")  # noqa: SIM115 - for the run
        self.report: dict[str, Any] = {
            "schema": 1, "mode": "standin" if args.standin else "device",
            "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "timeout_s": args.timeout, "prepare": read_stamp(),
            "facts": {}, "tests": [], "benchmarks": [], "summary": {}}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def sh(self, name: str, cmd: list[str], cap: float | None = None,
           env: dict[str, str] | None = None) -> tuple[int | None, str, float]:
        """Run ``cmd`` within what is left of the run's time (and ``cap``): (exit status,
        None when it timed out; stdout; seconds). Both streams go to the log."""
        limit = max(1.0, min(self.left(), cap or float("inf")))
        self.logf.write(f"\n===== {name}: {' '.join(cmd)} (limit {limit:.0f} s)\n")
        self.logf.flush()
        t = time.monotonic()
        try:
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                               timeout=limit, env=env)
            rc, out, err = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as exc:
            rc = None
            out = _text(exc.stdout)
            err = _text(exc.stderr) + f"\n[timed out after {limit:.0f} s]"
        self.logf.write(out + ("\n----- stderr\n" + err if err else ""))
        self.logf.flush()
        return rc, out, time.monotonic() - t

    def save(self) -> None:
        self.report["summary"] = summarize(self.report, time.monotonic() - self.t0)
        (self.out / "gpu-report.json").write_text(json.dumps(self.report, indent=2) + "\n")
        (self.out / "gpu-report.md").write_text(render_md(self.report))


def _text(b: bytes | str | None) -> str:
    if b is None:
        return ""
    return b if isinstance(b, str) else b.decode(errors="replace")


def read_stamp() -> dict[str, Any] | None:
    """What ``prepare`` recorded in the venv this run uses (None: not a prepared venv)."""
    venv = Path(sys.prefix)
    try:
        data = json.loads((venv / ".installed").read_text())
    except (OSError, ValueError):  # .venv's stamp is empty: not JSON
        return None
    return {**data, "venv": str(venv)} if isinstance(data, dict) else None


def step_facts(run: Run) -> None:
    smi = nvidia_smi()
    rc, out, _ = run.sh("facts", [sys.executable, "-c", _FACTS,
                                  "1" if run.args.standin else "0"], cap=120)
    facts: dict[str, Any] = {"nvidia_smi": smi}
    try:
        facts.update(json.loads(out.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        facts["error"] = f"the facts probe failed (exit {rc}): see gpu-run.log"
    facts["cuda_python_for_driver"] = cuda_python_spec(cuda_major(smi))
    run.report["facts"] = facts
    run.save()


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts, failures and skip reasons of a pytest junit-xml file."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures: list[dict[str, str]] = []
    skips: dict[str, int] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag: child for child in case}
        if "failure" in kinds or "error" in kinds:
            tag = "failure" if "failure" in kinds else "error"
            counts["failed" if tag == "failure" else "errors"] += 1
            el = kinds[tag]
            text = (el.get("message") or "") + "\n" + (el.text or "")
            failures.append({"test": test, "kind": tag, "message": text.strip()[-2000:]})
        elif "skipped" in kinds:
            counts["skipped"] += 1
            reason = kinds["skipped"].get("message") or "skipped"
            skips[reason] = skips.get(reason, 0) + 1
        else:
            counts["passed"] += 1
    counts["total"] = sum(counts.values())
    return {"counts": counts, "failures": failures,
            "skips": [{"reason": r, "count": n} for r, n in sorted(skips.items())]}


def step_tests(run: Run, name: str, what: str, pytest_args: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="tensordb-gpu-junit-") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--junitxml={xml}", *pytest_args]
        rc, _, secs = run.sh(name, cmd, cap=run.args.test_timeout)
        shown = [c for c in cmd[1:] if not c.startswith("--junitxml")]
        entry: dict[str, Any] = {"name": name, "what": what, "command": shown,
                                 "returncode": rc, "timed_out": rc is None,
                                 "seconds": round(secs, 1)}
        if xml.exists():
            entry.update(parse_junit(xml))
        else:
            why = "timed out" if rc is None else f"pytest exited {rc} with no results"
            entry.update(counts={"passed": 0, "failed": 0, "errors": 1, "skipped": 0,
                                 "total": 1},
                         failures=[{"test": name, "kind": "error",
                                    "message": f"{why}: see gpu-run.log"}], skips=[])
    run.report["tests"].append(entry)
    run.save()


def _json_of(stdout: str) -> dict[str, Any] | None:
    start = stdout.find("{")
    if start < 0:
        return None
    try:
        data = json.loads(stdout[start:])
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def step_bench(run: Run, name: str, args: list[str], standin_why: str = "") -> None:
    """Run ``benchmarks.NAME --json``: its figures and goals (not measured, saying why,
    where it did not run; ``standin_why``: why not on the stand-in)."""
    cmd = [sys.executable, "-m", f"benchmarks.{name}", *args]
    rc, out, secs = run.sh(name, cmd, cap=run.args.bench_timeout)
    res = _json_of(out)
    entry: dict[str, Any] = {"name": name, "command": cmd[1:], "returncode": rc,
                             "timed_out": rc is None, "seconds": round(secs, 1)}
    if res is None:
        why = (f"timed out after {secs:.0f} s" if rc is None
               else f"exited {rc} without its JSON: see gpu-run.log")
        entry.update(figures=None, goals=[{"goal": f"benchmarks/{name}.py",
                                           "state": "not measured", "met": False,
                                           "detail": why}])
    else:
        goals = res.pop("goals", None)
        if standin_why and res.get("skipped"):
            for g in goals or []:
                if g.get("state") == "not measured":
                    g["detail"] = f"{standin_why} ({g['detail']})"
        if not goals:
            goals = [{"goal": f"benchmarks/{name}.py", "state": "not measured",
                      "met": False, "detail": "the benchmark judged no goal"}]
        entry.update(figures=res, goals=goals)
    run.report["benchmarks"].append(entry)
    run.save()


def summarize(report: dict[str, Any], elapsed: float) -> dict[str, Any]:
    tests = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "total": 0}
    for t in report["tests"]:
        for k in tests:
            tests[k] += t.get("counts", {}).get(k, 0)
    goals = {"met": 0, "missed": 0, "bounded": 0, "not measured": 0}
    for b in report["benchmarks"]:
        for g in b.get("goals", []):
            goals[g["state"]] = goals.get(g["state"], 0) + 1
    timed_out = [s["name"] for s in report["tests"] + report["benchmarks"]
                 if s.get("timed_out")]
    return {"elapsed_s": round(elapsed, 1), "tests": tests, "goals": goals,
            "timed_out": timed_out,
            "tests_ok": tests["failed"] == 0 and tests["errors"] == 0 and tests["total"] > 0}


def run_all(args: argparse.Namespace) -> int:
    run = Run(args)
    run.save()
    try:
        step_facts(run)
        step_tests(run, "gpu-marker", "the tests marked gpu, all of tests/ (need a device)",
                   ["-m", "gpu", *args.marker_tests])
        step_tests(run, "gpu-tier", "the GPU-tier test files' other tests (on the "
                   "stand-in runtime, device or not)", ["-m", "not gpu and not slow",
                                                        *args.tier_tests])
        tiny = args.standin or args.tiny
        step_bench(run, "kv_gpu", ["--json"] + (["--sizes-mib", "0.25", "--reps", "1"]
                                                if tiny else []),
                   KV_GPU_STANDIN_WHY if args.standin else "")
        gt = ["--json"]
        if args.standin:
            gt += ["--standin"]
        if tiny:
            gt += ["--sizes-kib", "64", "256", "--blocks", "8", "--reps", "2"]
        step_bench(run, "gpu_tier", gt)
    finally:
        run.save()
        run.logf.close()
    s = run.report["summary"]
    print(render_md(run.report))
    print(f"report: {run.out / 'gpu-report.md'} (and .json, gpu-run.log)")
    return 0 if s["tests_ok"] and not s["timed_out"] else 1


# -- the human-readable report -------------------------------------------------------------
def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def _table(rows: list[dict[str, Any]]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |" for r in rows]
    return lines


def _md_facts(f: dict[str, Any]) -> list[str]:
    smi = f.get("nvidia_smi", {})
    lines = ["## Device and software", ""]
    if smi.get("gpus"):
        lines += _table(smi["gpus"])
        lines += ["", f"- driver {smi.get('driver_version')}, CUDA {smi.get('cuda_version')}"]
    else:
        lines.append(f"- nvidia-smi: {smi.get('error', 'no GPU listed')}")
    t = f.get("torch", {})
    torch_line = (t.get("error") or f"{t.get('version')}, CUDA build {t.get('cuda_build')}, "
                  f"CUDA available: {t.get('cuda_available')}"
                  + (f", {t.get('device')} (sm {t.get('capability')})" if t.get("device")
                     else ""))
    cp = f.get("cuda_python", {})
    pk = f.get("packages", {})
    tier = f.get("gpu_tier", {})
    lines += [f"- python {f.get('python')} ({f.get('executable')})",
              f"- torch {torch_line}",
              f"- cuda-python {pk.get('cuda-python')}, cuda-bindings {pk.get('cuda-bindings')}:"
              f" imports {cp.get('module') or 'nothing: ' + '; '.join(cp.get('errors', []))}",
              f"- cuda-python for this driver: `{f.get('cuda_python_for_driver')}`",
              f"- GPU tier ({tier.get('runtime')}): "
              + ("available" if tier.get("available")
                 else f"unavailable: {tier.get('unavailable_reason')}")]
    lines.append(f"- the C extension (storage_engine._stream): "
                 f"{'loaded' if f.get('c_extension') else 'not loaded: numpy copies'}")
    if f.get("error"):
        lines.append(f"- {f['error']}")
    return lines + [""]


def _md_tests(tests: list[dict[str, Any]]) -> list[str]:
    lines = ["## Tests", ""]
    for t in tests:
        c = t.get("counts", {})
        lines.append(f"### {t['name']}: {c.get('passed', 0)} passed, {c.get('failed', 0)} "
                     f"failed, {c.get('errors', 0)} errors, {c.get('skipped', 0)} skipped "
                     f"({t['seconds']} s{', TIMED OUT' if t.get('timed_out') else ''})")
        lines += ["", f"{t['what']}: `{' '.join(t['command'])}`", ""]
        for fail in t.get("failures", []):
            msg = fail["message"].strip().splitlines()
            lines.append(f"- FAILED {fail['test']}: {msg[0] if msg else ''}")
        for s in t.get("skips", []):
            lines.append(f"- skipped ({s['count']}): {s['reason']}")
        lines.append("")
    return lines


def _mark(g: dict[str, Any]) -> str:
    state = g["state"]
    if state == "not measured":
        return f"{g['goal']}: not measured: {g['detail']}"
    mark = {"met": "ok", "missed": "MISS", "bounded": "MISS, bounded"}.get(state, state)
    return f"{g['goal']}" + (f" ({g['detail']})" if g.get("detail") else "") + f": {mark}"


def _md_bench(benches: list[dict[str, Any]]) -> list[str]:
    lines = ["## Benchmarks", ""]
    for b in benches:
        lines += [f"### {b['name']} ({b['seconds']} s"
                  f"{', TIMED OUT' if b.get('timed_out') else ''}): `{' '.join(b['command'])}`",
                  ""]
        fig = b.get("figures") or {}
        scalars = {k: v for k, v in fig.items() if not isinstance(v, (list, dict))}
        for k, v in scalars.items():
            lines.append(f"- {k}: {_cell(v)}")
        for k, v in fig.items():
            if isinstance(v, list) and v and all(isinstance(r, dict) for r in v):
                lines += ["", *_table(v), ""]
            elif isinstance(v, dict):
                lines.append(f"- {k}: " + ", ".join(f"{a}={_cell(x)}" for a, x in v.items()))
        lines += ["", "Goals:", ""] + [f"- {_mark(g)}" for g in b.get("goals", [])] + [""]
    return lines


def render_md(report: dict[str, Any]) -> str:
    s = report.get("summary", {})
    t = s.get("tests", {})
    g = s.get("goals", {})
    p = report.get("prepare") or {}
    lines = [f"# GPU tier report ({report['mode']})", "",
             f"- host {report['host']}, started {report['started']}, "
             f"{s.get('elapsed_s')} s of {report['timeout_s']} s allowed"
             + (f"; TIMED OUT: {', '.join(s['timed_out'])}" if s.get("timed_out") else ""),
             f"- tests: {t.get('passed', 0)} passed, {t.get('failed', 0)} failed, "
             f"{t.get('errors', 0)} errors, {t.get('skipped', 0)} skipped",
             f"- goals: {g.get('met', 0)} met, {g.get('missed', 0)} missed, "
             f"{g.get('bounded', 0)} bounded, {g.get('not measured', 0)} not measured",
             "- venv: " + (f"{p.get('venv')} ({p.get('mode')}"
                           f"{', offline' if p.get('offline') else ''}, prepared in "
                           f"{p.get('seconds')} s, {p.get('cuda_python_spec')}, project "
                           f"{p.get('project', 'editable')})" if p
                           else f"{sys.prefix} (not made by `prepare`)"), ""]
    lines += _md_facts(report.get("facts", {}))
    lines += _md_tests(report.get("tests", []))
    lines += _md_bench(report.get("benchmarks", []))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="make the venv (.venv-gpu)")
    pp.add_argument("--venv", default=str(VENV))
    pp.add_argument("--wheels", default=str(WHEELS),
                    help="a wheelhouse: when it holds wheels, pip installs --no-index")
    pp.add_argument("--base", help="the python whose CUDA torch a layered venv uses "
                    "($GPU_BASE_PYTHON, else python3)")
    pp.add_argument("--layered", action="store_true",
                    help="layer over the base even if its torch has no CUDA")
    pp.add_argument("--python", help="the python of a fresh venv (default: this one)")
    pp.add_argument("--cuda-python", help="the requirement (default: from the driver)")
    pw = sub.add_parser("wheels", help="download the wheels an offline GPU host needs")
    pw.add_argument("--dest", default=str(WHEELS))
    pw.add_argument("--python-version", default="3.12",
                    help="the GPU host's python (3.12 in the GPU image)")
    pw.add_argument("extra", nargs="*", help="more requirements")
    pr = sub.add_parser("run", help="tests and benchmarks, then the report")
    pr.add_argument("--standin", action="store_true", default=bool(
        os.environ.get("GPU_STANDIN")), help="the stand-in CUDA runtime, tiny sizes")
    pr.add_argument("--tiny", action="store_true", help="tiny benchmark sizes")
    pr.add_argument("--out", help="report folder (default: $OUT, else ./gpu-report)")
    pr.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                    help="seconds for the whole run")
    pr.add_argument("--test-timeout", type=float, default=240.0)
    pr.add_argument("--bench-timeout", type=float, default=180.0)
    pr.add_argument("--marker-tests", nargs="+", default=["tests"])
    pr.add_argument("--tier-tests", nargs="+", default=TIER_FILES)
    args = ap.parse_args(argv)
    return {"prepare": prepare, "wheels": wheels, "run": run_all}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
