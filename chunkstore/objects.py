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
the caller's `endpoint` (lazyfs: its settings' cluster.s3_endpoint,
LAZYFS_S3_ENDPOINT), else AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY (boto3's usual chain), region default us-east-1.

Reads (get, get_range: every cold chunk a cluster node serves is one) do
not go through the boto3 client: each is one GET through libcurl (pycurl),
signed by botocore's SigV4 signer with the same credentials, region and
endpoint, or, with `filer=` in the URL, a plain GET from the SeaweedFS
filer's HTTP API (no S3 gateway hop). boto3's request machinery (events,
parameter validation, response parsing) and http.client's header parsing
cost several times the client CPU of a ranged GET on loopback
(benchmarks/bench_s3get.py). Writes, listings and deletes are rare and stay
with boto3.
"""

from __future__ import annotations

import abc
import errno
import html
import logging
import os
import random
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from .backends.local import pread_full
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
    retry_budget: float = 3 * DEFAULT_TIMEOUT  # seconds for one call, retries included

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Store the whole object atomically (replacing any old one)."""

    @abc.abstractmethod
    def put_new(self, key: str, data: bytes) -> bool:
        """Store the object only if no object `key` exists, in one atomic
        step (an exclusive create: of two callers at once, exactly one gets
        True). False when one exists with other bytes; a retried call whose
        first attempt did create it finds its own bytes and gets True, so
        `data` should be unique to the caller (a claim with a token)."""

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

    @abc.abstractmethod
    def list_ages(self, prefix: str) -> Iterator[tuple[str, float, int]]:
        """(key, seconds since last written or touched, size) for keys under prefix."""

    @abc.abstractmethod
    def touch(self, key: str) -> None:
        """Mark the object as just used (its age restarts) without changing it."""

    def close(self) -> None:
        return None

    def _retry(self, what: str, key: str, fn: Callable[[], T]) -> T:
        """Run fn, retrying transient failures with exponential backoff and
        jitter, within `retry_budget` seconds in all (a dead store fails a call
        in bounded time, not after retries of retries)."""
        delay = 0.1
        deadline = time.monotonic() + self.retry_budget
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except ObjectNotFound:
                raise
            except Exception as e:  # classified below
                last = attempt == self.retries or time.monotonic() + delay > deadline
                if not self._transient(e) or last:
                    raise ObjectStoreError(f"{self.url}: {what} {key!r} failed: "
                                           f"{type(e).__name__}: {e}") from e
                log.warning("%s: %s %r failed (%s), retry %d/%d in %.2fs", self.url, what, key,
                            e, attempt + 1, self.retries, delay)
                time.sleep(delay * (1 + random.random() / 2))
                delay = min(delay * 4, 2.0)
        raise AssertionError("unreachable")

    def _transient(self, e: Exception) -> bool:
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno in _TRANSIENT_ERRNOS
        return isinstance(e, TimeoutError | ConnectionError)


_TRANSIENT_ERRNOS = {errno.EIO, errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.ESTALE,
                     errno.ENOTCONN, errno.ECONNRESET, errno.ECONNREFUSED, errno.EHOSTUNREACH}


def open_object_store(url: str, *, timeout: float = DEFAULT_TIMEOUT,
                      retries: int = DEFAULT_RETRIES, endpoint: str | None = None
                      ) -> ObjectStore:
    """The store at `url`; `endpoint`: an S3 URL's endpoint when its query
    names none."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme == "s3":
        store: ObjectStore = S3ObjectStore(url, timeout=timeout, endpoint=endpoint)
    elif parsed.scheme in ("posix", "file"):
        if parsed.netloc:
            raise ValueError(f"{url!r}: a POSIX cluster path must be absolute: "
                             f"posix:///{parsed.netloc}{parsed.path}")
        store = PosixObjectStore(url, Path(parsed.path))
    else:
        raise ValueError(f"unknown cluster store URL {url!r} "
                         "(expected s3://BUCKET[/PREFIX][?endpoint=URL] or posix:///PATH)")
    store.timeout = timeout
    store.retries = retries
    return store


_TMP = re.compile(r"^\..+\.tmp-\d+-\d+$")


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
        self.timeout = DEFAULT_TIMEOUT  # (a hung mount blocks in the kernel: no timeout there)

    def sweep_temporary(self, older_than: float = 3600.0) -> int:
        """Remove temporary files of puts that died (a writer's job, not a reader's)."""
        now, n = time.time(), 0
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                p = Path(dirpath, name)
                if _TMP.match(name):
                    try:
                        if now - p.stat().st_mtime > older_than:
                            p.unlink()
                            n += 1
                    except OSError:
                        continue
        return n

    def _path(self, key: str) -> Path:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"bad object key {key!r}")
        return self.root / key

    @staticmethod
    def _written(path: Path, data: bytes) -> Path:
        """`data` in a temporary file next to `path`, synced (the caller
        renames or links it into place)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)

        def fn() -> None:
            tmp = self._written(path, data)
            try:
                os.rename(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        self._retry("put", key, fn)

    def put_new(self, key: str, data: bytes) -> bool:
        path = self._path(key)

        def fn() -> bool:
            tmp = self._written(path, data)
            try:
                try:
                    os.link(tmp, path)  # atomic, and refused if the name exists
                except FileExistsError:
                    try:
                        return path.read_bytes() == data
                    except FileNotFoundError:  # deleted meanwhile: not ours either
                        return False
                return True
            finally:
                tmp.unlink(missing_ok=True)
        return self._retry("exclusive put", key, fn)

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
                return pread_full(fd, length, offset)
            finally:
                os.close(fd)
        return self._retry("get range of", key, fn)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> Iterator[str]:
        base = self.root
        top = base / prefix.rpartition("/")[0] if "/" in prefix else base
        out = []
        for dirpath, _, files in os.walk(top):
            for name in files:
                if name.startswith("."):
                    continue  # temporary files of puts in progress
                rel = os.path.relpath(os.path.join(dirpath, name), base)
                if rel.startswith(prefix):
                    out.append(rel)
        yield from sorted(out)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def list_ages(self, prefix: str) -> Iterator[tuple[str, float, int]]:
        now = time.time()
        for key in self.list(prefix):
            try:
                st = self._path(key).stat()
            except FileNotFoundError:
                continue
            yield key, now - st.st_mtime, st.st_size

    def touch(self, key: str) -> None:
        path = self._path(key)
        try:
            os.utime(path)
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.url}: no object {key!r}") from None


