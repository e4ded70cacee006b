"""The k8s/ manifests as a cluster would see them: rendered by `kubectl kustomize`, validated offline,
and turned into what each pod runs (argv and environment) the way Kubernetes and its controllers
fill them in. Tests use this instead of repeating any string that lives in the manifests.

Kubernetes-side facts used here (not ours to choose), with where they come from:
- Indexed Job pods: hostname `<job>-<index>`, env JOB_COMPLETION_INDEX, labels
  batch.kubernetes.io/job-name and batch.kubernetes.io/controller-uid (Kubernetes >= 1.27);
- JobSet: child Jobs `<jobset>-<replicatedJob>-<jobIndex>`, pods labelled
  jobset.sigs.k8s.io/jobset-name, subdomain `network.subdomain` (default: the JobSet's name);
- Kubeflow Trainer v2's torch plugin: PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
  PET_MASTER_ADDR `<trainjob>-node-0-0.<trainjob>`, PET_MASTER_PORT 29500 (pkg/constants);
- Kubeflow training-operator v1 (release-1.9), a PyTorchJob: pods `<job>-<type>-<index>` created by
  the operator itself (no Job labels), labelled training.kubeflow.org/job-name, operator-name,
  replica-type (lower case), replica-index, and job-role=master on Worker 0 when there is no
  Master (pkg/controller.v1/common/pod.go, createNewPod). Its env goes AFTER the container's own:
  PYTHONUNBUFFERED=1, PET_NPROC_PER_NODE from spec.nprocPerNode (defaulted to "auto" unless
  elasticPolicy.nProcPerNode is set), then with an elasticPolicy PET_RDZV_ENDPOINT
  `<rdzvHost|job-worker-0>:<rdzvPort>`, PET_RDZV_BACKEND (default c10d), PET_NNODES
  `MIN:MAX`, PET_MAX_RESTARTS, PET_RDZV_ID and PET_RDZV_CONF when set (pytorch/envvar.go,
  elastic.go; defaults: pytorch_defaults.go);
- `$(VAR)` in env values and args expands to a variable defined EARLIER in the same container,
  `$$` is a literal `$`, and an undefined reference stays as written.
"""

from __future__ import annotations

import copy
import functools
import gzip
import hashlib
import math
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.helpers import ROOT

K8S = ROOT / "k8s"
OVERLAYS = sorted(
    p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists()
)
COMPONENTS_DIR = K8S / "components"
COMPONENTS = sorted(p.name for p in COMPONENTS_DIR.iterdir() if (p / "kustomization.yaml").exists())
CRDS = ROOT / "tests" / "fixtures" / "crds"
"""The upstream CRDs, unmodified and gzipped (their sources and licences: the README there)."""
KUBERNETES_VERSION = "1.37"  # the newest schemas kubernetes-validate 1.37.0 ships

JOB_NAME = "batch.kubernetes.io/job-name"
CONTROLLER_UID = "batch.kubernetes.io/controller-uid"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
KUBEFLOW_NODE = "node"  # Trainer v2's replicated Job and container for the training nodes
KUBEFLOW_MASTER_PORT = "29500"
PYTORCHJOB_NAME = "training.kubeflow.org/job-name"  # training-operator v1's labels on its pods
PYTORCHJOB_OPERATOR = "training.kubeflow.org/operator-name"
PYTORCHJOB_TYPE = "training.kubeflow.org/replica-type"
PYTORCHJOB_INDEX = "training.kubeflow.org/replica-index"
PYTORCHJOB_ROLE = "training.kubeflow.org/job-role"
PYTORCHJOB_CONTAINER = "pytorch"  # the container the operator's webhook requires
WORKLOADS = ("Job", "JobSet", "TrainJob", "PyTorchJob")


def kubectl() -> str | None:
    return shutil.which("kubectl")


@functools.cache
def _render_text(path: str) -> str:
    p = subprocess.run(
        [kubectl() or "kubectl", "kustomize", path], capture_output=True, text=True, timeout=60
    )
    if p.returncode != 0:
        raise AssertionError(f"kubectl kustomize {path} failed:\n{p.stderr}")
    return p.stdout


