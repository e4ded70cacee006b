"""An MLflow tracking server through its REST API (/api/2.0/mlflow/...), standard library only.

Why not the `mlflow` package: its client pins importlib_metadata below 10, which our lock holds
at 10.2.0, and brings ~60 packages into every training image for a dozen HTTP calls. The
server, its UI and MlflowClient read what this writes (tests/test_tracking.py checks that).

The tracked run's id is kept in RUN_DIR/tracking/mlflow.json, so a resumed run (SIGKILL,
SIGTERM, a restart, --resume) continues the same MLflow run. It asks the server which steps it
already holds and skips them: a resume recomputes the steps after its checkpoint (the same
numbers, bitwise on CPU), and a killed attempt may have sent a batch it never heard back about.
"""

from __future__ import annotations

import base64
import json
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request

from trainer.errors import redact
from trainer.tracking.sender import Sink, metrics_of, read_state, write_state

TIMEOUT_S = 10.0
"""One HTTP request's bound: a slow server slows the sender thread, never training."""


class ServerError(Exception):
    """The server answered with an error (its error_code and message)."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"HTTP {status} {code}: {message}"[:300])
        self.code = code
        self.permanent = status == 0 or (400 <= status < 500 and status not in (401, 403, 408, 429))
        """The request itself is at fault: sending it again cannot help (a bad token may be
        replaced, a rate limit passes)."""


class Client:
    """The REST calls, with credentials from the environment (MLflow's own variables:
    MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD;
    MLFLOW_TRACKING_INSECURE_TLS=true skips certificate checks)."""

    def __init__(self, uri: str, environ):
        parts = urllib.parse.urlsplit(uri)
        self.base = redact(uri).rstrip("/")
        self.headers = {"Content-Type": "application/json"}
        user, password = (
            environ.get("MLFLOW_TRACKING_USERNAME"),
            environ.get("MLFLOW_TRACKING_PASSWORD"),
        )
        if parts.username:  # http://user:pass@host in the URI itself
            user, password = (
                urllib.parse.unquote(parts.username),
                urllib.parse.unquote(parts.password or ""),
            )
        if token := environ.get("MLFLOW_TRACKING_TOKEN"):
            self.headers["Authorization"] = f"Bearer {token}"
        elif user:
            pair = base64.b64encode(f"{user}:{password or ''}".encode()).decode()
            self.headers["Authorization"] = f"Basic {pair}"
        insecure = environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() in ("1", "true")
        self.context = ssl._create_unverified_context() if insecure else None

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        url = f"{self.base}/api/2.0/mlflow/{path}"
        data = None
        if method == "GET" and body:
            url += "?" + urllib.parse.urlencode(body)
        elif body is not None:
            data = json.dumps(body).encode()
        return self._open(urllib.request.Request(url, data, self.headers, method=method))

    def upload(self, artifact_uri: str, name: str, path: str) -> None:
        """A file into the run's artifacts through the server's proxy (mlflow-artifacts:/)."""
        if not artifact_uri.startswith("mlflow-artifacts:"):
            raise ServerError(0, "NO_PROXY", f"artifacts go to {artifact_uri}, not the server")
        where = artifact_uri.split(":", 1)[1].lstrip("/")
        url = f"{self.base}/api/2.0/mlflow-artifacts/artifacts/{where}/{urllib.parse.quote(name)}"
        with open(path, "rb") as f:
            data = f.read()
        headers = {**self.headers, "Content-Type": "application/octet-stream"}
        self._open(urllib.request.Request(url, data, headers, method="PUT"))

    def _open(self, request) -> dict:
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=self.context) as r:
                text = r.read().decode() or "{}"
        except urllib.error.HTTPError as e:
            try:
                answer = json.loads(e.read().decode() or "{}")
            except ValueError:
                answer = {}
            raise ServerError(
                e.code, answer.get("error_code", e.reason), answer.get("message", "")
            ) from None
        return json.loads(text)


class MLflowSink(Sink):
    """One MLflow run for one trainer run, continued across resumes."""

    name = "MLflow"

    def __init__(self, *, uri, environ, experiment, run_name, params, tags, state_path):
        self.client = Client(uri, environ)
        self.where = self.client.base
        self.experiment, self.run_name = experiment, run_name
        self.params, self.tags = params, tags
        self.state_path = state_path
        self.state = read_state(state_path)
        self.artifact_uri = ""
        self.held: set[tuple[str, int]] = set()
        """(kind, step) of the train and eval records an earlier attempt sent."""

    @property
    def run_id(self) -> str | None:
        return self.state.get("run_id")

    def connect(self) -> None:
        if self.run_id is None:
            self._create()
        else:
            info = self.client.call(
                "POST", "runs/update", {"run_id": self.run_id, "status": "RUNNING"}
            )
            self.artifact_uri = info.get("run_info", {}).get("artifact_uri", "")
            train, evals = self._steps("loss"), self._steps("eval.count")
            self.held = {("train", s) for s in train} | {("eval", s) for s in evals}
        self._log_batch(tags=[{"key": k, "value": str(v)[:8000]} for k, v in self.tags.items()])

    def _create(self) -> None:
        experiment_id = self._experiment_id()
        run = self.client.call(
            "POST",
            "runs/create",
            {
                "experiment_id": experiment_id,
                "run_name": self.run_name,
                "start_time": int(time.time() * 1000),
                "tags": [{"key": "mlflow.runName", "value": self.run_name}],
            },
        )["run"]["info"]
        self.state = {"run_id": run["run_id"], "experiment_id": experiment_id}
        self.artifact_uri = run.get("artifact_uri", "")
        self._save_state()
        items = list(self.params.items())
        for i in range(0, len(items), 100):  # the server takes 100 params a request
            chunk = items[i : i + 100]
            self._log_batch(params=[{"key": k[:250], "value": v[:6000]} for k, v in chunk])

    def _steps(self, key: str) -> set[int]:
        """The steps the server holds of a metric (every train record has a loss, every
        evaluation a count)."""
        steps, query = set(), {"run_id": self.run_id, "metric_key": key, "max_results": 25000}
        while True:
            got = self.client.call("GET", "metrics/get-history", query)
            steps |= {int(m.get("step", 0)) for m in got.get("metrics", [])}
            if not got.get("next_page_token"):
                return steps
            query["page_token"] = got["next_page_token"]

    def _experiment_id(self) -> str:
        try:
            got = self.client.call(
                "GET", "experiments/get-by-name", {"experiment_name": self.experiment}
            )
            return got["experiment"]["experiment_id"]
        except ServerError as e:
            if e.code != "RESOURCE_DOES_NOT_EXIST":
                raise
        try:
            return self.client.call("POST", "experiments/create", {"name": self.experiment})[
                "experiment_id"
            ]
        except ServerError as e:  # created by another run meanwhile
            if e.code != "RESOURCE_ALREADY_EXISTS":
                raise
            return self._experiment_id()

    def send(self, records: list[dict]) -> None:
        records = [r for r in records if (r["kind"], r["step"]) not in self.held]
        metrics = [
            {
                "key": k,
                "value": v,
                "timestamp": int(1000 * r.get("time", time.time())),
                "step": r["step"],
            }
            for r in records
            for k, v in metrics_of(r).items()
        ]
        for i in range(0, len(metrics), 1000):  # the server takes 1000 metrics a request
            self._log_batch(metrics=metrics[i : i + 1000])

    def finish(self, status: str, files: list[tuple[str, str]]) -> list[str]:
        refused = []
        for name, path in files:
            try:
                self.client.upload(self.artifact_uri, name, path)
            except ServerError as e:  # too large, no artifact proxy: the others still go
                if not e.permanent:
                    raise
                refused.append((name, str(e)))
        self.client.call(
            "POST",
            "runs/update",
            {"run_id": self.run_id, "status": status, "end_time": int(time.time() * 1000)},
        )
        return refused

    def _log_batch(self, **items) -> None:
        self.client.call("POST", "runs/log-batch", {"run_id": self.run_id, **items})

    def _save_state(self) -> None:
        write_state(self.state_path, self.state)