class S3StatusError(Exception):
    """An S3 error answer to a GET: its HTTP status and error code."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"HTTP {status} {code or '(no error code)'}"
                         + (f": {message}" if message else ""))
        self.status = status
        self.code = code


_TRANSIENT_S3_CODES = ("SlowDown", "RequestTimeout", "InternalError", "Throttling",
                       "ServiceUnavailable")
_XML_FIELD = re.compile(rb"<(Code|Message)>([^<]{0,512})</(?:Code|Message)>")


class _Gets:
    """GETs of one bucket's objects through libcurl (pycurl: one handle and
    its connections per thread): signed with SigV4 from the S3 endpoint
    (the signer is botocore's: we only build the request it signs), or,
    with `credentials` None, plain GETs from a SeaweedFS filer's HTTP API
    (`base`: its buckets directory). Proxies: libcurl's usual environment
    (http_proxy, https_proxy, no_proxy)."""

    # libcurl errors that no retry mends: a bad URL or protocol, TLS refusals
    _PERMANENT = frozenset({1, 3, 4, 35, 51, 53, 54, 58, 59, 60, 64, 66, 77, 80, 83, 90, 91})

    def __init__(self, base: str, bucket: str, timeout: float, *, region: str = "",
                 credentials: Any = None) -> None:
        import botocore.auth
        import botocore.awsrequest
        import botocore.httpsession
        import pycurl

        self._curl = pycurl
        self._auth = botocore.auth.S3SigV4Auth
        self._request = botocore.awsrequest.AWSRequest
        self.base = base.rstrip("/") + "/" + urllib.parse.quote(bucket, safe="") + "/"
        self.region = region
        self.credentials = credentials
        self.timeout_ms = max(1, int(timeout * 1000))
        ca = os.environ.get("AWS_CA_BUNDLE") or botocore.httpsession.get_cert_path(True)
        self.ca = ca if isinstance(ca, str) else None
        self._local = threading.local()
        self._handles: list[Any] = []
        self._mu = threading.Lock()

    def _handle(self) -> Any:
        c = getattr(self._local, "curl", None)
        if c is None:
            pycurl = self._curl
            c = self._local.curl = pycurl.Curl()
            c.setopt(pycurl.NOSIGNAL, 1)  # (threads: no SIGALRM for DNS timeouts)
            c.setopt(pycurl.CONNECTTIMEOUT_MS, self.timeout_ms)
            c.setopt(pycurl.TIMEOUT_MS, self.timeout_ms)
            c.setopt(pycurl.FOLLOWLOCATION, 0)
            if self.ca is not None:
                c.setopt(pycurl.CAINFO, self.ca)
            with self._mu:
                self._handles.append(c)
        return c

    def close(self) -> None:
        with self._mu:
            handles, self._handles = self._handles, []
        for c in handles:
            c.close()

    def get(self, key: str, first: int | None = None, last: int | None = None) -> bytes:
        """The object (or bytes first..last of it); S3StatusError on an
        error answer, pycurl.error when the connection fails."""
        url = self.base + urllib.parse.quote(key, safe="/~")
        headers = {} if first is None else {"Range": f"bytes={first}-{last}"}
        if self.credentials is not None:
            request = self._request("GET", url, headers=headers)
            self._auth(self.credentials.get_frozen_credentials(), "s3",
                       self.region).add_auth(request)
            headers = dict(request.headers.items())
        pycurl = self._curl
        c = self._handle()
        parts: list[bytes] = []
        c.setopt(pycurl.URL, url)
        if headers:
            c.setopt(pycurl.HTTPHEADER, [f"{k}: {v}" for k, v in headers.items()])
        else:  # (an empty list would keep the previous request's)
            c.unsetopt(pycurl.HTTPHEADER)
        c.setopt(pycurl.WRITEFUNCTION, parts.append)
        try:
            c.perform()
        finally:
            c.setopt(pycurl.WRITEFUNCTION, _discard)  # (drop the reference to parts)
        status = int(c.getinfo(pycurl.RESPONSE_CODE))
        data = b"".join(parts)
        if status in (200, 206):
            if first is not None and status == 200:  # a server that ignored the range
                assert last is not None
                return data[first:last + 1]
            return data
        fields = {m.group(1).decode(): html.unescape(m.group(2).decode("utf-8", "replace"))
                  for m in _XML_FIELD.finditer(data[:4096])}
        code = fields.get("Code", "")
        if not code and status in (404, 416):  # (the filer answers without a body)
            code = "NoSuchKey" if status == 404 else "InvalidRange"
        raise S3StatusError(status, code, fields.get("Message", "")
                            or data[:200].decode("utf-8", "replace").strip())

    def transient(self, e: Exception) -> bool:
        if isinstance(e, S3StatusError):
            return e.status >= 500 or e.status == 429 or e.code in _TRANSIENT_S3_CODES
        if isinstance(e, self._curl.error):
            return not (e.args and e.args[0] in self._PERMANENT)
        return False


def _discard(data: bytes) -> None:
    return None


class S3ObjectStore(ObjectStore):
    """An S3-compatible service (SeaweedFS, MinIO, Ceph RGW, AWS): writes,
    listings and deletes through boto3, reads through _Gets (the module's
    doc). A PUT is atomic in S3: readers never see a partial object."""

    def __init__(self, url: str, *, timeout: float = DEFAULT_TIMEOUT,
                 endpoint: str | None = None) -> None:
        import boto3
        import botocore.config
        import botocore.credentials
        import botocore.exceptions

        self._botoexc = botocore.exceptions
        parsed = urllib.parse.urlsplit(url)
        query = dict(urllib.parse.parse_qsl(parsed.query))
        if parsed.username or parsed.password or "@" in parsed.netloc:
            raise ValueError("credentials do not belong in the cluster URL: use "
                             "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or an AWS profile")
        unknown = set(query) - {"endpoint", "region", "filer"}
        if unknown:
            raise ValueError(f"unknown parameter(s) {sorted(unknown)} in the cluster URL "
                             "(known: endpoint, region, filer)")
        filer = query.get("filer")
        if filer is not None and (urllib.parse.urlsplit(filer).scheme not in ("http", "https")
                                  or not urllib.parse.urlsplit(filer).netloc):
            raise ValueError(f"filer={filer!r} in the cluster URL: expected "
                             "http://HOST:PORT (a SeaweedFS filer)")
        self.url = urllib.parse.urlunsplit(("s3", parsed.netloc, parsed.path, "", ""))
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/") + "/" if parsed.path.strip("/") else ""
        if not self.bucket:
            raise ValueError(f"{url!r}: expected s3://BUCKET[/PREFIX]")
        endpoint = query.get("endpoint") or endpoint or os.environ.get("AWS_ENDPOINT_URL")
        cfg = botocore.config.Config(
            connect_timeout=timeout, read_timeout=timeout,
            retries={"total_max_attempts": 1, "mode": "standard"},  # retries are ours
            max_pool_connections=32, s3={"addressing_style": "path"})
        session = boto3.session.Session()
        kw: dict[str, Any] = {}
        if session.get_credentials() is None:
            # nothing configured (a one-machine SeaweedFS without identities):
            # sign with placeholders; everywhere else boto3's own chain applies
            # (environment incl. session tokens, profiles, instance roles)
            kw = {"aws_access_key_id": "lazyfs", "aws_secret_access_key": "lazyfs"}
        self.client: Any = session.client(
            "s3", endpoint_url=endpoint, region_name=query.get("region") or
            os.environ.get("AWS_DEFAULT_REGION") or "us-east-1", config=cfg, **kw)
        # reads: GETs of our own (see the module's doc): from the filer when
        # the URL names one, else signed from the endpoint
        if filer is not None:
            self._gets = _Gets(filer.rstrip("/") + "/buckets", self.bucket, timeout)
        else:
            credentials = (session.get_credentials() if not kw else
                           botocore.credentials.Credentials(kw["aws_access_key_id"],
                                                            kw["aws_secret_access_key"]))
            self._gets = _Gets(str(self.client.meta.endpoint_url), self.bucket, timeout,
                               region=self.client.meta.region_name, credentials=credentials)

    def close(self) -> None:
        self.client.close()
        self._gets.close()

    def _transient(self, e: Exception) -> bool:
        if self._gets.transient(e):
            return True
        exc = self._botoexc
        if isinstance(e, exc.ClientError):
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            return status >= 500 or status == 429 or code in (
                "SlowDown", "RequestTimeout", "InternalError", "Throttling")
        return isinstance(e, exc.ConnectionError | exc.HTTPClientError | TimeoutError |
                          ConnectionError)

    def _missing(self, e: Exception) -> bool:
        if isinstance(e, S3StatusError):
            return e.status == 404 and e.code in ("NoSuchKey", "NotFound")
        if isinstance(e, self._botoexc.ClientError):
            code = str(e.response.get("Error", {}).get("Code", ""))
            return code in ("NoSuchKey", "404", "NotFound")
        return False

    def ensure_bucket(self) -> None:
        """Create the bucket if it does not exist (a 404; any other refusal,
        say a 403 on HEAD from a policy, leaves it to the first write)."""
        def fn() -> None:
            try:
                self.client.head_bucket(Bucket=self.bucket)
            except self._botoexc.ClientError as e:
                status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
                if status == 404:
                    self.client.create_bucket(Bucket=self.bucket)
                elif status not in (301, 403):
                    raise
        self._retry("create bucket", self.bucket, fn)

    def put(self, key: str, data: bytes) -> None:
        self._retry("put", key, lambda: self.client.put_object(
            Bucket=self.bucket, Key=self.prefix + key, Body=data))

    def put_new(self, key: str, data: bytes) -> bool:
        """A conditional PUT (If-None-Match: *; S3 since 2024, SeaweedFS,
        MinIO): 412 when the key exists."""
        def fn() -> bool:
            try:
                self.client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data,
                                       IfNoneMatch="*")
                return True
            except self._botoexc.ClientError as e:
                status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
                if status not in (409, 412):  # (409: a concurrent conditional write)
                    raise
            try:  # a retry of a put that did land finds its own bytes
                return self.get(key) == data
            except ObjectNotFound:
                return False
        return self._retry("exclusive put", key, fn)

    def _get(self, key: str, first: int | None = None, last: int | None = None) -> bytes:
        def fn() -> bytes:
            try:
                return self._gets.get(self.prefix + key, first, last)
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
        try:
            return self._get(key, offset, offset + length - 1)
        except ObjectStoreError as e:
            # a range at or past the end: short (empty), like the POSIX store
            cause = e.__cause__
            if isinstance(cause, S3StatusError) and (cause.code == "InvalidRange"
                                                     or cause.status == 416):
                return b""
            raise

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

    def _objects(self, prefix: str) -> Iterator[dict[str, Any]]:
        """Every object record (Key, LastModified, Size) under prefix, page by page."""
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.prefix + prefix}
            if token:
                kw["ContinuationToken"] = token

            def fn(kw: dict[str, Any] = kw) -> dict[str, Any]:
                return dict(self.client.list_objects_v2(**kw))
            page = self._retry("list", prefix, fn)
            yield from page.get("Contents", [])
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")

    def list(self, prefix: str) -> Iterator[str]:
        for obj in self._objects(prefix):
            yield str(obj["Key"])[len(self.prefix):]

    def delete(self, key: str) -> None:
        self._retry("delete", key, lambda: self.client.delete_object(
            Bucket=self.bucket, Key=self.prefix + key))

    def list_ages(self, prefix: str) -> Iterator[tuple[str, float, int]]:
        now = time.time()
        for obj in self._objects(prefix):
            yield (str(obj["Key"])[len(self.prefix):],
                   now - obj["LastModified"].timestamp(), int(obj.get("Size", 0)))

    def touch(self, key: str) -> None:
        """A copy onto itself with replaced metadata: a new LastModified, same bytes."""
        def fn() -> None:
            try:
                self.client.copy_object(
                    Bucket=self.bucket, Key=self.prefix + key, MetadataDirective="REPLACE",
                    CopySource={"Bucket": self.bucket, "Key": self.prefix + key},
                    Metadata={"touched": str(int(time.time()))})
            except Exception as e:
                if self._missing(e):
                    raise ObjectNotFound(f"{self.url}: no object {key!r}") from None
                raise
        self._retry("touch", key, fn)