def render(overlay: str | Path) -> list[dict]:
    """The objects `kubectl apply -k` would send (a fresh copy each call: mutate freely)."""
    path = Path(overlay) if Path(overlay).is_absolute() else K8S / "overlays" / str(overlay)
    return [copy.deepcopy(o) for o in yaml.safe_load_all(_render_text(str(path))) if o]


def render_with(folder: Path, overlay: str | Path, components=(), **fields) -> list[dict]:
    """What a user's own kustomization renders: `resources: [overlay]`, `components:` from
    k8s/components, and any other kustomization fields (patches, images, ...). It is written under
    `folder`, in a subfolder named by its content (render's cache is by path)."""
    overlay = Path(overlay) if Path(overlay).is_absolute() else K8S / "overlays" / str(overlay)
    paths = [overlay, *(COMPONENTS_DIR / c for c in components)]
    here = folder / hashlib.sha1(repr((paths, fields)).encode()).hexdigest()[:12]
    here.mkdir(parents=True, exist_ok=True)
    rel = [os.path.relpath(p, here) for p in paths]  # kustomize takes no absolute paths
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": rel[:1],
        **({"components": rel[1:]} if components else {}),
        **fields,
    }
    (here / "kustomization.yaml").write_text(yaml.safe_dump(kustomization, sort_keys=False))
    return render(here)


def one(objs: list[dict], kind: str) -> dict:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def kinds(objs: list[dict]) -> list[str]:
    return sorted(o["kind"] for o in objs)


# --- validation --------------------------------------------------------------------------------


def is_core(obj: dict) -> bool:
    """Built into Kubernetes (schemas in kubernetes-validate), as opposed to a CRD's kind."""
    group = obj["apiVersion"].rpartition("/")[0]
    return "." not in group or (group.endswith(".k8s.io") and not group.endswith(".x-k8s.io"))


@functools.cache
def _crd_versions() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> openAPIV3Schema, from the upstream CRDs in tests/fixtures/crds."""
    out = {}
    for path in sorted(CRDS.glob("*.yaml.gz")):
        text = gzip.decompress(path.read_bytes()).decode("utf-8")
        crd = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for v in crd["spec"]["versions"]:
            out[(f"{group}/{v['name']}", kind)] = v["schema"]["openAPIV3Schema"]
    return out


def crd_schema(obj: dict) -> dict | None:
    return _crd_versions().get((obj["apiVersion"], obj["kind"]))


def strict(schema: dict) -> dict:
    """The schema with unknown fields refused, as `kubectl apply` (server-side field validation:
    Strict, the default) refuses them, except where the CRD keeps unknown fields on purpose."""
    schema = copy.deepcopy(schema)

    def walk(s):
        if isinstance(s, dict):
            if (
                "properties" in s
                and "additionalProperties" not in s
                and not s.get("x-kubernetes-preserve-unknown-fields")
            ):
                s["additionalProperties"] = False
            for v in s.values():
                walk(v)
        elif isinstance(s, list):
            for v in s:
                walk(v)

    walk(schema)
    return schema


def validate_crd_object(obj: dict) -> list[str]:
    """Schema errors of a JobSet/TrainJob/... against its CRD (CEL rules cannot be run offline)."""
    import jsonschema

    schema = crd_schema(obj)
    assert schema is not None, f"no CRD schema for {obj['apiVersion']} {obj['kind']}"
    validator = jsonschema.Draft7Validator(strict(schema))
    return [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)
    ]


@functools.cache
def _kubernetes_validate():
    import kubernetes_validate
    import kubernetes_validate.utils

    # It re-reads the version's multi-megabyte JSON definitions on every call: read each once.
    if not hasattr(kubernetes_validate.utils.schema_contents, "cache_info"):
        kubernetes_validate.utils.schema_contents = functools.cache(
            kubernetes_validate.utils.schema_contents
        )
    return kubernetes_validate


def validate_core_object(obj: dict) -> str | None:
    """The first schema error of a built-in object (strict: unknown fields are errors), or None."""
    kubernetes_validate = _kubernetes_validate()
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return f"{'.'.join(map(str, e.path))}: {e.message}"
    return None


# --- what Kubernetes fills in ------------------------------------------------------------------


def expand(value: str, defined: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion (k8s.io/kubernetes third_party/forked/golang/expansion)."""
    out, i = [], 0
    while i < len(value):
        if value[i] == "$" and i + 1 < len(value):
            if value[i + 1] == "$":
                out.append("$")
                i += 2
                continue
            if value[i + 1] == "(" and (end := value.find(")", i + 2)) != -1:
                name = value[i + 2 : end]
                out.append(defined.get(name, value[i : end + 1]))
                i = end + 1
                continue
        out.append(value[i])
        i += 1
    return "".join(out)


