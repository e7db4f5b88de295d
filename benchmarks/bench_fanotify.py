"""The data path lazyfs did not take, measured: fanotify pre-content events
(FAN_PRE_ACCESS, Linux 6.14+) over a sparse file, the alternative to the
native blob server (lazyfs/native/blobd.c) that docs/lazyfs.md weighs.

    python -m benchmarks.bench_fanotify [--mib 256] [--repeats 3] [--json PATH]

A listener (a thread of this process, through ctypes) marks a sparse file
for FAN_PRE_ACCESS; each event names the byte range a read is about to
touch, the listener fills it from the source (a plain file here: what a
fetch + decompress would write) through the event's descriptor (which
raises no event itself) and allows the read. Measured, same run, page
cache dropped before each cold read, medians of --repeats:

    cold read     the whole file read once in 1 MiB reads: the source on
                  ext4, and the sparse file through the listener (filled
                  on demand); bytes compared with the source
    warm read     the same again with everything in the page cache: while
                  the mark stands, every read still raises an event, which
                  the listener allows at once (its page map says filled): a
                  hit pays a round trip to the listener, counted
    dead listener a new sparse file, the listener filling the first
                  --mib / 4 MiB, then SIGKILLed (it runs in a child process
                  for this): the rest is read, and the bytes that came back
                  as zeros with no error are counted (a fail-closed data
                  path must give 0; lazyfs's server gives EIO,
                  tests/test_native_blobs.py)

Needs root and a kernel with FAN_PRE_ACCESS; a filesystem that supports
pre-content marks for the work directory (ext4 here).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import select
import signal
import statistics
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.report import log, machine_info, table, write_json

ROOT = Path(__file__).resolve().parent.parent

FAN_CLOEXEC = 0x1
FAN_CLASS_PRE_CONTENT = 0x8
FAN_MARK_ADD = 0x1
FAN_PRE_ACCESS = 0x00100000
FAN_ALLOW = 0x1
FAN_EVENT_INFO_TYPE_RANGE = 6
AT_FDCWD = -100
META = struct.Struct("=IBBHQii")  # event_len, vers, reserved, metadata_len, mask, fd, pid
RANGE = struct.Struct("=BBHIQQ")  # info_type, pad, len, pad, offset, count
RESPONSE = struct.Struct("=iI")
READ = 1 << 20

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int,
                                ctypes.c_char_p]


def _group(path: Path) -> int:
    fd = int(_libc.fanotify_init(FAN_CLASS_PRE_CONTENT | FAN_CLOEXEC, os.O_RDWR | os.O_LARGEFILE))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"fanotify_init(FAN_CLASS_PRE_CONTENT): {os.strerror(e)}")
    if _libc.fanotify_mark(fd, FAN_MARK_ADD, FAN_PRE_ACCESS, AT_FDCWD, str(path).encode()) < 0:
        e = ctypes.get_errno()
        os.close(fd)
        raise OSError(e, f"fanotify_mark(FAN_PRE_ACCESS, {path}): {os.strerror(e)}")
    return fd


PAGE = 4096


def listen(group: int, source: int, stop: threading.Event, counts: dict[str, int]) -> None:
    """Fill each event's range from `source` where it is not filled yet
    (a page map: an event over filled pages is a hit, allowed at once),
    then allow the read. Ends when `stop` is set (polled every 0.1 s)."""
    size = os.fstat(source).st_size
    filled = bytearray((size + PAGE - 1) // PAGE)
    poller = select.poll()
    poller.register(group, select.POLLIN)
    while not stop.is_set():
        if not poller.poll(100):
            continue
        try:
            buf = os.read(group, 64 * 1024)
        except OSError:
            return
        at = 0
        while at + META.size <= len(buf):
            event_len, _v, _r, meta_len, mask, fd, _pid = META.unpack_from(buf, at)
            if event_len < META.size:
                return  # (not an event: the group is gone)
            offset, count = 0, -1
            info = at + meta_len
            while info + 4 <= at + event_len:
                kind, _p, length = struct.unpack_from("=BBH", buf, info)
                if kind == FAN_EVENT_INFO_TYPE_RANGE and length >= RANGE.size:
                    _k, _p2, _l, _p3, offset, count = RANGE.unpack_from(buf, info)
                if length == 0:
                    break
                info += length
            if fd >= 0:
                if mask & FAN_PRE_ACCESS and count:
                    end = size if count < 0 else min(size, offset + count)
                    counts["events"] = counts.get("events", 0) + 1
                    first, last = offset // PAGE, (end + PAGE - 1) // PAGE
                    page = first
                    while page < last:  # each run of pages not filled yet
                        if filled[page]:
                            page += 1
                            continue
                        run = page
                        while run < last and not filled[run]:
                            run += 1
                        pos, stop_at = page * PAGE, min(size, run * PAGE)
                        while pos < stop_at:
                            data = os.pread(source, min(READ, stop_at - pos), pos)
                            if not data:
                                break
                            os.pwrite(fd, data, pos)
                            pos += len(data)
                        counts["filled"] = counts.get("filled", 0) + (pos - page * PAGE)
                        filled[page:run] = b"\1" * (run - page)
                        page = run
                os.write(group, RESPONSE.pack(fd, FAN_ALLOW))
                os.close(fd)
            at += event_len


def _drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _read_all(path: Path, want: bytes | None = None) -> tuple[float, int, int]:
    """Seconds, bytes read, bytes differing from `want` (its same offsets)."""
    t = time.perf_counter()
    n = bad = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            chunk = f.read(READ)
            if not chunk:
                break
            if want is not None and chunk != want[n:n + len(chunk)]:
                bad += sum(a != b for a, b in zip(chunk, want[n:n + len(chunk)], strict=True))
            n += len(chunk)
    return time.perf_counter() - t, n, bad


def _zeros_for_data(got: bytes, want: bytes) -> int:
    """How many bytes of `got` are zero where `want` is not."""
    if got == want:
        return 0
    if got.count(0) == len(got):  # (a hole read whole: the usual case)
        return len(want) - want.count(0)
    return sum(1 for a, b in zip(got, want, strict=True) if a == 0 and b != 0)


def _sparse(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=Path("/var/tmp"))
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/fanotify.json")
    args = p.parse_args()
    size = args.mib << 20
    out: dict[str, Any] = {"args": {"mib": args.mib, "repeats": args.repeats}}
    with tempfile.TemporaryDirectory(prefix="bench-fanotify-", dir=args.workdir) as tmp:
        d = Path(tmp)
        out["machine"] = machine_info(d)
        src = d / "source"
        # compressible-looking but not constant: what a layer's blob holds
        block = os.urandom(READ // 2) * 2
        with open(src, "wb") as f:
            f.writelines(block for _ in range(args.mib))
        want = src.read_bytes()
        source_fd = os.open(src, os.O_RDONLY)
        runs: dict[str, list[float]] = {"ext4 cold": [], "fanotify cold": [], "ext4 warm": [],
                                        "fanotify warm": []}
        warm_events: list[int] = []
        wrong = 0
        for r in range(args.repeats):
            target = d / f"sparse-{r}"
            _sparse(target, size)
            group = _group(target)
            counts: dict[str, int] = {}
            stop = threading.Event()
            th = threading.Thread(target=listen, args=(group, source_fd, stop, counts),
                                  daemon=True)
            th.start()
            _drop_caches()
            runs["ext4 cold"].append(_read_all(src)[0])
            _drop_caches()
            secs, n, bad = _read_all(target, want)
            runs["fanotify cold"].append(secs)
            wrong += bad + (size - n)
            runs["ext4 warm"].append(_read_all(src)[0])
            before = counts.get("events", 0)
            runs["fanotify warm"].append(_read_all(target)[0])
            warm_events.append(counts.get("events", 0) - before)
            stop.set()
            th.join(10)
            if th.is_alive():
                raise SystemExit("bench_fanotify: the listener did not stop")
            os.close(group)
            target.unlink()
        log(f"cold/warm medians: { {k: round(statistics.median(v) * 1e3) for k, v in runs.items()} }")

        # the dead listener: fill a quarter, SIGKILL, read the rest
        target = d / "sparse-dead"
        _sparse(target, size)
        r_end, w_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the listener, in a process of its own
            try:
                os.close(r_end)
                g = _group(target)
                os.write(w_end, b"1")
                listen(g, source_fd, threading.Event(), {})
            finally:
                os._exit(0)
        os.close(w_end)
        ready = os.read(r_end, 1)
        os.close(r_end)
        if ready != b"1":  # (no listener: what follows would measure nothing)
            os.waitpid(pid, 0)
            raise SystemExit("bench_fanotify: the listener process could not mark the file")
        quarter = size // 4
        with open(target, "rb", buffering=0) as f:
            first = f.read(quarter)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        _drop_caches()
        zeros = errors = served = 0
        with open(target, "rb", buffering=0) as f:
            f.seek(quarter)
            pos = quarter
            while pos < size:
                try:
                    chunk = f.read(READ)
                except OSError:
                    errors += 1
                    pos += READ
                    f.seek(pos)
                    continue
                if not chunk:
                    break
                served += len(chunk)
                zeros += _zeros_for_data(chunk, want[pos:pos + len(chunk)])
                pos += len(chunk)
        os.close(source_fd)
    med = {k: statistics.median(v) for k, v in runs.items()}
    out.update({
        "seconds": runs, "median_s": med,
        "cold_ratio": med["fanotify cold"] / med["ext4 cold"],
        "warm_ratio": med["fanotify warm"] / med["ext4 warm"],
        "warm_events": warm_events, "wrong_bytes_while_listening": wrong,
        "dead_listener": {"first_quarter_right": first == want[:quarter],
                          "bytes_served_after_kill": served,
                          "of_them_zeros_for_data": zeros, "read_errors": errors}})
    print(table(f"{args.mib} MiB read whole in 1 MiB reads, medians of {args.repeats}",
                ["read", "ms (median)", "/ ext4"], [
        ["cold, ext4", f"{med['ext4 cold'] * 1e3:,.0f}", "1.00"],
        ["cold, fanotify listener", f"{med['fanotify cold'] * 1e3:,.0f}",
         f"{out['cold_ratio']:.2f}"],
        ["warm, ext4", f"{med['ext4 warm'] * 1e3:,.0f}", "1.00"],
        ["warm, fanotify (mark kept)", f"{med['fanotify warm'] * 1e3:,.0f}",
         f"{out['warm_ratio']:.2f}"]]))
    print(f"  warm reads still raised {statistics.median(warm_events):.0f} events each pass; "
          f"wrong bytes while the listener ran: {wrong}")
    dl = out["dead_listener"]
    print(f"  listener SIGKILLed after {quarter >> 20} MiB: {dl['bytes_served_after_kill']:,} "
          f"bytes served after, {dl['of_them_zeros_for_data']:,} of them zeros where the data "
          f"is not, {dl['read_errors']} read errors (fail-closed would be 0 served)")
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
