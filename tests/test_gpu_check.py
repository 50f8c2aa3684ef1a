"""tools/gpu_check.py (`make gpu`): its stand-in flow end to end at a tiny size writes
the report a GPU host's run writes, every section present; the driver picks the
cuda-python major; a junit file is counted as pytest counts it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gpu_check = _tool()
STATES = {"met", "missed", "bounded", "not measured"}


FAKE_TESTS = """
import pytest

@pytest.mark.gpu
def test_needs_a_device():
    pytest.skip("no CUDA device")

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "the planted failure"

def test_optional():
    pytest.skip("optional feature")
"""


def test_the_standin_flow_writes_every_section(tmp_path: Path) -> None:
    """The whole flow of ``make gpu`` on the stand-in, the benchmarks at tiny sizes; the
    two test runs over a planted file (one marked test, a pass, a failure, a skip) so
    that counting is checked and the test stays fast."""
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "conftest.py").write_text(
        "def pytest_configure(config):\n"
        "    config.addinivalue_line('markers', 'gpu: needs a device')\n")
    (planted / "test_planted.py").write_text(FAKE_TESTS)
    out = tmp_path / "report"
    cmd = [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "run", "--standin",
           "--out", str(out), "--timeout", "240", "--marker-tests", str(planted),
           "--tier-tests", str(planted)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    # a failed test fails the run, and the report names it
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu-report.json", "gpu-report.md",
                                                     "gpu-run.log"]
    rep = json.loads((out / "gpu-report.json").read_text())
    assert rep["mode"] == "standin"
    assert {"facts", "tests", "benchmarks", "summary", "prepare"} <= set(rep)
    facts = rep["facts"]
    assert {"nvidia_smi", "python", "packages", "torch", "cuda_python", "gpu_tier",
            "cuda_python_for_driver"} <= set(facts)
    assert facts["gpu_tier"]["available"] is True  # on the stand-in
    assert "stand-in" in facts["gpu_tier"]["runtime"]
    tests = {t["name"]: t for t in rep["tests"]}
    assert set(tests) == {"gpu-marker", "gpu-tier"}
    assert tests["gpu-marker"]["counts"] == {"passed": 0, "failed": 0, "errors": 0,
                                            "skipped": 1, "total": 1}
    assert tests["gpu-marker"]["skips"] == [{"reason": "no CUDA device", "count": 1}]
    assert tests["gpu-tier"]["counts"] == {"passed": 1, "failed": 1, "errors": 0,
                                          "skipped": 1, "total": 3}
    (fail,) = tests["gpu-tier"]["failures"]
    assert fail["test"].endswith("::test_fails") and "the planted failure" in fail["message"]
    benches = {b["name"]: b for b in rep["benchmarks"]}
    assert set(benches) == {"kv_gpu", "gpu_tier"}
    for b in benches.values():
        assert b["goals"] and all(g["state"] in STATES and "goal" in g for g in b["goals"])
    # kv_gpu needs torch CUDA tensors: every goal not measured, saying why
    assert all(g["state"] == "not measured" and "torch CUDA" in g["detail"]
               for g in benches["kv_gpu"]["goals"])
    # gpu_tier runs on the stand-in: its figures measured, its goals not judged
    rows = benches["gpu_tier"]["figures"]["sizes"]
    assert [r["block_kib"] for r in rows] == [64, 256]
    assert all(r["d2d_GBps"] > 0 and r["tier_get_into_GBps"] > 0 for r in rows)
    assert len(benches["gpu_tier"]["goals"]) == 2 * len(rows)
    assert all("stand-in" in g["detail"] for g in benches["gpu_tier"]["goals"])
    s = rep["summary"]
    assert s["tests"] == {"passed": 1, "failed": 1, "errors": 0, "skipped": 2, "total": 4}
    assert s["tests_ok"] is False and s["timed_out"] == []
    assert s["goals"]["not measured"] == len(benches["kv_gpu"]["goals"]) + 2 * len(rows)
    md = (out / "gpu-report.md").read_text()
    for heading in ("# GPU tier report (standin)", "## Device and software", "## Tests",
                    "### gpu-marker", "### gpu-tier", "## Benchmarks", "### kv_gpu",
                    "### gpu_tier"):
        assert heading in md
    assert "not measured:" in md and "FAILED" in md and "test_fails" in md


@pytest.mark.parametrize(("smi", "spec"), [
    ({"cuda_version": "12.8", "driver_version": "570.1"}, "cuda-python>=12.6,<13"),
    ({"cuda_version": "13.0", "driver_version": "580.159.03"}, "cuda-python>=13,<14"),
    ({"driver_version": "550.54.15"}, "cuda-python>=12.6,<13"),
    ({"driver_version": "580.65"}, "cuda-python>=13,<14"),
    ({"error": "nvidia-smi is not on the PATH"}, "cuda-python>=12.6"),
])
def test_the_driver_picks_the_cuda_python_major(smi: dict[str, str], spec: str) -> None:
    assert gpu_check.cuda_python_spec(gpu_check.cuda_major(smi)) == spec


def test_the_cuda_version_is_read_off_nvidia_smi() -> None:
    head = "| NVIDIA-SMI 580.159.03   Driver Version: 580.159.03   CUDA Version: 13.0     |"
    assert gpu_check.cuda_version_of(head) == "13.0"
    assert gpu_check.cuda_version_of("no header") is None


def test_junit_counts_failures_and_skip_reasons(tmp_path: Path) -> None:
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.a" name="ok"/>'
        '<testcase classname="tests.a" name="bad"><failure message="assert 1 == 2">'
        'trace</failure></testcase>'
        '<testcase classname="tests.a" name="boom"><error message="fixture">e</error>'
        '</testcase>'
        '<testcase classname="tests.b" name="s1"><skipped message="no CUDA device"/>'
        '</testcase>'
        '<testcase classname="tests.b" name="s2"><skipped message="no CUDA device"/>'
        '</testcase>'
        '</testsuite></testsuites>')
    got = gpu_check.parse_junit(xml)
    assert got["counts"] == {"passed": 1, "failed": 1, "errors": 1, "skipped": 2,
                             "total": 5}
    assert [f["test"] for f in got["failures"]] == ["tests.a::bad", "tests.a::boom"]
    assert "assert 1 == 2" in got["failures"][0]["message"]
    assert got["skips"] == [{"reason": "no CUDA device", "count": 2}]