def cpu_quantity(raw) -> float:
    text = str(raw)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


@dataclass
class Pod:
    """One pod of a training workload, as its controller creates it."""

    index: int
    hostname: str
    subdomain: str
    labels: dict[str, str]
    annotations: dict[str, str]
    ip: str
    spec: dict
    """The pod spec (for a TrainJob: assembled from its trainer fields and runtime patch)."""
    container: dict
    injected: dict[str, str] = field(default_factory=dict)
    """Variables the controller adds before the container's own (JOB_COMPLETION_INDEX, PET_*)."""
    appended: dict[str, str] = field(default_factory=dict)
    """Variables the controller adds after the container's own (a PyTorchJob's PET_*): the last
    of a name wins."""

    @property
    def dns_name(self) -> str:
        """What the headless Service makes resolvable inside the namespace."""
        return f"{self.hostname}.{self.subdomain}"

    def env(self) -> dict[str, str]:
        """The container's environment: injected variables, then its own in order, expanded."""
        out = dict(self.injected)
        for var in self.container.get("env", []):
            if "valueFrom" in var:
                out[var["name"]] = self._value_from(var["valueFrom"])
            else:
                out[var["name"]] = expand(str(var.get("value", "")), out)
        return {**out, **self.appended}

    def _value_from(self, source: dict) -> str:
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            if m := re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path):
                table = self.labels if m.group(1) == "labels" else self.annotations
                assert m.group(2) in table, f"pods of this workload carry no {m.group(2)}"
                return table[m.group(2)]
            if path == "status.podIP":
                return self.ip
            if path == "metadata.name":
                return f"{self.hostname}-x7k2p"
            raise AssertionError(f"fieldRef {path} is not simulated here")
        if "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            assert ref["resource"] == "limits.cpu", ref
            limit = cpu_quantity(self.container["resources"]["limits"]["cpu"])
            return str(math.ceil(limit / cpu_quantity(ref.get("divisor", "1"))))
        raise AssertionError(f"env source {source} is not simulated here")

    def argv(self, entrypoint: list[str], cmd: list[str]) -> list[str]:
        """Kubernetes' rule: `command` replaces the image's ENTRYPOINT, `args` its CMD; both
        expand $(VAR) from the container's environment."""
        e = self.env()
        command = self.container.get("command") or entrypoint
        args = (
            self.container.get("args")
            if "args" in self.container
            else (cmd if "command" not in self.container else [])
        )
        return [expand(str(a), e) for a in [*command, *(args or [])]]


POD_UID = "6f1c2a44-0d4e-4b55-9a51-3d2b8e0f7c19"  # stands in for the Job's metadata.uid


