"""What an exec's result means for its caller: a command that timed out,
printed past its bound, ran out of memory or whose status is unknown is a
typed error carrying the result (ExecResult), never a plain result."""

from __future__ import annotations

from ..errors import ExecStatusUnknown, ExecTimeout, OutOfMemory, OutputTruncated
from ..spec import ExecRequest, ExecResult


def checked(r: ExecResult, req: ExecRequest, memory_mb: int) -> ExecResult:
    what = " ".join(req.cmd)[:200]
    if r.status_unknown:
        raise ExecStatusUnknown(f"{what!r}: its exit status is unknown (the guest agent "
                                "could not reap it; a process of it may be left)", r)
    if r.timed_out:
        raise ExecTimeout(f"{what!r} ran past its {req.timeout:g}s timeout; its "
                          "processes were killed", r)
    if r.truncated:
        raise OutputTruncated(f"{what!r} printed more than {req.max_output_bytes} bytes "
                              "on a stream; it was killed", r)
    if r.oom_killed:
        raise OutOfMemory(f"{what!r} was killed: the sandbox hit its memory limit of "
                          f"{memory_mb} MB", r)
    return r
