"""Policy schedules: EVERY intervals, CRON expressions (crontab semantics, UTC) and ON
COMMIT triggers, read into APScheduler triggers. CREATE POLICY checks a schedule here
before it is stored; the runner schedules with the same code."""

from __future__ import annotations

from datetime import timedelta, timezone

from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

from tensordb.errors import QueryError

from ._interval import parse_interval as _parse_interval

__all__ = ["MIN_INTERVAL", "TRIGGERS", "check_schedule", "parse_interval", "trigger_of"]

#: the shortest EVERY interval a policy may use
MIN_INTERVAL = timedelta(milliseconds=100)
TRIGGERS = ("every", "cron", "commit")


def parse_interval(value: str) -> timedelta:
    """``'10 minutes'``, ``'1 day 12 hours'``, ``'500 milliseconds'`` -> timedelta: the
    one interval reader of the language (``query._interval``), for EVERY schedules."""
    return _parse_interval(value)


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
