"""Image references: how a name given by a user (`app`, `app:1`,
`registry.local:5000/team/app:2`, `blake3:<hex>`) names an image in a
catalog.

A reference is either a digest (the image record's own BLAKE3, used as is)
or a tag; a tag without a `:TAG` after its last `/` means `:latest`. The
local catalog (`composer.catalog`) and the cluster's (`composer.remote`)
both read names through here, so this is the one place names are checked.

A tag follows the OCI / Docker reference grammar (as `docker tag` takes it):

    NAME[:TAG]   NAME = [HOST[:PORT]/]COMPONENT[/COMPONENT...]
    COMPONENT    lowercase letters and digits, joined by '.', '_', '__' or '-'s
    HOST         DNS labels (letters, digits, '-') joined by '.'; a first
                 part that has a '.' or a ':' or is `localhost` is a host
    TAG          [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}

A name that breaks it is refused (BadImageName) with one line saying why.

Not here: the digest spelling itself (`chunkstore.digests`), and registry
references (`registry://HOST/REPO[:TAG|@sha256:...]`, `composer.registry`,
which splits REPO[:TAG] with `split_tag`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from chunkstore.digests import Digest, is_digest

from .errors import BadImageName

__all__ = ["DEFAULT_TAG", "BadImageName", "ImageRef", "is_digest", "normalize_tag",
           "split_tag"]

DEFAULT_TAG = "latest"
_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_HOST = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)"
                   r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*(?::[0-9]+)?")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_MAX_NAME = 255  # as the distribution reference grammar bounds a name


def normalize_tag(name: str) -> str:
    """`name` checked against the reference grammar, with `:latest` added
    when it names no tag (the part after its last `/` has no `:`). A digest
    is not a tag: use `ImageRef.parse`. Raises BadImageName."""
    repo, tag = _split(name)
    _check(name, repo, tag)
    return f"{repo}:{tag or DEFAULT_TAG}"


def split_tag(name: str) -> tuple[str, str]:
    """(repository, tag) of a tag reference, the tag DEFAULT_TAG when the
    part after the last `/` has no `:` (a `:` before it is a host's port).
    Not checked against the grammar (normalize_tag checks)."""
    repo, tag = _split(name)
    return repo, DEFAULT_TAG if tag is None else tag


def _split(name: str) -> tuple[str, str | None]:
    head, slash, last = name.rpartition("/")
    if ":" in last:
        last, _, tag = last.partition(":")
        return head + slash + last, tag
    return name, None


def _check(name: str, repo: str, tag: str | None) -> None:
    def bad(why: str) -> BadImageName:
        return BadImageName(f"invalid image name {name!r}: {why}")
    if not repo:
        raise bad("empty name" if not name else "no repository before ':'")
    if len(repo) > _MAX_NAME:
        raise bad(f"the name is longer than {_MAX_NAME} characters")
    parts = repo.split("/")
    first = parts[0]
    if len(parts) > 1 and ("." in first or ":" in first or first == "localhost"):
        if not _HOST.fullmatch(first):
            raise bad(f"{first!r} is not a registry HOST[:PORT]")
        parts = parts[1:]
    for part in parts:
        if not part:
            raise bad("an empty path component")
        if not _COMPONENT.fullmatch(part):
            raise bad(f"{'' if part == repo else repr(part) + ': '}a repository name is "
                      "lowercase letters and digits, separated by '.', '_', '__' or '-' "
                      "(e.g. team/app:1)")
    if tag is not None and not _TAG.fullmatch(tag):
        raise bad(f"tag {tag!r}: up to 128 of letters, digits, '_', '.' and '-', "
                  "not starting with '.' or '-'")


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
