"""The benchmarks as a package: every script imports as ``benchmarks.NAME`` (what
``python -m benchmarks.NAME`` runs) and has a ``main``; and the runner of them all
(``python -m benchmarks``, ``make bench``) reads their verdicts wherever they sit in
their JSON, lists what this host cannot run without failing for it, and fails the run
on any other goal not met. Nothing here runs a benchmark."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from benchmarks import __main__ as runner
from benchmarks import _verdict
from benchmarks._verdict import BOUNDED, MET, MISSED, NOT_MEASURED

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_every_script_imports_as_a_module_with_a_main() -> None:
    names = runner.scripts()
    assert {"kv", "catalog", "query_bench", "transfer", "weights"} <= set(names)
    assert "query" not in names and "transport" not in names  # they shadowed packages
    for name in names:
        mod = importlib.import_module(f"benchmarks.{name}")
        assert callable(getattr(mod, "main", None)), name


def test_every_script_is_planned_or_listed() -> None:
    """make bench runs each script, or lists it as not measured, saying why."""
    planned = {b.module for b in runner.PLAN}
    extra = runner.unplanned(runner.PLAN, [*runner.scripts(), "new_one"])
    assert [o.bench for o in extra] == [n for n in [*runner.scripts(), "new_one"]
                                        if n not in planned]
    assert extra[-1].verdicts[0].state == NOT_MEASURED
    assert extra[-1].host_lacks  # listed, not failing


def _bench(**kw: object) -> runner.Bench:
    return runner.Bench("demo", "demo", **kw)  # type: ignore[arg-type]


def test_verdicts_are_found_wherever_a_script_keeps_them() -> None:
    vs = [_verdict.judge("a", True, "1 ms"), _verdict.not_measured("b", "no peer")]
    js = _verdict.to_json(vs)
    shapes = [{"goals": js},                                  # a list (most scripts)
              {"goals": {"x": js[0], "y": js[1]}},            # a dict by key (weight_sync)
              {"sizes": [{"goals": [js[0]]}, {"goals": [js[1]]}]},  # per size (weights)
              {"goals": {"note": "not verdicts"}, "verdicts": js}]  # routing's simulator
    for shape in shapes:
        assert runner.extract_verdicts(shape) == vs, shape
    # something printed before the JSON object does not hide it
    out = "starting\n" + json.dumps({"goals": js}, indent=2) + "\n"
    assert runner.extract_verdicts(runner.parse_json(out)) == vs
    with pytest.raises(ValueError):
        runner.parse_json("no json here")


def test_outcomes_and_exit_status() -> None:
    js = json.dumps({"goals": _verdict.to_json([
        _verdict.judge("fast", True, "1 ms"),
        _verdict.within_bound("bounded one", 8.0, 10.0, 9.0, "8 x; allows 9 x")])})
    ok = runner.outcome_of(_bench(), 1, js, "", 1.0)
    assert [v.state for v in ok.verdicts] == [MET, BOUNDED] and not ok.error
    table = runner.rows([ok])
    assert [(r["goal"], r["state"], r["fails"]) for r in table] == [
        ("fast", MET, False), ("bounded one", BOUNDED, True)]
    assert runner.exit_code(table) == 1  # a bounded goal is still a miss
    assert runner.exit_code(table[:1]) == 0

    # a crash, or JSON without verdicts, is a failed run, listed as not measured
    crashed = runner.outcome_of(_bench(), 2, "", "Traceback\nImportError: boom", 1.0)
    assert crashed.error == "exit 2: ImportError: boom"
    empty = runner.outcome_of(_bench(), 0, json.dumps({"figures": 1}), "", 1.0)
    assert empty.error == "its JSON holds no verdicts"
    for o in (crashed, empty):
        (row,) = runner.rows([o])
        assert row["state"] == NOT_MEASURED and row["fails"]

    # what the host lacks is listed and does not fail; a missing peer does
    mixed = json.dumps({"goals": _verdict.to_json([
        _verdict.not_measured("vLLM lookup <= 1 ms", "vLLM is not installed"),
        _verdict.not_measured("put+get >= 1 x lmcache", "not installed"),
        _verdict.judge("match <= 0.2 ms", False, "0.3 ms")])})
    lacks = _bench(host_lacks=lambda v: "no engine venv" if v.goal.startswith("vLLM") else None)
    o = runner.outcome_of(lacks, 1, mixed, "", 1.0)
    table = runner.rows([o])
    assert [(r["state"], r["host_lacks"], r["fails"]) for r in table] == [
        (NOT_MEASURED, True, False), (NOT_MEASURED, False, True), (MISSED, False, True)]
    c = runner.counts(table)
    assert (c[MISSED], c[NOT_MEASURED], c["host_lacks"], c["failing"]) == (1, 2, 1, 2)


def test_a_run_this_host_cannot_do_is_one_listed_line() -> None:
    o = runner.run_one(_bench(why_not=lambda: "needs a CUDA device"))
    (row,) = runner.rows([o])
    assert row == {"bench": "demo", "goal": "every goal", "state": NOT_MEASURED,
                   "figure": "needs a CUDA device", "host_lacks": True, "fails": False}
    assert runner.exit_code([row]) == 0


def test_summary_prints_every_goal_and_the_counts() -> None:
    from rich.console import Console

    vs = [_verdict.judge("g1", True, "1 ms"), _verdict.judge("g2", False, "[red] 9 ms")]
    table = runner.rows([runner.Outcome("demo", vs)])
    con = Console(record=True, width=200)
    runner.print_summary(con, table, 12.0)
    text = con.export_text()
    assert "g1" in text and "g2" in text and "[red] 9 ms" in text  # markup shown as text
    assert "1 met, 1 missed, 0 bounded, 0 not measured" in text
    assert "1 goals fail the run" in text


def test_a_run_from_an_engine_venv_keeps_the_goals_on_that_engine() -> None:
    """The vLLM-venv run of kv_events is for the goal on vLLM's publisher; its other
    goals are the main run's, and the main run lists the vLLM goal as measured there."""
    (venv_run,) = [b for b in runner.PLAN if b.name == "kv_events (vLLM venv)"]
    goals = [_verdict.judge("delivery >= 1 x vLLM's ZmqEventPublisher", True, "1.5 x"),
             _verdict.judge("lag p90 <= 20 ms", False, "30 ms")]
    out = runner.outcome_of(venv_run, 1, json.dumps({"goals": _verdict.to_json(goals)}),
                            "", 1.0)
    assert [v.goal for v in out.verdicts] == ["delivery >= 1 x vLLM's ZmqEventPublisher"]
    assert runner.exit_code(runner.rows([out])) == 0
