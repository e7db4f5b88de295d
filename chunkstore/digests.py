"""BLAKE3 content digests as strings: forming one from bytes, parsing and
checking one from outside, and turning one into a name usable as an object
key, a file name or a directory name.

Layer manifests, image records and cluster packs are all named by the BLAKE3
of their bytes, printed `blake3:<64 hex>`. A colon is awkward in object keys
and file names, so those use `blake3-<64 hex>` (`Digest.key`), which
`Digest.from_key` turns back. Every package forms, parses and encodes digests
through this module, so the spelling lives in one place.

Not here: chunk ids (xxh3-128, `chunkstore.ids`), OCI `sha256:` digests (the
registry's, `composer.registry`), image names and tags (`composer.refs`).
"""

from __future__ import annotations

import re

import blake3

from .errors import BadDigest

ALGORITHM = "blake3"
PREFIX = ALGORITHM + ":"
_KEY_PREFIX = ALGORITHM + "-"
_HEX64 = re.compile(r"[0-9a-f]{64}")


class Digest(str):
    """`blake3:<64 lowercase hex>`: the BLAKE3-256 of some bytes.

    Constructing one validates it (`Digest(text)` is `Digest.parse(text)`);
    a Digest compares and hashes as its text, so it can stand wherever a
    digest string did."""

    __slots__ = ()

    def __new__(cls, text: str) -> Digest:
        if not (isinstance(text, str) and text.startswith(PREFIX)
                and _HEX64.fullmatch(text, len(PREFIX))):
            raise BadDigest(text)
        return super().__new__(cls, text)

    @classmethod
    def of(cls, data: bytes | memoryview) -> Digest:
        """The digest of `data`."""
        return str.__new__(cls, PREFIX + blake3.blake3(data).hexdigest())

    @classmethod
    def parse(cls, text: str) -> Digest:
        """A digest from text that came from outside; BadDigest if malformed."""
        return cls(text)

    @classmethod
    def from_key(cls, key: str) -> Digest:
        """The digest a `key()` spelling names; BadDigest if it names none."""
        if not key.startswith(_KEY_PREFIX):
            raise BadDigest(key)
        return cls(PREFIX + key[len(_KEY_PREFIX):])

    @classmethod
    def from_hex(cls, hexdigest: str) -> Digest:
        return cls(PREFIX + hexdigest)

    @property
    def hex(self) -> str:
        """The 64 hex characters, without the algorithm."""
        return self[len(PREFIX):]

    def key(self) -> str:
        """`blake3-<hex>`: safe as an object key, a file or a directory name."""
        return _KEY_PREFIX + self.hex

    def matches(self, data: bytes | memoryview) -> bool:
        """Whether `data` hashes to this digest."""
        return blake3.blake3(data).hexdigest() == self.hex


def is_digest(text: str) -> bool:
    """Whether `text` is spelled as a digest (the algorithm prefix); it may
    still be malformed, which `Digest.parse` reports."""
    return text.startswith(PREFIX)


def digest_key(text: str) -> str:
    """`Digest.parse(text).key()`: the object key / file name of a digest."""
    return Digest.parse(text).key()
