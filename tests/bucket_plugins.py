"""Models for the bucket tests (tests/test_bucket.py) that make a trainer process pause at a
chosen point of a checkpoint's upload, after leaving a marker file, so a test can SIGKILL it
there. Named in a config as model.name=tests.bucket_plugins:paused_mlp (the patch is made in
the trainer process when it builds the model), with TRAINER_TEST_PAUSE=POINT:STEP:DIR.

POINT: `multipart` (the checkpoint's optimizer.pt or a rank's shard: a multipart upload begun,
one part sent), `manifest` (every object uploaded, the manifest not yet written).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from tests.helpers import slow_mlp


def _pause(marker_dir: str, name: str) -> None:
    Path(marker_dir, name).write_text(str(os.getpid()))
    time.sleep(600)


def paused_mlp(in_shape, num_classes, hidden=(32,), delay=0.0):
    from trainer import storage

    if not os.environ.get("TRAINER_TEST_PAUSE"):
        return slow_mlp(in_shape, num_classes, hidden=hidden, delay=delay)
    point, step, marker_dir = os.environ["TRAINER_TEST_PAUSE"].split(":", 2)
    wanted = f"step-{int(step):09d}."
    real_put_file, real_put_bytes = storage.put_file, storage.put_bytes

    def put_file(path, url, sha256):
        target = re.search(r"/(optimizer\.pt|dcp/__\d+_0\.distcp)$", url)
        if point == "multipart" and wanted in url and target:
            bucket, key = storage.split(url)
            c = storage.client()
            upload = c.create_multipart_upload(Bucket=bucket, Key=key)
            c.upload_part(
                Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1,
                Body=b"\0" * (5 << 20),
            )  # fmt: skip
            _pause(marker_dir, f"paused-{os.environ.get('RANK', '0')}")
        return real_put_file(path, url, sha256)

    def put_bytes(url, data, *, only_new=False):
        if point == "manifest" and wanted in url and url.endswith("/MANIFEST.json"):
            _pause(marker_dir, "paused-0")
        return real_put_bytes(url, data, only_new=only_new)

    storage.put_file, storage.put_bytes = put_file, put_bytes
    return slow_mlp(in_shape, num_classes, hidden=hidden, delay=delay)
