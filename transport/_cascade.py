"""Fan-out of a version to many nodes as a cascade.

Round by round, every node that holds the version tells one node that lacks it to pull
from it, all pairs in parallel; each node that has received the version serves it in
the next round. N targets take ceil(log2(N + 1)) rounds from one source instead of N
transfers out of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tensordb.catalog import NodeDirectory
from tensordb.errors import NodeUnavailable, TensorDBError

from ._flight_client import Transport

__all__ = ["CascadeReport", "cascade"]

#: pull ``segments`` into the calling process's own node (from ``source`` first)
LocalPull = Callable[[Sequence[str], str | None], None]


@dataclass(slots=True)
class CascadeReport:
    """What a fan-out did: the (source, target) pairs of each round, its failures."""

    rounds: list[list[tuple[str, str]]] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # target -> why
    seconds: float = 0.0


def cascade(directory: NodeDirectory, transport: Transport, me: str,
            segments: Sequence[str], targets: Sequence[str], local_pull: LocalPull,
            ) -> CascadeReport:
    """Make every node of ``targets`` hold all of ``segments``.

    ``me`` is pulled in-process through ``local_pull`` (this node need not run a
    server); the others through their servers' pull action. A target whose pull fails
    is reported in ``failed``; the others still get the version. Raises
    NodeUnavailable when no live node holds the segments to start from.
    """
    t0 = time.perf_counter()
    report = CascadeReport()
    held = directory.held_by(segments)
    live = directory.live()
    pending = [t for t in dict.fromkeys(targets) if any(t not in held[s] for s in segments)]
    if not pending:
        return report
    whole = [n for n in live if all(n in held[s] for s in segments)]
    # no node holds every segment: start from nodes holding some (pulls fall back to
    # any holder for the others)
    sources = whole or [n for n in live if any(n in held[s] for s in segments)]
    if not sources:
        holders = sorted({n for s in segments for n in held[s]})
        raise NodeUnavailable(f"no live node holds the version's segments (held by "
                              f"{', '.join(holders) or 'nobody'})",
                              node=holders[0] if holders else None)

    def one(pair: tuple[str, str]) -> tuple[str, str | None]:
        source, target = pair
        missing = [s for s in segments if target not in held[s]]
        try:
            if target == me:
                local_pull(missing, source)
            elif target not in live:
                return target, f"node {target!r} is down or not serving"
            else:
                transport.request_pull(target, live[target].address or "", missing, source)
        except TensorDBError as exc:
            return target, str(exc)
        return target, None

    with ThreadPoolExecutor(max(1, min(len(pending), 32)),
                            thread_name_prefix="tensordb-cascade") as pool:
        while pending:
            pairs = list(zip(sources, pending))
            report.rounds.append(pairs)
            pending = pending[len(pairs):]
            for target, error in pool.map(one, pairs):
                if error is None:
                    sources.append(target)
                else:
                    report.failed[target] = error
    report.seconds = time.perf_counter() - t0
    return report
