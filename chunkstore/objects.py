"""Object stores behind the cluster chunk store: an S3-compatible service
(SeaweedFS by default) or a POSIX directory every node mounts (3FS, CephFS,
Lustre, NFS).

    store = open_object_store("s3://bucket/prefix?endpoint=http://127.0.0.1:8333")
    store = open_object_store("posix:///mnt/3fs/lazyfs")

Both give the same small interface: whole-object put (atomic: readers see
the old object, no object, or the whole new one, never a part), get, ranged
get, exists, list by prefix, delete. Every call has a timeout and is retried
with exponential backoff on transient errors; what still fails raises
ObjectStoreError naming the store, the key and the cause (ObjectNotFound for
a missing key).

S3 credentials and endpoint: the URL's query (endpoint=, region=), else
LAZYFS_S3_ENDPOINT / AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY (boto3's usual chain), region default us-east-1.
"""

from __future__ import annotations

import abc
import logging
import os
import random
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from .errors import ChunkStoreError

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TIMEOUT = 10.0
DEFAULT_RETRIES = 3


class ObjectStoreError(ChunkStoreError):
    """An object store call failed (after retries)."""


class ObjectNotFound(ObjectStoreError):
    """The key does not exist."""


class ObjectStore(abc.ABC):
    url: str
    timeout: float = DEFAULT_TIMEOUT
    retries: int = DEFAULT_RETRIES

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Store the whole object atomically (replacing any old one)."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes: ...

    @abc.abstractmethod
    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length) of the object (short at its end)."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def list(self, prefix: str) -> Iterator[str]:
        """Keys starting with prefix, in lexical order."""

    @abc.abstractmethod
    def delete(self, key: str) -> None: ...

    def close(self) -> None:
        return None

    def _retry(self, what: str, key: str, fn: Callable[[], T]) -> T:
        """Run fn, retrying transient failures with exponential backoff and jitter."""
        delay = 0.1
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except ObjectNotFound:
                raise
            except Exception as e:  # classified below
                if not self._transient(e) or attempt == self.retries:
                    raise ObjectStoreError(f"{self.url}: {what} {key!r} failed: "
                                           f"{type(e).__name__}: {e}") from e
                log.warning("%s: %s %r failed (%s), retry %d/%d in %.2fs", self.url, what, key,
                            e, attempt + 1, self.retries, delay)
                time.sleep(delay * (1 + random.random() / 2))
                delay = min(delay * 4, 2.0)
        raise AssertionError("unreachable")

    def _transient(self, e: Exception) -> bool:
        return isinstance(e, OSError | TimeoutError | ConnectionError)


def open_object_store(url: str, *, timeout: float = DEFAULT_TIMEOUT,
                      retries: int = DEFAULT_RETRIES) -> ObjectStore:
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme == "s3":
        store: ObjectStore = S3ObjectStore(url, timeout=timeout)
    elif parsed.scheme in ("posix", "file"):
        store = PosixObjectStore(url, Path(parsed.path))
    else:
        raise ValueError(f"unknown cluster store URL {url!r} "
                         "(expected s3://BUCKET[/PREFIX][?endpoint=URL] or posix:///PATH)")
    store.timeout = timeout
    store.retries = retries
    return store


