"""Multi-turn agent workloads: a seeded generator and a JSONL trace replay.

A session is an agent loop: the first prompt is the shared system prompt plus a user
message; every later prompt is the previous prompt, the model's previous output and the
tool output that came back (lognormal length), so each turn's prompt extends the last.
Sessions start as a Poisson process at ``rate`` per second; within a session the gap
from one request's arrival to the next is lognormal with median ``gap_median`` (the
paper's traces: 8.2, 20.1 and 60.3 s). Arrivals are open-loop (fixed by the workload,
not by how fast the cluster answers), so every routing policy sees the same requests.

Session contents are drawn from one random stream and start times from another, so a
load sweep (the same seed at several rates) replays the same sessions, only closer
together.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tensordb.errors import InvalidInput

from ._policy import Request

__all__ = ["GAP_MEDIANS", "WorkloadConfig", "generate", "read_trace", "write_trace"]

#: the median inter-request gaps (seconds) of the paper's three coding-agent traces
GAP_MEDIANS = (8.2, 20.1, 60.3)


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """The shape of a generated workload. Token lengths are lognormal with the given
    median and ``sigma`` (of the underlying normal); turns per session are uniform in
    ``[min_turns, max_turns]``."""

    sessions: int = 2000
    rate: float = 1.0                 # sessions started per second
    gap_median: float = 8.2           # seconds between a session's requests
    gap_sigma: float = 1.0
    min_turns: int = 10
    max_turns: int = 60
    system_prompt_tokens: int = 4096  # the same first tokens in every session
    user_median: int = 600
    user_sigma: float = 0.8
    tool_median: int = 400            # appended to the prompt each turn
    tool_sigma: float = 1.0
    output_median: int = 150
    output_sigma: float = 0.8
    seed: int = 0

    @classmethod
    def small(cls, **kw: object) -> WorkloadConfig:
        """The same shape shrunk for engines that prefill on a CPU: 3-6 turns, a
        256-token system prompt and token lengths a sixteenth of the defaults (``kw``
        overrides any field)."""
        base: dict[str, object] = {"sessions": 12, "gap_median": 0.5, "min_turns": 3,
                                   "max_turns": 6, "system_prompt_tokens": 256,
                                   "user_median": 128, "tool_median": 64,
                                   "output_median": 16}
        base.update(kw)
        return cls(**base)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        if self.sessions < 0 or self.rate <= 0 or self.gap_median <= 0:
            raise InvalidInput(f"sessions must be >= 0, rate and gap_median > 0; got "
                               f"{self.sessions}, {self.rate}, {self.gap_median}")
        if not 1 <= self.min_turns <= self.max_turns:
            raise InvalidInput(f"turns: need 1 <= min_turns <= max_turns, got "
                               f"{self.min_turns}, {self.max_turns}")


def _lognormal(rng: np.random.Generator, median: float, sigma: float, n: int) -> np.ndarray:
    return median * np.exp(sigma * rng.standard_normal(n))


def generate(cfg: WorkloadConfig) -> list[Request]:
    """The workload's requests sorted by arrival (ties: session id). Deterministic for
    ``cfg``; sessions are numbered 0..sessions-1 in start order."""
    content = np.random.default_rng([cfg.seed, 0])
    starts = np.cumsum(np.random.default_rng([cfg.seed, 1]).exponential(
        1.0 / cfg.rate, cfg.sessions))
    out: list[Request] = []
    sys_tokens = cfg.system_prompt_tokens
    for sid in range(cfg.sessions):
        turns = int(content.integers(cfg.min_turns, cfg.max_turns + 1))
        user = max(1, round(float(_lognormal(content, cfg.user_median, cfg.user_sigma, 1)[0])))
        tools = np.maximum(1, np.rint(_lognormal(content, cfg.tool_median, cfg.tool_sigma,
                                                 turns))).astype(np.int64)
        outs = np.maximum(1, np.rint(_lognormal(content, cfg.output_median,
                                                cfg.output_sigma, turns))).astype(np.int64)
        gaps = _lognormal(content, cfg.gap_median, cfg.gap_sigma, turns)
        t = float(starts[sid])
        prompt = sys_tokens + user
        for k in range(turns):
            if k:
                t += float(gaps[k])
                prompt += int(outs[k - 1]) + int(tools[k])
            out.append(Request(session=sid, arrival=t, input_tokens=prompt,
                               output_tokens=int(outs[k]), turn=k,
                               shared_prefix_tokens=sys_tokens))
    out.sort(key=lambda r: (r.arrival, r.session))
    return out


def write_trace(requests: Iterable[Request], path: str | os.PathLike[str]) -> int:
    """Write ``requests`` as JSONL, one ``{"session", "arrival", "input_tokens",
    "output_tokens"}`` object a line; returns the number of lines."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps({"session": r.session, "arrival": r.arrival,
                                "input_tokens": r.input_tokens,
                                "output_tokens": r.output_tokens}) + "\n")
            n += 1
    return n


def read_trace(path: str | os.PathLike[str], shared_prefix_tokens: int = 0) -> list[Request]:
    """Replay a JSONL trace of ``(session, arrival, input_tokens, output_tokens)``.

    Each request's prompt is taken to extend the session's previous one (turns are
    numbered in arrival order); a prompt shorter than the previous starts a new context
    that shares nothing with the old. The first ``shared_prefix_tokens`` of every prompt
    are the shared system prompt. Sorted by arrival, ties by order in the file.
    """
    rows: list[tuple[float, int, tuple[object, float, int, int]]] = []
    with open(Path(path), encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                rec = (obj["session"], float(obj["arrival"]), int(obj["input_tokens"]),
                       int(obj["output_tokens"]))
                rows.append((rec[1], lineno, rec))
            except (ValueError, KeyError, TypeError) as exc:
                raise InvalidInput(f"{path}:{lineno}: not a trace record "
                                   f"({type(exc).__name__}: {exc})") from exc
    rows.sort(key=lambda r: (r[0], r[1]))
    state: dict[object, tuple[int, int, int]] = {}  # session -> (turns, context, last prompt)
    out: list[Request] = []
    for arrival, lineno, (sid, _, n_in, n_out) in rows:
        if isinstance(sid, list):
            sid = tuple(sid)
        turn, ctx, last = state.get(sid, (0, 0, 0))
        if turn and n_in < last:
            ctx += 1
        try:
            out.append(Request(session=sid, arrival=arrival, input_tokens=n_in,
                               output_tokens=n_out, turn=turn, context=ctx,
                               shared_prefix_tokens=min(shared_prefix_tokens, n_in)))
        except InvalidInput as exc:
            raise InvalidInput(f"{path}:{lineno}: {exc}") from exc
        state[sid] = (turn + 1, ctx, n_in)
    return out
