"""Goal verdicts, reported alike by every benchmark: a goal is met, missed, bounded, or
not measured (its figure or its peer did not run: the line says why, and the goal counts
as failed, never as met and never left out). *Bounded* is a miss where the physical
bound measured in the same run (memcpy of the same bytes, say) is itself short of the
goal: the line gives both figures, and the goal still counts as failed.

Scripts and tests import it as ``from benchmarks import _verdict`` (the scripts run as
``python -m benchmarks.NAME``); so does the runner of them all (``python -m
benchmarks``), which reads their verdicts back with :func:`from_json`. Standard library
and rich only, so that any of the venvs here can import it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

MET = "met"
MISSED = "missed"
BOUNDED = "bounded"
NOT_MEASURED = "not measured"
STATES = (MET, MISSED, BOUNDED, NOT_MEASURED)


@dataclass(frozen=True)
class Verdict:
    """One goal's verdict. ``goal`` says what is asked ("put+get >= 10 x redis, 2 MiB");
    ``detail`` the figures it was judged on, or, when not measured, why not."""

    goal: str
    state: str
    detail: str = ""

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ValueError(f"a verdict's state is one of {STATES}, not {self.state!r}")
        if self.state == NOT_MEASURED and not self.detail:
            raise ValueError(f"goal {self.goal!r} is not measured: say why")
        if self.state == BOUNDED and not self.detail:
            raise ValueError(f"goal {self.goal!r} is bounded: give the figure and the bound")

    @property
    def met(self) -> bool:
        return self.state == MET

    def mark(self) -> str:
        """The verdict alone, in rich markup."""
        from rich.markup import escape

        if self.state == MET:
            return "[green]ok[/]"
        if self.state == MISSED:
            return "[red]MISS[/]"
        if self.state == BOUNDED:
            return "[yellow]MISS, bounded[/]"
        return f"[yellow]not measured: {escape(self.detail)}[/]"

    def line(self) -> str:
        """The goal, its figures and the verdict, in rich markup."""
        from rich.markup import escape

        if self.state == NOT_MEASURED:
            return f"{escape(self.goal)}: {self.mark()}"
        figures = f" ({escape(self.detail)})" if self.detail else ""
        return f"{escape(self.goal)}{figures}: {self.mark()}"

    def to_json(self) -> dict[str, Any]:
        return {"goal": self.goal, "state": self.state, "met": self.met,
                "detail": self.detail}


def judge(goal: str, met: bool, detail: str = "") -> Verdict:
    """A goal whose figure was measured: met or missed."""
    return Verdict(goal, MET if met else MISSED, detail)


def not_measured(goal: str, reason: str) -> Verdict:
    """A goal whose figure (or peer) did not run: fails, with the reason."""
    return Verdict(goal, NOT_MEASURED, reason or "no reason given")


def at_most(goal: str, value: float | None, limit: float, detail: str = "",
            reason: str = "") -> Verdict:
    """``value <= limit``; ``value`` None: not measured (``reason``)."""
    if value is None:
        return not_measured(goal, reason)
    return judge(goal, value <= limit, detail)


def at_least(goal: str, value: float | None, limit: float, detail: str = "",
             reason: str = "") -> Verdict:
    """``value >= limit``; ``value`` None: not measured (``reason``)."""
    if value is None:
        return not_measured(goal, reason)
    return judge(goal, value >= limit, detail)


def faster_than_peer(goal: str, ours: float, peer: float | None, factor: float,
                     reason: str) -> Verdict:
    """Our rate ``ours`` >= ``factor`` x the peer's rate ``peer`` (higher is better);
    a peer that did not run (``peer`` None) is not measured, ``reason`` says why."""
    if peer is None:
        return not_measured(goal, reason)
    x = ours / peer
    return judge(goal, x >= factor, f"{x:.2f} x")


def within_bound(goal: str, value: float, limit: float, bound: float, detail: str
                 ) -> Verdict:
    """``value >= limit`` (higher is better), where ``bound`` is the most the physics
    measured in the same run allows: met; else bounded when ``bound < limit`` (the goal
    asks more than the bound allows), missed otherwise. ``detail`` gives both figures."""
    if value >= limit:
        return Verdict(goal, MET, detail)
    return Verdict(goal, BOUNDED if bound < limit else MISSED, detail)


def all_met(verdicts: Iterable[Verdict]) -> bool:
    """Every goal met: a missed or unmeasured one fails the run."""
    return all(v.met for v in verdicts)


def exit_code(verdicts: Iterable[Verdict]) -> int:
    """A script's exit status: 0 when every goal is met, 1 otherwise."""
    return 0 if all_met(verdicts) else 1


def to_json(verdicts: Iterable[Verdict]) -> list[dict[str, Any]]:
    return [v.to_json() for v in verdicts]


def from_json(items: Iterable[dict[str, Any]]) -> list[Verdict]:
    return [Verdict(d["goal"], d["state"], d.get("detail", "")) for d in items]


def print_verdicts(console: Any, verdicts: Iterable[Verdict], prefix: str = "goal ") -> None:
    """One line a goal, ``prefix`` before it, then a count of those not met."""
    vs = list(verdicts)
    for v in vs:
        console.print(f"{prefix}{v.line()}")
    bad = [v for v in vs if not v.met]
    if bad:
        missed = sum(v.state == MISSED for v in bad)
        bounded = sum(v.state == BOUNDED for v in bad)
        also = f"{bounded} bounded, " if bounded else ""
        console.print(f"[red]{len(bad)} of {len(vs)} goals not met[/] ({missed} missed, "
                      f"{also}{len(bad) - missed - bounded} not measured)")
    elif vs:
        console.print(f"[green]all {len(vs)} goals met[/]")