def pods(objs: list[dict], ip=lambda i: f"10.8.{i}.17") -> list[Pod]:
    """Every pod of the overlay's training workload (an Indexed Job, a JobSet, a TrainJob or a
    PyTorchJob: for an elastic one, the pods its Worker replicas start)."""
    w = workload(objs)
    name = w["metadata"]["name"]
    if w["kind"] == "TrainJob":
        return _trainjob_pods(w, ip)
    if w["kind"] == "PyTorchJob":
        return _pytorchjob_pods(w, ip)
    if w["kind"] == "JobSet":
        assert len(w["spec"]["replicatedJobs"]) == 1
        rjob = w["spec"]["replicatedJobs"][0]
        job_name, job = f"{name}-{rjob['name']}-0", rjob["template"]["spec"]
        subdomain = w["spec"].get("network", {}).get("subdomain") or name
        extra = {JOBSET_NAME: name}
    else:
        job_name, job, extra = name, w["spec"], {}
        subdomain = job["template"]["spec"].get("subdomain", "")
    out = []
    for i in range(job["completions"]):
        spec = job["template"]["spec"]
        labels = {
            **job["template"].get("metadata", {}).get("labels", {}),
            JOB_NAME: job_name,
            CONTROLLER_UID: POD_UID,
            COMPLETION_INDEX: str(i),
            **extra,
        }
        container = training_container(spec)
        out.append(
            Pod(
                i,
                f"{job_name}-{i}",
                subdomain,
                labels,
                {COMPLETION_INDEX: str(i)},
                ip(i),
                spec,
                container,
                {"JOB_COMPLETION_INDEX": str(i)},
            )
        )
    return out


def workload(objs: list[dict]) -> dict:
    """The overlay's one training workload."""
    found = [o for o in objs if o["kind"] in WORKLOADS]
    assert len(found) == 1, f"one training workload per overlay, found {kinds(found)}"
    return found[0]


def training_container(spec: dict) -> dict:
    assert len(spec["containers"]) == 1, "one container per pod"
    return spec["containers"][0]


def trainjob_pod_spec(trainjob: dict) -> dict:
    """The pod spec Kubeflow Trainer makes from the TrainJob: the runtime's `node` container with
    the TrainJob's trainer fields, and the pod fields of our runtime patch."""
    (patch,) = trainjob["spec"]["runtimePatches"]
    rjobs = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    (rjob,) = [r for r in rjobs if r["name"] == KUBEFLOW_NODE]
    spec = copy.deepcopy(rjob["template"]["spec"]["template"]["spec"])
    t = trainjob["spec"]["trainer"]
    (container,) = spec["containers"]
    assert container["name"] == KUBEFLOW_NODE
    container.update(
        image=t["image"],
        command=t["command"],
        args=t.get("args", []),
        env=t.get("env", []),
        resources=t.get("resourcesPerNode", {}),
    )
    return spec


def _trainjob_pods(tj: dict, ip) -> list[Pod]:
    name, t = tj["metadata"]["name"], tj["spec"]["trainer"]
    spec = trainjob_pod_spec(tj)
    out = []
    for i in range(t["numNodes"]):
        job_name = f"{name}-{KUBEFLOW_NODE}-0"
        labels = {JOB_NAME: job_name, CONTROLLER_UID: POD_UID, JOBSET_NAME: name}
        injected = {
            "JOB_COMPLETION_INDEX": str(i),
            "PET_NNODES": str(t["numNodes"]),
            "PET_NPROC_PER_NODE": str(t.get("numProcPerNode", "auto")),
            "PET_NODE_RANK": str(i),
            "PET_MASTER_ADDR": f"{job_name}-0.{name}",
            "PET_MASTER_PORT": KUBEFLOW_MASTER_PORT,
        }
        out.append(
            Pod(
                i,
                f"{job_name}-{i}",
                name,
                labels,
                {COMPLETION_INDEX: str(i)},
                ip(i),
                spec,
                training_container(spec),
                injected,
            )
        )
    return out


