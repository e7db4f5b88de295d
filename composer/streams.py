"""Small stream adapters shared by the sources: a chunk iterator read as a
file, and a reader that counts and hashes what passes through it."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable, Iterator
from typing import IO, Any


class IterStream(io.RawIOBase):
    """A file-like view of an iterator of byte chunks (an HTTP body, `docker
    save` output). Wrap in io.BufferedReader for efficient small reads."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        super().__init__()
        self._it: Iterator[bytes] = iter(chunks)
        self._buf = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._buf:
            try:
                self._buf = next(self._it)
            except StopIteration:
                return 0
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    def drain(self) -> None:
        """Consume the rest (so a checking iterator gets to its check)."""
        self._buf = b""
        for _ in self._it:
            pass


class MeteredReader(io.RawIOBase):
    """Counts what is read through it and, with hash=True, its sha256."""

    def __init__(self, inner: IO[bytes], *, hash: bool = False) -> None:
        super().__init__()
        self.inner = inner
        self.count = 0
        self._h = hashlib.sha256() if hash else None

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        data = self.inner.read(n)
        self.count += len(data)
        if self._h is not None:
            self._h.update(data)
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)

    def digest(self, *, drain: bool = True) -> str:
        """'sha256:…' of everything read (after reading the rest, by default)."""
        if self._h is None:
            raise ValueError("MeteredReader created without hash=True")
        if drain:
            while self.read(1 << 20):
                pass
        return "sha256:" + self._h.hexdigest()
