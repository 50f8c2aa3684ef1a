"""Intervals and policy schedules.

Intervals ('7 days', '2 hours 30 minutes') are read into timedeltas by ``parse_interval``,
the one interval reader of the language: OLDER THAN and DROP VERSIONS use it, and so do
EVERY schedules. Policy schedules (EVERY intervals, CRON expressions with crontab
semantics in UTC, and ON COMMIT triggers) are read into APScheduler triggers; CREATE
POLICY checks a schedule here before it is stored, and the runner schedules with the
same code."""

from __future__ import annotations

import re
from datetime import timedelta, timezone

from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

from tensordb.errors import QueryError

from ._ast import Pos

__all__ = ["MIN_INTERVAL", "TRIGGERS", "check_schedule", "parse_interval", "trigger_of"]

#: the shortest EVERY interval a policy may use
MIN_INTERVAL = timedelta(milliseconds=100)
TRIGGERS = ("every", "cron", "commit")

_UNITS = {
    **dict.fromkeys(("ms", "msec", "msecs", "millisecond", "milliseconds"), 0.001),
    **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), 1),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), 60),
    **dict.fromkeys(("h", "hr", "hrs", "hour", "hours"), 3600),
    **dict.fromkeys(("d", "day", "days"), 86400),
    **dict.fromkeys(("w", "wk", "week", "weeks"), 7 * 86400),
}
_PART = re.compile(r"\s*(\d{1,12}(?:\.\d{1,9})?)\s*([A-Za-z]+)\s*,?")
_EXPECTED = ["'<number> milliseconds'", "'<number> seconds'", "'<number> minutes'",
             "'<number> hours'", "'<number> days'", "'<number> weeks'"]
#: longer intervals are certainly a mistake (and past timedelta's range soon after)
_MAX = timedelta(days=100 * 366)


def parse_interval(text: str, pos: Pos | None = None) -> timedelta:
    """'90 seconds', '30 minutes', '2 hours', '7 days', '1 week', '1 day 12 hours' -> timedelta.

    The units are those of the policy runner's EVERY intervals (milliseconds to weeks).

    Raises QueryError (at ``pos``, the string's place in the statement) for anything
    else, for a zero interval, and for one longer than a century.
    """
    line, column = pos or (None, None)
    if not isinstance(text, str):
        raise QueryError(f"an interval must be a string such as '7 days', not "
                         f"{type(text).__name__}", line=line, column=column, expected=_EXPECTED)
    total = 0.0
    at = 0
    stripped = text.strip()
    while at < len(stripped):
        m = _PART.match(stripped, at)
        if m is None or m.end() == at:
            break
        unit = _UNITS.get(m.group(2).lower())
        if unit is None:
            raise QueryError(
                f"unknown unit {m.group(2)!r} in interval {text!r}"
                + (f" at line {line}, column {column}" if line else "")
                + "; expected milliseconds, seconds, minutes, hours, days or weeks",
                line=line, column=column, expected=_EXPECTED)
        total += float(m.group(1)) * unit
        at = m.end()
    if not stripped or at < len(stripped):
        raise QueryError(
            f"not an interval: {text!r}" + (f" at line {line}, column {column}" if line else "")
            + "; expected e.g. '90 seconds', '30 minutes', '2 hours', '7 days', '1 week'",
            line=line, column=column, expected=_EXPECTED)
    if total <= 0:
        raise QueryError(f"interval {text!r} is zero; it must be positive", line=line,
                         column=column, expected=_EXPECTED)
    if total > _MAX.total_seconds():
        raise QueryError(f"interval {text!r} is longer than a century", line=line,
                         column=column, expected=_EXPECTED)
    return timedelta(seconds=total)




_DOW = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]
_MACROS = {"@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *",
           "@weekly": "0 0 * * 0", "@daily": "0 0 * * *", "@midnight": "0 0 * * *",
           "@hourly": "0 * * * *"}


def _dow_number(token: str) -> int:
    t = token.strip().lower()
    if t in _DOW:
        return _DOW.index(t)
    if t.isdigit() and 0 <= int(t) <= 7:
        return int(t)
    raise ValueError(f"bad day of week {token!r}")


def _crontab_weekdays(field: str) -> str:
    """A crontab day-of-week field (0 or 7: Sunday) as APScheduler weekday names."""
    if field in ("*", "?"):
        return "*"
    days: set[int] = set()
    for item in field.split(","):
        rng, slash, step_s = item.partition("/")
        step = int(step_s) if slash and step_s.isdigit() else (1 if not slash else 0)
        if step < 1:
            raise ValueError(f"bad step in day of week {item!r}")
        if rng == "*":
            lo, hi = 0, 6
        else:
            a, dash, b = rng.partition("-")
            lo = _dow_number(a)
            hi = _dow_number(b) if dash else (7 if slash else lo)
            if hi < lo:
                raise ValueError(f"bad range in day of week {item!r}")
        days.update(d % 7 for d in range(lo, hi + 1, step))
    return ",".join(_DOW[d] for d in sorted(days))


def trigger_of(trigger: str, schedule: str) -> BaseTrigger | None:
    """The APScheduler trigger of a policy (None for 'commit'), or QueryError."""
    if trigger == "every":
        delta = parse_interval(schedule)
        if delta < MIN_INTERVAL:
            raise QueryError(f"the interval {schedule!r} is shorter than the shortest a policy "
                             f"may use, 100 milliseconds", line=1, column=1)
        return IntervalTrigger(seconds=delta.total_seconds(), timezone=timezone.utc)
    if trigger == "cron":
        expr = _MACROS.get(schedule.strip().lower(), schedule) if isinstance(schedule, str) else ""
        fields = expr.split()
        if len(fields) != 5:
            raise QueryError(f"the crontab expression {schedule!r} has {len(fields)} fields; "
                             f"expected 5 (minute hour day month weekday)", line=1, column=1,
                             expected=["minute hour day month weekday"])
        try:
            fields[4] = _crontab_weekdays(fields[4])
            return CronTrigger(minute=fields[0], hour=fields[1], day=fields[2],
                               month=fields[3], day_of_week=fields[4], timezone=timezone.utc)
        except ValueError as exc:
            raise QueryError(f"bad crontab expression {schedule!r}: {exc}", line=1,
                             column=1) from None
    if trigger == "commit":
        if not isinstance(schedule, str) or not schedule.strip():
            raise QueryError("ON COMMIT TO needs a collection name", line=1, column=1,
                             expected=["a collection name"])
        return None
    raise QueryError(f"unknown policy trigger {trigger!r}; expected one of {TRIGGERS}",
                     line=1, column=1, expected=list(TRIGGERS))


def check_schedule(trigger: str, schedule: str) -> None:
    """Raise QueryError unless ``schedule`` is valid for ``trigger`` ('every', 'cron',
    'commit'). CREATE POLICY calls it so a bad schedule never reaches the catalog."""
    trigger_of(trigger, schedule)
