"""Intervals of OLDER THAN ('7 days', '2 hours 30 minutes'), read into timedeltas."""

from __future__ import annotations

import re
from datetime import timedelta

from tensordb.errors import QueryError

from ._ast import Pos

__all__ = ["parse_interval"]

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
