"""Where bytes live: a local path, or an object in a bucket (`s3://bucket/key`).

A URL of another scheme (gs://, az://, hdfs://, http://, ...) is refused in one line wherever a
path is read: it is never taken for a relative folder named `gs:`.

The bucket is reached with boto3 (pinned with botocore in requirements.lock), configured the way
every AWS tool is: credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (and
AWS_SESSION_TOKEN), AWS_PROFILE and ~/.aws/, or the pod's role; an S3-compatible server's address
from AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL; the region from AWS_REGION/AWS_DEFAULT_REGION
(us-east-1 when none is set). Nothing here writes a credential anywhere.

Every call is retried with bounded exponential backoff while the failure may clear (the server
unreachable or restarting, 5xx, 503 SlowDown and other throttling) for up to TRAINER_S3_RETRY_S
seconds (default 60); then, or at once for a failure no retry fixes (a wrong key, no such
bucket, access denied), a BucketError: an OSError whose errno says which (EACCES, ENOENT: the
path's fault, exit 2; EIO: may clear, exit 4), with one line naming the object and the cause.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from trainer.errors import UsageError, first_line, io_error

SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
SUPPORTED = ("s3",)
RETRY_ENV = "TRAINER_S3_RETRY_S"
CHUNK = 8 << 20
"""Bytes a part of a multipart upload (and a read of a download) holds in memory."""


def scheme(path: str | None) -> str | None:
    """The URL scheme of `path` ('s3', 'gs', ...), None for a local path."""
    found = SCHEME.match(path or "")
    return found[1].lower() if found else None


def is_url(path: str | None) -> bool:
    """Whether `path` names an object store (s3://...) rather than a local path."""
    return scheme(path) == "s3"


def check_path(key: str, value: str | None, buckets: bool = True) -> None:
    """A one-line UsageError for a URL the key cannot take: a scheme other than s3://, s3://
    where only local paths work (`buckets` false), or an s3:// URL without a bucket."""
    kind = scheme(value)
    if kind is None:
        return
    if kind not in SUPPORTED or not buckets:
        where = "s3://bucket/prefix or a local path" if buckets else "a local path"
        raise UsageError(
            f"{key}={value}: {kind}:// is not supported here: use {where} "
            "(a URL is never taken for a local folder)"
        )
    bucket, _ = split(value)
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
        raise UsageError(
            f"{key}={value}: '{bucket}' is not a bucket name (3-63 lowercase letters, digits, "
            "dots and hyphens): write s3://BUCKET/prefix"
        )


def split(url: str) -> tuple[str, str]:
    """('bucket', 'key/prefix') of s3://bucket/key/prefix (no slash at either end of the key)."""
    rest = url[len("s3://") :] if url.lower().startswith("s3://") else url
    bucket, _, key = rest.partition("/")
    return bucket, key.strip("/")


def join(url: str, *names: str) -> str:
    """`url` with `names` appended, '/'-separated (URLs and local paths alike)."""
    if not is_url(url):
        return os.path.join(url, *names)
    return "/".join([url.rstrip("/"), *(n.strip("/") for n in names)])


def basename(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


class BucketError(OSError):
    """An object-store call that failed (after retries, where a retry could help)."""


@dataclass(frozen=True)
class Listed:
    """One object of a listing."""

    key: str
    size: int
    etag: str


_PERMANENT = {
    "InvalidAccessKeyId": (errno.EACCES, "the access key is not known to the server"),
    "SignatureDoesNotMatch": (errno.EACCES, "the secret key is wrong"),
    "AccessDenied": (errno.EACCES, "access denied"),
    "AllAccessDisabled": (errno.EACCES, "access denied"),
    "InvalidToken": (errno.EACCES, "the session token is wrong"),
    "ExpiredToken": (errno.EACCES, "the session token expired"),
    "NoSuchBucket": (errno.ENOENT, "no such bucket"),
    "InvalidBucketName": (errno.EINVAL, "not a valid bucket name"),
    "QuotaExceeded": (errno.EDQUOT, "the bucket's quota is full"),
}
_RETRY_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "RequestTimeout",
    "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable", "503", "500", "502", "504",
}  # fmt: skip


def _classify(e: BaseException) -> tuple[bool, int, str]:
    """(whether a retry may help, the errno to report, the cause in words)."""
    from botocore import exceptions as bx

    if isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError)):
        return False, errno.EACCES, (
            "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
        )  # fmt: skip
    if isinstance(e, bx.ClientError):
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code in _PERMANENT:
            number, words = _PERMANENT[code]
            return False, number, f"{words} ({code})"
        if code in _RETRY_CODES or status >= 500 or status == 429:
            return True, errno.EIO, f"{code or status}: {err.get('Message') or 'server error'}"
        if status == 403:
            return False, errno.EACCES, "access denied (403): check the key and its permissions"
        if status == 404:
            return False, errno.ENOENT, "not found (404)"
        return False, errno.EIO, f"{code or status}: {err.get('Message', '')}".strip()
    if isinstance(e, (bx.EndpointConnectionError, bx.ConnectionError, bx.HTTPClientError)):
        return True, errno.EIO, f"cannot reach the S3 endpoint ({first_line(e)}){_endpoint_hint()}"
    if isinstance(e, ConnectionError | TimeoutError):
        return True, errno.EIO, first_line(e)
    return False, errno.EIO, first_line(e)


