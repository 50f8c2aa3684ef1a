"""The benchmarks' shared goal verdict (benchmarks/_verdict.py): three states, a goal
whose figure or peer did not run fails with its reason, and kv.py judges every peer at
every size (a missing peer is listed, not dropped)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from benchmarks import _verdict
from benchmarks._verdict import MET, MISSED, NOT_MEASURED, Verdict

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_three_states_and_their_lines() -> None:
    met = _verdict.at_most("x <= 1 ms", 0.5, 1.0, "0.5 ms")
    missed = _verdict.at_least("y >= 10 x", 3.0, 10.0, "3.0 x")
    absent = _verdict.at_least("z >= 10 x", None, 10.0, reason="peer not installed")
    assert [met.state, missed.state, absent.state] == [MET, MISSED, NOT_MEASURED]
    assert [met.met, missed.met, absent.met] == [True, False, False]
    assert met.line() == "x <= 1 ms (0.5 ms): [green]ok[/]"
    assert missed.line() == "y >= 10 x (3.0 x): [red]MISS[/]"
    assert absent.line() == "z >= 10 x: [yellow]not measured: peer not installed[/]"
    assert _verdict.exit_code([met]) == 0
    assert _verdict.exit_code([met, absent]) == 1
    assert _verdict.exit_code([met, missed]) == 1


def test_json_round_trip_and_bad_verdicts() -> None:
    vs = [_verdict.judge("a", True, "1"), _verdict.not_measured("b", "no server")]
    js = _verdict.to_json(vs)
    assert js[1] == {"goal": "b", "state": NOT_MEASURED, "met": False, "detail": "no server"}
    assert _verdict.from_json(js) == vs
    with pytest.raises(ValueError, match="state"):
        Verdict("c", "fine")
    with pytest.raises(ValueError, match="say why"):
        Verdict("c", NOT_MEASURED)
    # a reason with rich markup in it is printed as text, not interpreted
    assert "\\[red]" in _verdict.not_measured("d", "[red] boom").line()


def test_missing_peer_fails_and_counts() -> None:
    assert _verdict.faster_than_peer("put+get >= 10 x redis", 5.0, None, 10.0,
                                     "redis: no server").state == NOT_MEASURED
    assert _verdict.faster_than_peer("g", 5.0, 0.4, 10.0, "").state == MET
    assert _verdict.faster_than_peer("g", 5.0, 1.0, 10.0, "").state == MISSED

    class Console:
        lines: list[str] = []

        def print(self, s: str) -> None:
            self.lines.append(s)

    c = Console()
    _verdict.print_verdicts(c, [_verdict.judge("a", True),
                                _verdict.not_measured("b", "absent"),
                                _verdict.judge("c", False)])
    assert c.lines[-1].startswith("[red]2 of 3 goals not met[/] (1 missed, 1 not measured)")


def test_kv_judges_each_peer_at_each_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.delitem(sys.modules, "kv", raising=False)
    kv = importlib.import_module("kv")
    res = {"match": {"tensordb_median_s": 0.0005},
           "skipped": {"lmcache": "not installed"},
           "sizes": [{"block_mib": 0.5, "tensordb": {"put_get": 10.0},
                      "mooncake": {"put_get": 0.5}, "redis": {"put_get": 2.0}},
                     # mooncake failed at the second size: that size is not measured
                     {"block_mib": 2, "tensordb": {"put_get": 12.0},
                      "redis": {"put_get": 1.0}}]}
    got = {v.goal: v.state for v in kv.goals(res)}
    assert got == {
        "match over 1,000 keys <= 1 ms": MET,
        "put+get >= 1 x lmcache, 0.5 MiB blocks": NOT_MEASURED,
        "put+get >= 1 x lmcache, 2 MiB blocks": NOT_MEASURED,
        "put+get >= 10 x mooncake, 0.5 MiB blocks": MET,
        "put+get >= 10 x mooncake, 2 MiB blocks": NOT_MEASURED,
        "put+get >= 10 x redis, 0.5 MiB blocks": MISSED,
        "put+get >= 10 x redis, 2 MiB blocks": MET,
    }
    assert _verdict.exit_code(kv.goals(res)) == 1


def test_checkpoint_judges_first_and_steady_saves(monkeypatch: pytest.MonkeyPatch) -> None:
    """checkpoint.py judges each save goal on the first saves and on the best ones."""
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.delitem(sys.modules, "checkpoint", raising=False)
    ckpt = importlib.import_module("checkpoint")

    def fig(first: float, best: float) -> dict[str, float]:
        return {"first_s": first, "best_s": best, "median_s": best}

    res = {"values_ok": True, "figures": {
        "tdb_host": fig(0.5, 0.2), "fs_shm": fig(0.9, 0.15),
        "tdb_disk": fig(2.0, 0.8), "fs_disk": fig(1.9, 1.5),
        "gather_commit": fig(0.9, 0.5),
        "slice_dim0": fig(0.2, 0.11), "bound_slice": fig(0.1, 0.1)}}  # 1.1 x: met
    got = {v.goal: v.state for v in ckpt.goals(res)}
    shm = "DCP save, host tier >= 1 x FileSystemWriter into /dev/shm"
    disk = "DCP save, disk tier (fsync) >= 1 x FileSystemWriter with fsync"
    gather = "DCP save, host tier >= 2 x gather to rank 0 + commit"
    first, steady = ", first save, fresh store", ", steady, best of repeats"
    assert got == {
        shm + first: MET, shm + steady: MISSED,          # 0.9 / 0.5; 0.15 / 0.2
        disk + first: MISSED, disk + steady: MET,        # 1.9 / 2.0; 1.5 / 0.8
        gather + first: MISSED, gather + steady: MET,    # 0.9 / 0.5 < 2; 0.5 / 0.2
        "contiguous slice read <= 1.2 x memcpy of the slice": MET,
    }
    # a peer that did not run, and values read back wrong, fail the run
    del res["figures"]["fs_shm"]
    res["values_ok"] = False
    vs = ckpt.goals(res)
    assert vs[0].state == NOT_MEASURED and "fs_shm" in vs[0].detail
    assert vs[-1].goal == "every value read back is the one saved" and vs[-1].state == MISSED
    assert _verdict.exit_code(vs) == 1
