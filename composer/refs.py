"""Image references: how a name given by a user (`app`, `app:1`,
`registry.local:5000/team/app:2`, `blake3:<hex>`) names an image in a
catalog.

A reference is either a digest (the image record's own BLAKE3, used as is)
or a tag; a tag without a `:TAG` after its last `/` means `:latest`. The
local catalog (`composer.catalog`) and the cluster's (`composer.remote`)
both read names through here.

Not here: the digest spelling itself (`chunkstore.digests`), and registry
references (`registry://HOST/REPO[:TAG|@sha256:...]`, `composer.registry`).
"""

from __future__ import annotations

from dataclasses import dataclass

from chunkstore.digests import Digest, is_digest

__all__ = ["ImageRef", "is_digest", "normalize_tag"]

DEFAULT_TAG = "latest"


def normalize_tag(name: str) -> str:
    """`name` with `:latest` added when it names no tag (the part after its
    last `/` has no `:`). A digest is not a tag: use `ImageRef.parse`."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:{DEFAULT_TAG}"


@dataclass(frozen=True, slots=True)
class ImageRef:
    """A parsed reference: exactly one of `digest` and `tag` is set."""

    digest: Digest | None = None
    tag: str | None = None

    @classmethod
    def parse(cls, name: str) -> ImageRef:
        """A digest stays one (BadDigest if malformed); anything else is a
        tag, normalized."""
        if is_digest(name):
            return cls(digest=Digest.parse(name))
        return cls(tag=normalize_tag(name))

    def __str__(self) -> str:
        return str(self.digest if self.digest is not None else self.tag)
