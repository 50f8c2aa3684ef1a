"""Steady-state timings through pyperf: a loop of repeated small operations (each value
one call, timed by the caller or by :func:`time_calls`) becomes a ``pyperf.Benchmark``,
whose statistics (median, p90, standard deviation, median absolute deviation) the
scripts print and judge, and which ``--pyperf-json`` writes out as a pyperf suite:
``python -m pyperf compare_to before.json after.json`` compares two runs, ``python -m
pyperf stats`` / ``hist`` show one, and ``python -m pyperf check`` says where the
values spread too widely to trust.

For steady-state loops only (catalog.py's): first calls in fresh processes and the
paired ratios (kv.py's rounds, query_bench.py's alternating paths) keep loops of their
own. The verdicts stay ``_verdict``'s, judged on these statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyperf


def benchmark(name: str, values_s: list[float], warmups_s: Iterable[float] = ()
              ) -> pyperf.Benchmark:
    """A pyperf benchmark of one process's values (seconds, one call each; the warm-up
    calls kept apart, as pyperf does), with the system metadata pyperf records."""
    import pyperf  # the bench extra's: imported where a script times with it

    run = pyperf.Run(list(values_s), warmups=[(1, w) for w in warmups_s],
                     metadata={"name": name, "unit": "second", "loops": 1})
    return pyperf.Benchmark([run])


def time_calls(name: str, fn: Callable[[], object], values: int, warmups: int = 1
               ) -> pyperf.Benchmark:
    """``fn()`` called ``warmups`` times untimed then ``values`` times, each timed with
    pyperf's clock."""
    import pyperf

    def one() -> float:
        t0 = pyperf.perf_counter()
        fn()
        return pyperf.perf_counter() - t0

    warm = [one() for _ in range(warmups)]
    return benchmark(name, [one() for _ in range(values)], warm)


def summary(b: pyperf.Benchmark) -> dict[str, float]:
    """The figures the scripts print, in milliseconds (``_common.summary``'s keys, with
    pyperf's spread beside)."""
    n = b.get_nvalue()
    return {"median_ms": b.median() * 1e3, "p90_ms": b.percentile(90) * 1e3,
            "min_ms": min(b.get_values()) * 1e3, "n": n,
            "stdev_ms": b.stdev() * 1e3 if n > 1 else 0.0,
            "mad_ms": b.median_abs_dev() * 1e3}


def dump(benches: Iterable[pyperf.Benchmark], path: str) -> None:
    """Write ``benches`` as one pyperf suite (JSON, with the system metadata pyperf
    records: CPU, kernel, Python), for ``python -m pyperf compare_to``."""
    import pyperf

    pyperf.BenchmarkSuite(list(benches)).dump(path, replace=True)