def pytorchjob_env(job: dict) -> dict[str, str]:
    """The variables training-operator v1 appends to each container of a PyTorchJob's pods with no
    Master replica (setPodEnv; the defaults of pytorch_defaults.go applied first)."""
    spec = job["spec"]
    assert "Master" not in spec["pytorchReplicaSpecs"], "not simulated: a Master replica"
    out = {"PYTHONUNBUFFERED": "1"}
    policy = spec.get("elasticPolicy")
    if "nprocPerNode" in spec or not (policy and "nProcPerNode" in policy):
        out["PET_NPROC_PER_NODE"] = spec.get("nprocPerNode", "auto")
    if policy is None:
        return {**out, "PET_NNODES": str(spec["pytorchReplicaSpecs"]["Worker"]["replicas"])}
    assert "rdzvPort" in policy, "not simulated: the port from the container's pytorchjob-port"
    low = policy.get("minReplicas", policy.get("maxReplicas"))
    high = policy.get("maxReplicas", low)
    host = policy.get("rdzvHost", f"{job['metadata']['name']}-worker-0")
    out["PET_RDZV_ENDPOINT"] = f"{host}:{policy['rdzvPort']}"
    out["PET_RDZV_BACKEND"] = policy.get("rdzvBackend", "c10d")
    out["PET_NNODES"] = (
        f"{low}:{high}"
        if low is not None
        else str(spec["pytorchReplicaSpecs"]["Worker"]["replicas"])
    )
    if "maxRestarts" in policy:
        out["PET_MAX_RESTARTS"] = str(policy["maxRestarts"])
    if "nProcPerNode" in policy:
        out["PET_NPROC_PER_NODE"] = str(policy["nProcPerNode"])
    if "rdzvId" in policy:
        out["PET_RDZV_ID"] = policy["rdzvId"]
    if policy.get("rdzvConf"):
        out["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in policy["rdzvConf"])
    if policy.get("standalone"):
        out["PET_STANDALONE"] = ""
    return out


def _pytorchjob_pods(job: dict, ip) -> list[Pod]:
    name = job["metadata"]["name"]
    (rtype,) = job["spec"]["pytorchReplicaSpecs"]
    assert rtype == "Worker", "not simulated: a Master replica"
    rspec = job["spec"]["pytorchReplicaSpecs"][rtype]
    template = rspec["template"]
    out = []
    for i in range(rspec.get("replicas", 1)):
        labels = {
            **template.get("metadata", {}).get("labels", {}),
            PYTORCHJOB_OPERATOR: "pytorchjob-controller",
            PYTORCHJOB_NAME: name,
            PYTORCHJOB_TYPE: rtype.lower(),
            PYTORCHJOB_INDEX: str(i),
            **({PYTORCHJOB_ROLE: "master"} if i == 0 else {}),
        }
        spec = copy.deepcopy(template["spec"])
        policy = rspec.get("restartPolicy", "OnFailure")  # the operator's default for PyTorchJob
        spec["restartPolicy"] = "Never" if policy == "ExitCode" else policy  # core.SetRestartPolicy
        container = training_container(spec)
        out.append(
            Pod(
                i,
                f"{name}-{rtype.lower()}-{i}",
                "",
                labels,
                {},
                ip(i),
                spec,
                container,
                appended=pytorchjob_env(job),
            )
        )
    return out


def pod_spec(objs: list[dict]) -> dict:
    """The training workload's pod spec, whatever wraps it."""
    return pods(objs)[0].spec


def on_this_machine(value: str, mounts: Mapping[str, Path]) -> str:
    """A value naming paths inside the container, with each path mapped to where it lives here
    (`mounts`: container path -> local folder; the longest match wins; one pass)."""
    inside = sorted(mounts, key=len, reverse=True)
    pattern = "|".join(re.escape(p) for p in inside)
    return re.sub(rf"(?<![\w/.-])({pattern})(?=/|$|:)", lambda m: str(mounts[m.group(1)]), value)


def local_path(path: str, mounts: Mapping[str, Path]) -> Path:
    """Where a path inside the container lives on this machine (the longest mount wins)."""
    for inside, local in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
        if path == inside or path.startswith(inside.rstrip("/") + "/"):
            return Path(local) / os.path.relpath(path, inside)
    raise AssertionError(f"{path} is not on any mounted volume")
