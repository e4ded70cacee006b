"""trainer/storage.py without a server: which URLs a path key takes, and how a failing call is
retried or reported. (Against a real S3 server: tests/test_bucket.py, make test-s3.)"""

from __future__ import annotations

import errno
import time

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from tests.helpers import trainer
from trainer import storage
from trainer.errors import UsageError


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("ckpt.dir=gs://bucket/run", "ckpt.dir=gs://bucket/run: gs:// is not supported here"),
        ("ckpt.init_weights=hdfs://nn/w", "hdfs:// is not supported here: use s3://"),
        ("run_dir=s3://bucket/run", "run_dir=s3://bucket/run: s3:// is not supported here: use a local path"),
        ("data.tokens.path=s3://bucket/t", "use a local path"),
        ("ckpt.dir=s3://Bucket_1/run", "'Bucket_1' is not a bucket name"),
    ],
)  # fmt: skip
def test_a_url_a_key_cannot_take_is_refused_in_one_line_never_made_a_local_folder(
    tmp_path, override, says
):
    p = trainer("config", "check", override, check=False)
    assert p.returncode == 2
    [line] = p.stderr.strip().splitlines()
    assert says in line


def test_export_writes_to_a_local_folder_or_a_bucket_only(tmp_path):
    p = trainer("export", str(tmp_path), "-o", "gs://bucket/out", check=False)
    assert p.returncode == 2
    assert "export -o=gs://bucket/out: gs:// is not supported here" in p.stderr


def test_urls_split_and_join():
    assert storage.split("s3://b-1/a/b/") == ("b-1", "a/b")
    assert storage.split("s3://b-1") == ("b-1", "")
    assert storage.join("s3://b-1/a/", "step-1", "dcp/x") == "s3://b-1/a/step-1/dcp/x"
    assert storage.is_url("S3://b/x") and not storage.is_url("runs/s3/x")
    with pytest.raises(UsageError):
        storage.check_path("ckpt.dir", "s3:///x")


def _client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")  # fmt: skip


def test_a_call_is_retried_while_the_failure_may_clear_then_one_line_naming_the_object(
    monkeypatch,
):
    sleeps = []
    monkeypatch.setattr(time, "sleep", sleeps.append)
    calls = iter([_client_error("SlowDown", 503), EndpointConnectionError(endpoint_url="x"), 7])

    def flaky():
        outcome = next(calls)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert storage.retried("writing s3://b/k", flaky, deadline=60) == 7
    assert len(sleeps) == 2 and sleeps[0] >= 0.5  # throttling starts at a longer wait

    def down():
        raise EndpointConnectionError(endpoint_url="http://127.0.0.1:9")

    clock = iter(range(0, 1000, 3))
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    with pytest.raises(storage.BucketError) as e:
        storage.retried("uploading s3://b/k/model.safetensors", down, deadline=10)
    assert e.value.errno == errno.EIO  # may clear: exit 4, the next save retries
    assert "uploading s3://b/k/model.safetensors: cannot reach the S3 endpoint" in str(e.value)
    assert "retried for 10 s" in str(e.value)


@pytest.mark.parametrize(
    ("code", "status", "number", "words"),
    [
        ("SignatureDoesNotMatch", 403, errno.EACCES, "the secret key is wrong"),
        ("InvalidAccessKeyId", 403, errno.EACCES, "access key is not known"),
        ("NoSuchBucket", 404, errno.ENOENT, "no such bucket"),
        ("AccessDenied", 403, errno.EACCES, "access denied"),
    ],
)
def test_a_failure_no_retry_fixes_is_reported_at_once(code, status, number, words):
    tries = []

    def refused():
        tries.append(1)
        raise _client_error(code, status)

    with pytest.raises(storage.BucketError) as e:
        storage.retried("listing s3://b/run", refused, deadline=60)
    assert len(tries) == 1
    assert e.value.errno == number and words in str(e.value)