FIX = (
    "check the bucket's name and the key (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
    "AWS_ENDPOINT_URL for an S3-compatible server; docs/training.md, 'Checkpoints in a bucket')"
)


@contextlib.contextmanager
def explained(what: str):
    """A BucketError inside the block as one line about `what`: a UsageError (exit 2) when the
    key, the bucket or the endpoint is at fault, else a RetryableError (exit 4)."""
    try:
        yield
    except BucketError as e:
        raise io_error(e, what, FIX) from None


def _endpoint_hint() -> str:
    if os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"):
        return ""
    return "; no AWS_ENDPOINT_URL is set, so this is AWS itself: set it for an S3-compatible server"


def retry_seconds() -> float:
    try:
        return max(0.0, float(os.environ.get(RETRY_ENV, "60")))
    except ValueError:
        return 60.0


def retried(what: str, call: Callable, *, deadline: float | None = None):
    """call() until it succeeds, retrying what may clear with backoff (0.2 s doubling to 5 s,
    jittered; throttling starts at 1 s) for up to `deadline` seconds (TRAINER_S3_RETRY_S);
    a BucketError naming `what` and the cause otherwise."""
    limit = retry_seconds() if deadline is None else deadline
    started, delay = time.monotonic(), 0.2
    while True:
        try:
            return call()
        except BucketError:
            raise
        except Exception as e:
            retry, number, cause = _classify(e)
            left = limit - (time.monotonic() - started)
            if not retry or left <= 0:
                waited = f" (retried for {limit:.0f} s)" if retry else ""
                raise BucketError(number, f"{what}: {cause}{waited}") from None
            if "SlowDown" in cause or "Throttl" in cause:
                delay = max(delay, 1.0)
            time.sleep(min(delay * (0.5 + random.random()), left))
            delay = min(delay * 2, 5.0)


_LOCAL = threading.local()


_SESSION_LOCK = threading.Lock()


def _session_lock() -> threading.Lock:
    return _SESSION_LOCK


