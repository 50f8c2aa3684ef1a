"""A host store's metrics, read at scrape time from what every process of the host
shares: the KV namespaces' counters (in their index files), the tiers' bytes, the
latency histograms the client processes keep (``storage_engine.read_latencies``), the
scrubber's report, and from the catalog the policy runs and each collection's head
version and the bytes of it this node does not hold yet (replication lag).

``HostCollector`` is a ``prometheus_client`` collector: the node server registers it
beside its own transfer metrics (``tensordb serve --metrics-port``), and ``tensordb
metrics --home DIR`` serves it for an embedded store, so no client process needs an
exporter of its own. Every family is read afresh per scrape; a part that cannot be read
(a catalog down, a namespace removed under it) is logged and left out of that scrape,
never an error of the scrape. The metric names are listed in ``METRICS`` (the Grafana
dashboard's test checks each panel's query against it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from sqlalchemy import func, select

import storage_engine as se
from tensordb.catalog.schema import kv_namespaces, policy_runs
from tensordb.errors import CorruptData

if TYPE_CHECKING:
    from ._database import Database

__all__ = ["METRICS", "HostCollector"]

_log = logging.getLogger("tensordb.metrics")

_KV_COUNTERS = ("hits", "misses", "evictions", "spills", "corrupt")
#: every family HostCollector emits (counters without their ``_total``), by name
METRICS = {
    **{f"tensordb_kv_{c}": "counter" for c in _KV_COUNTERS},
    **dict.fromkeys(("tensordb_scrub_rounds", "tensordb_scrub_found",
                     "tensordb_policy_runs"), "counter"),
    **{f"tensordb_{op}_seconds": "histogram" for op in se.OPS},
    **dict.fromkeys((
        "tensordb_kv_bytes", "tensordb_kv_blocks", "tensordb_kv_capacity_bytes",
        "tensordb_kv_arena_bytes", "tensordb_kv_occupancy_ratio", "tensordb_store_bytes",
        "tensordb_latency_files_skipped", "tensordb_head_version",
        "tensordb_replication_lag_bytes", "tensordb_scrub_round_bytes",
        "tensordb_scrub_round_segments", "tensordb_scrub_last_round_end_seconds",
        "tensordb_policy_last_run_seconds"), "gauge"),
}


class HostCollector(Collector):
    """The host's view of one store (see the module docstring)."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def collect(self) -> Iterator[Metric]:
        node = self._db.config.node
        parts: tuple[Callable[[str], list[Metric]], ...] = (
            self._kv, self._store, self._latency, self._catalog)
        for part in parts:
            try:
                yield from part(node)
            except Exception as exc:  # noqa: BLE001 - a scrape never fails on one part
                _log.warning("metrics: %s unreadable: %s", part.__name__.strip("_"), exc)

    # -- the parts ----------------------------------------------------------------------
    def _kv(self, node: str) -> list[Metric]:
        db = self._db
        with db.catalog.engine.connect() as conn:
            names = [r[0] for r in conn.execute(
                select(kv_namespaces.c.name).where(kv_namespaces.c.node == node)
                .order_by(kv_namespaces.c.name))]
        counters = {c: CounterMetricFamily(f"tensordb_kv_{c}", f"KV block {c}, per namespace "
                                           f"(shared by the host's processes)",
                                           labels=["node", "namespace"])
                    for c in _KV_COUNTERS}
        nbytes = GaugeMetricFamily("tensordb_kv_bytes", "Bytes of KV blocks held, per medium",
                                   labels=["node", "namespace", "medium"])
        blocks = GaugeMetricFamily("tensordb_kv_blocks", "KV blocks held, per medium",
                                   labels=["node", "namespace", "medium"])
        cap = GaugeMetricFamily("tensordb_kv_capacity_bytes", "The host arena's capacity",
                                labels=["node", "namespace"])
        arena = GaugeMetricFamily("tensordb_kv_arena_bytes",
                                  "Bytes of shared memory the arena's slabs take",
                                  labels=["node", "namespace"])
        occ = GaugeMetricFamily("tensordb_kv_occupancy_ratio",
                                "Host blocks' bytes over the arena's capacity",
                                labels=["node", "namespace"])
        for name in names:
            try:
                got = db.kv_counters(name)
            except CorruptData as exc:  # the others are still exported
                _log.warning("metrics: %s", exc)
                continue
            if got is None:  # registered, never opened on this boot
                continue
            c, capacity = got
            for k in _KV_COUNTERS:
                counters[k].add_metric([node, name], c[k])
            for medium in ("host", "disk"):
                nbytes.add_metric([node, name, medium], c[f"{medium}_bytes"])
                blocks.add_metric([node, name, medium], c[f"{medium}_blocks"])
            cap.add_metric([node, name], capacity)
            arena.add_metric([node, name], c["arena_bytes"])
            occ.add_metric([node, name], c["host_bytes"] / capacity if capacity else 0.0)
        return [*counters.values(), nbytes, blocks, cap, arena, occ]

    def _store(self, node: str) -> list[Metric]:
        """The tiers' bytes and the scrubber's report: one ``stats()`` for both."""
        st = self._db.stats()
        out = GaugeMetricFamily("tensordb_store_bytes",
                                "Bytes of the collections' segments per tier (pool: "
                                "freed files kept for reuse)", labels=["node", "tier"])
        for tier in ("host", "disk"):
            out.add_metric([node, tier], st[f"{tier}_bytes"])
            out.add_metric([node, f"{tier}_pool"], st[f"{tier}_pool_bytes"])
        return [out, *self._scrub(node, st)]

    def _latency(self, node: str) -> list[Metric]:
        sums = se.read_latencies(Path(self._db.config.shm_dir) / "metrics")
        out: list[Metric] = []
        for op in se.OPS:
            h = HistogramMetricFamily(f"tensordb_{op}_seconds",
                                      f"Latency of one {op}, in the host's client processes",
                                      labels=["node"])
            cum, buckets = 0.0, []
            for bound, n in zip((*se.BUCKETS, float("inf")), sums.buckets[op], strict=True):
                cum += n
                buckets.append((_le(bound), cum))
            h.add_metric([node], buckets, sums.sums[op])
            out.append(h)
        skipped = GaugeMetricFamily("tensordb_latency_files_skipped",
                                    "Latency files that failed their checks at this scrape",
                                    labels=["node"])
        skipped.add_metric([node], sums.skipped)
        return [*out, skipped]

    def _catalog(self, node: str) -> list[Metric]:
        db = self._db
        head = GaugeMetricFamily("tensordb_head_version", "Each collection's newest version",
                                 labels=["collection"])
        lag = GaugeMetricFamily("tensordb_replication_lag_bytes",
                                "Bytes of the head version's segments this node holds no "
                                "copy of", labels=["node", "collection"])
        for name in db.collections():
            version, total, held = db.holdings(name)
            head.add_metric([name], version)
            lag.add_metric([node, name], total - held.get(node, 0))
        runs = CounterMetricFamily("tensordb_policy_runs", "Policy runs, per outcome",
                                   labels=["policy", "outcome"])
        last = GaugeMetricFamily("tensordb_policy_last_run_seconds",
                                 "When each policy last started, in Unix seconds",
                                 labels=["policy"])
        t = policy_runs.c
        with db.catalog.engine.connect() as conn:
            for policy, outcome, n in conn.execute(
                    select(t.policy, t.outcome, func.count()).group_by(t.policy, t.outcome)
                    .order_by(t.policy, t.outcome)):
                runs.add_metric([policy, outcome], n)
            for policy, started in conn.execute(
                    select(t.policy, func.max(t.started_at)).group_by(t.policy)
                    .order_by(t.policy)):
                last.add_metric([policy], _unix(started))
        return [head, lag, runs, last]

    def _scrub(self, node: str, st: dict[str, int]) -> list[Metric]:
        fams: list[tuple[Any, str, str, str]] = [
            (CounterMetricFamily, "tensordb_scrub_rounds", "scrub_rounds",
             "Scrub rounds completed on this host"),
            (CounterMetricFamily, "tensordb_scrub_found", "scrub_found",
             "Damaged extents the scrubber found"),
            (GaugeMetricFamily, "tensordb_scrub_round_bytes", "scrub_bytes",
             "Bytes scrubbed in the current round"),
            (GaugeMetricFamily, "tensordb_scrub_round_segments", "scrub_segments",
             "Segments scrubbed in the current round"),
            (GaugeMetricFamily, "tensordb_scrub_last_round_end_seconds",
             "scrub_last_round_end", "When the last scrub round ended, in Unix seconds"),
        ]
        out = []
        for cls, name, key, doc in fams:
            m = cls(name, doc, labels=["node"])
            m.add_metric([node], st[key])
            out.append(m)
        return out


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


def _unix(when: Any) -> float:
    return float(when.timestamp()) if when is not None else 0.0
