"""How the project's processes log: plain lines, or structured JSON lines
when asked (`--log-json` on the command line, or LAZYFS_LOG=json in the
environment, which the daemons and agents a command starts inherit).

One JSON object per line: ts (seconds since the epoch), time (UTC,
ISO 8601), level, logger, msg (the formatted message), pid, and exc (the
traceback) when there is one. Only processes configure handlers: the CLI,
`python -m lazyfs` and `python -m runtime.agent` call setup(); libraries
only log.
"""

from __future__ import annotations

import datetime
import json
import logging
import os

ENV = "LAZYFS_LOG"
PLAIN_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "ts": round(record.created, 6),
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC)
            .isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "msg": record.getMessage(),
            "pid": record.process}
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def wants_json() -> bool:
    return os.environ.get(ENV, "").strip().lower() == "json"


def setup(level: int, *, json_lines: bool = False) -> None:
    """A handler (stderr) on the root logger at `level`, JSON lines when
    `json_lines` or $LAZYFS_LOG=json, as logging.basicConfig does: nothing
    when the root logger has handlers already (a host program's own). With
    `json_lines`, LAZYFS_LOG=json is set for the processes this one starts."""
    if json_lines:
        os.environ[ENV] = "json"
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLines() if json_lines or wants_json()
                         else logging.Formatter(PLAIN_FORMAT))
    root.addHandler(handler)
    root.setLevel(level)