def _after_fork() -> None:
    """A forked process (a loader worker) starts with the lock free, whatever a thread of its
    parent held."""
    global _SESSION_LOCK
    _SESSION_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def client():
    """This thread's S3 client (boto3 clients are thread-safe to use, not to create; a forked
    process makes its own, never using its parent's connections)."""
    made = getattr(_LOCAL, "client", None)
    if made is not None and made[0] == os.getpid():  # not one a forked loader worker inherited
        return made[1]
    import boto3
    from botocore.config import Config

    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        value = os.environ.get(name)
        if value and not re.match(r"^https?://[^/]", value):
            raise BucketError(
                errno.EINVAL, f"{name}={value} is not a URL: write http://HOST:PORT or https://..."
            )
    with _session_lock():
        session = boto3.session.Session()
        made = session.client(
            "s3",
            region_name=session.region_name or "us-east-1",
            config=Config(
                retries={"max_attempts": 1, "mode": "standard"},  # ours: retried() above
                connect_timeout=5,
                read_timeout=30,
                s3={"addressing_style": "path"},
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )
    _LOCAL.client = (os.getpid(), made)
    return made


def listing(url: str) -> list[Listed]:
    """Every object under the prefix `url` (one paginated listing)."""
    bucket, prefix = split(url)
    prefix = f"{prefix}/" if prefix else ""

    def pages() -> list[Listed]:
        found = []
        for page in (
            client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        ):
            for item in page.get("Contents", ()):
                found.append(Listed(item["Key"], int(item["Size"]), item["ETag"].strip('"')))
        return found

    return retried(f"listing {url}", pages)


def url_of(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def put_file(path: str, url: str, sha256: str) -> str:
    """Upload the local file `path` to `url` (multipart above CHUNK, parts streamed from the
    file), its sha256 in the object's metadata; returns the object's ETag. An upload that fails
    aborts its multipart upload where the server answers."""
    from boto3.s3.transfer import TransferConfig

    bucket, key = split(url)
    config = TransferConfig(
        multipart_threshold=CHUNK, multipart_chunksize=CHUNK, max_concurrency=4,
        use_threads=True,
    )  # fmt: skip

    def upload() -> str:
        client().upload_file(
            path, bucket, key, ExtraArgs={"Metadata": {"sha256": sha256}}, Config=config
        )
        return client().head_object(Bucket=bucket, Key=key)["ETag"].strip('"')

    return retried(f"uploading {url}", _unwrapped(upload))


def _unwrapped(call: Callable) -> Callable:
    """`call` with boto3's S3UploadFailedError/transfer errors turned back into their cause (so
    retried() can tell a refused key from an outage)."""

    def run():
        try:
            return call()
        except Exception as e:
            cause = e.__cause__ or e.__context__
            if type(e).__name__ in ("S3UploadFailedError", "RetriesExceededError") and cause:
                raise cause from None
            raise

    return run


def put_bytes(url: str, data: bytes, *, only_new: bool = False) -> str:
    """Write a small object in one PUT; `only_new`: a conditional put (If-None-Match: *) that
    fails with FileExistsError when the object exists. Returns its ETag."""
    from botocore.exceptions import ClientError

    bucket, key = split(url)
    extra = {"IfNoneMatch": "*"} if only_new else {}

    def put() -> str:
        try:
            done = client().put_object(Bucket=bucket, Key=key, Body=data, **extra)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
                raise FileExistsError(errno.EEXIST, f"{url} exists already") from None
            raise
        return done["ETag"].strip('"')

    return retried(f"writing {url}", put)


def get_bytes(url: str) -> bytes:
    bucket, key = split(url)
    return retried(
        f"reading {url}", lambda: client().get_object(Bucket=bucket, Key=key)["Body"].read()
    )


def exists(url: str) -> bool:
    from botocore.exceptions import ClientError

    bucket, key = split(url)

    def head() -> bool:
        try:
            client().head_object(Bucket=bucket, Key=key)
            return True
        except ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return False
            raise

    return retried(f"looking up {url}", head)


def head_sha256(url: str) -> tuple[int, str, str]:
    """(size, ETag, the sha256 its uploader recorded ('' if none)) of one object."""
    bucket, key = split(url)
    found = retried(f"looking up {url}", lambda: client().head_object(Bucket=bucket, Key=key))
    return (
        int(found["ContentLength"]),
        found["ETag"].strip('"'),
        found["Metadata"].get("sha256", ""),
    )


def get_file(url: str, path: str) -> str:
    """Download `url` to the local file `path` (streamed: CHUNK bytes in memory at most);
    returns the sha256 of what was written. A download cut off part-way starts over."""

    def download() -> str:
        bucket, key = split(url)
        body = client().get_object(Bucket=bucket, Key=key)["Body"]
        h = hashlib.sha256()
        try:
            f = open(path, "wb")  # noqa: SIM115 (closed below; a failed write is not retried)
        except OSError as e:
            raise BucketError(e.errno, f"writing {path}: {e.strerror}") from None
        with f:
            for block in body.iter_chunks(CHUNK):
                h.update(block)
                try:
                    f.write(block)
                except OSError as e:  # a full local disk: no retry clears it
                    raise BucketError(e.errno, f"writing {path}: {e.strerror}") from None
        return h.hexdigest()

    return retried(f"reading {url}", download)


def delete(bucket: str, keys: list[str]) -> None:
    """Delete `keys` (1000 a request)."""
    for start in range(0, len(keys), 1000):
        batch = [{"Key": k} for k in keys[start : start + 1000]]
        retried(
            f"deleting {len(batch)} objects in s3://{bucket}",
            lambda b=batch: client().delete_objects(Bucket=bucket, Delete={"Objects": b}),
        )


def abort_uploads(url: str) -> int:
    """Abort every unfinished multipart upload under the prefix `url` (a writer killed
    mid-upload leaves its parts, billed and invisible); returns how many."""
    bucket, prefix = split(url)
    prefix = f"{prefix}/" if prefix else ""

    def sweep() -> int:
        found = client().list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
        for upload in found:
            client().abort_multipart_upload(
                Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
            )
        return len(found)

    return retried(f"aborting unfinished uploads under {url}", sweep)


def probe(url: str) -> None:
    """Write and delete one object under `url`: the bucket exists, and the key may write and
    delete there. A BucketError naming which is not so."""
    bucket, prefix = split(url)
    key = "/".join(p for p in (prefix, f".write-probe-{os.getpid()}") if p)
    put_bytes(url_of(bucket, key), b"")
    delete(bucket, [key])


def walk(url: str) -> Iterator[tuple[str, Listed]]:
    """(path relative to `url`, the object) for each object under the prefix `url`."""
    _, prefix = split(url)
    for item in listing(url):
        yield item.key[len(prefix) + 1 if prefix else 0 :], item