class PosixObjectStore(ObjectStore):
    """Objects as files under a shared directory: write to a temporary name,
    fsync, rename into place (atomic on POSIX filesystems, 3FS and CephFS
    included); ranged reads with pread."""

    def __init__(self, url: str, root: Path) -> None:
        self.url = url
        self.root = root
        if not root.is_dir():
            raise ObjectStoreError(f"{url}: {root} is not a directory (is the cluster "
                                   "filesystem mounted?)")

    def _path(self, key: str) -> Path:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"bad object key {key!r}")
        return self.root / key

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)

        def fn() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.rename(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        self._retry("put", key, fn)

    def get(self, key: str) -> bytes:
        path = self._path(key)

        def fn() -> bytes:
            try:
                return path.read_bytes()
            except FileNotFoundError:
                raise ObjectNotFound(f"{self.url}: no object {key!r}") from None
        return self._retry("get", key, fn)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        path = self._path(key)

        def fn() -> bytes:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise ObjectNotFound(f"{self.url}: no object {key!r}") from None
            try:
                parts, got = [], 0
                while got < length:
                    b = os.pread(fd, length - got, offset + got)
                    if not b:
                        break
                    parts.append(b)
                    got += len(b)
                return b"".join(parts)
            finally:
                os.close(fd)
        return self._retry("get range of", key, fn)

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def list(self, prefix: str) -> Iterator[str]:
        base = self.root
        out = []
        for dirpath, _, files in os.walk(base):
            for name in files:
                if name.startswith("."):
                    continue  # temporary files of puts in progress
                rel = os.path.relpath(os.path.join(dirpath, name), base)
                if rel.startswith(prefix):
                    out.append(rel)
        yield from sorted(out)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


class S3ObjectStore(ObjectStore):
    """An S3-compatible service through boto3 (SeaweedFS, MinIO, Ceph RGW, AWS).
    A PUT is atomic in S3: readers never see a partial object."""

    def __init__(self, url: str, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        import boto3
        import botocore.config
        import botocore.exceptions

        self._botoexc = botocore.exceptions
        parsed = urllib.parse.urlsplit(url)
        query = dict(urllib.parse.parse_qsl(parsed.query))
        self.url = urllib.parse.urlunsplit(("s3", parsed.netloc, parsed.path, "", ""))
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/") + "/" if parsed.path.strip("/") else ""
        if not self.bucket:
            raise ValueError(f"{url!r}: expected s3://BUCKET[/PREFIX]")
        endpoint = (query.get("endpoint") or os.environ.get("LAZYFS_S3_ENDPOINT")
                    or os.environ.get("AWS_ENDPOINT_URL"))
        cfg = botocore.config.Config(
            connect_timeout=timeout, read_timeout=timeout,
            retries={"max_attempts": 1, "mode": "standard"},  # retries are ours
            max_pool_connections=32, s3={"addressing_style": "path"})
        self.client: Any = boto3.session.Session().client(
            "s3", endpoint_url=endpoint, region_name=query.get("region") or
            os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
            aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID") or "lazyfs",
            aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY") or "lazyfs",
            config=cfg)

    def _transient(self, e: Exception) -> bool:
        exc = self._botoexc
        if isinstance(e, exc.ClientError):
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            return status >= 500 or code in ("SlowDown", "RequestTimeout", "InternalError")
        return isinstance(e, exc.BotoCoreError | OSError | TimeoutError)

    def _missing(self, e: Exception) -> bool:
        if isinstance(e, self._botoexc.ClientError):
            code = str(e.response.get("Error", {}).get("Code", ""))
            return code in ("NoSuchKey", "404", "NotFound")
        return False

    def ensure_bucket(self) -> None:
        def fn() -> None:
            try:
                self.client.head_bucket(Bucket=self.bucket)
            except self._botoexc.ClientError:
                self.client.create_bucket(Bucket=self.bucket)
        self._retry("create bucket", self.bucket, fn)

    def put(self, key: str, data: bytes) -> None:
        self._retry("put", key, lambda: self.client.put_object(
            Bucket=self.bucket, Key=self.prefix + key, Body=data))

    def _get(self, key: str, **kw: Any) -> bytes:
        def fn() -> bytes:
            try:
                r = self.client.get_object(Bucket=self.bucket, Key=self.prefix + key, **kw)
                body: bytes = r["Body"].read()
                return body
            except Exception as e:
                if self._missing(e):
                    raise ObjectNotFound(f"{self.url}: no object {key!r}") from None
                raise
        return self._retry("get", key, fn)

    def get(self, key: str) -> bytes:
        return self._get(key)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        return self._get(key, Range=f"bytes={offset}-{offset + length - 1}")

    def exists(self, key: str) -> bool:
        def fn() -> bool:
            try:
                self.client.head_object(Bucket=self.bucket, Key=self.prefix + key)
                return True
            except Exception as e:
                if self._missing(e):
                    return False
                raise
        return self._retry("head", key, fn)

    def list(self, prefix: str) -> Iterator[str]:
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.prefix + prefix}
            if token:
                kw["ContinuationToken"] = token
            def fn(kw: dict[str, Any] = kw) -> dict[str, Any]:
                return dict(self.client.list_objects_v2(**kw))
            page = self._retry("list", prefix, fn)
            for obj in page.get("Contents", []):
                yield str(obj["Key"])[len(self.prefix):]
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")

    def delete(self, key: str) -> None:
        self._retry("delete", key, lambda: self.client.delete_object(
            Bucket=self.bucket, Key=self.prefix + key))
