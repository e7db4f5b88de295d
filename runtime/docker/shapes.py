"""Docker's wire shapes that are not JSON documents: times, the
multiplexed stream's frames, filters, durations as `docker ps` words."""

from __future__ import annotations

import datetime
import json
import struct
from typing import Any

from .http import HttpError

STDIN, STDOUT, STDERR = 0, 1, 2
_FRAME = struct.Struct(">BxxxL")
NEVER = "0001-01-01T00:00:00Z"


def iso(t: float | None) -> str:
    """RFC 3339 with nanoseconds, as dockerd writes times (0/None: never)."""
    if not t:
        return NEVER
    d = datetime.datetime.fromtimestamp(t, datetime.UTC)
    return d.strftime("%Y-%m-%dT%H:%M:%S.") + f"{d.microsecond:06d}000Z"


def frame(stream: int, data: bytes) -> bytes:
    """One frame of the multiplexed stream: 8 bytes of header, then data."""
    return _FRAME.pack(stream, len(data)) + data


def filters(raw: str | None) -> dict[str, list[str]]:
    """?filters= as {name: [values]} (the map form {"k": {"v": true}} too)."""
    if not raw:
        return {}
    try:
        doc = json.loads(raw)
    except ValueError:
        raise HttpError(400, f"invalid filter: {raw!r} is not JSON") from None
    if not isinstance(doc, dict):
        raise HttpError(400, "invalid filter: expected a JSON object")
    out: dict[str, list[str]] = {}
    for k, v in doc.items():
        if isinstance(v, dict):
            out[str(k)] = [str(x) for x, on in v.items() if on]
        elif isinstance(v, list):
            out[str(k)] = [str(x) for x in v]
        else:
            out[str(k)] = [str(v)]
    return out


def check_filters(f: dict[str, list[str]], known: tuple[str, ...]) -> None:
    for k in f:
        if k not in known:
            raise HttpError(400, f"invalid filter '{k}'")


def labels_match(labels: dict[str, str], wanted: list[str]) -> bool:
    for w in wanted:
        k, sep, v = w.partition("=")
        if k not in labels or (sep and labels[k] != v):
            return False
    return True


def ago(seconds: float) -> str:
    """`docker ps`'s human duration ("3 seconds", "About a minute", "2 hours")."""
    s = int(seconds)
    if s < 1:
        return "Less than a second"
    if s < 60:
        return f"{s} second{'s' if s != 1 else ''}"
    m = s // 60
    if m == 1:
        return "About a minute"
    if m < 60:
        return f"{m} minutes"
    h = m // 60
    if h == 1:
        return "About an hour"
    if h < 48:
        return f"{h} hours"
    return f"{h // 24} days"


def since_time(value: str | None) -> float | None:
    """?since= / ?until=: a Unix time (seconds, maybe fractional) or RFC 3339."""
    if value is None or value == "":
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        return datetime.datetime.fromisoformat(value).timestamp()
    except ValueError:
        raise HttpError(400, f"invalid time {value!r}: a Unix time or RFC 3339") from None


def as_list(v: Any, what: str) -> list[str] | None:
    """A Cmd / Entrypoint / Env field: a list of strings, a string (one
    argument list of it: Docker's string form), or null."""
    if v is None:
        return None
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return list(v)
    raise HttpError(400, f"{what}: expected a list of strings")
