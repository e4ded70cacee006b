"""k8s/: every overlay renders, validates offline (Kubernetes schemas; the upstream CRDs in
tests/fixtures/crds), runs restricted pods with the volumes the trainer needs, maps the trainer's exit
codes as intended, and gives trainer-launch exactly the node environment it expects.

Everything is read from the rendered manifests (tests/k8s.py), from trainer code (exit codes, the
node env contract) and from docker/Dockerfile; nothing here repeats a manifest's value."""

from __future__ import annotations

import copy
import mmap
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import dockerfile, example_ratings
from tests import k8s as kube
from tests.helpers import ROOT, env
from trainer import launch
from trainer.errors import ExitCode
from trainer.launch import Route, make_plan, nodeenv, split_command

pytestmark = [
    pytest.mark.k8s,
    pytest.mark.skipif(kube.kubectl() is None, reason="needs kubectl (its built-in kustomize)"),
]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
GPU_OVERLAYS = ("gpu", "jobset", "kubeflow", "elastic")
JOB_OVERLAYS = ("cpu-smoke", "gpu")  # a plain Indexed Job
ELASTIC = "elastic"  # a PyTorchJob with an elasticPolicy, its rendezvous in etcd
RATINGS = pytest.param(example_ratings.OVERLAY, id="ratings-example")
"""examples/ratings/k8s, an overlay of cpu-smoke outside k8s/: the checks that hold for any job."""
needs_crds = pytest.mark.skipif(
    not kube.CRDS.is_dir(), reason=f"needs the upstream CRD schemas in {kube.CRDS}"
)


def image(variant="cuda") -> dockerfile.Image:
    return dockerfile.read(DOCKERFILE, {"VARIANT": variant})


def test_every_overlay_is_here_and_renders():
    assert set(kube.OVERLAYS) == {"cpu-smoke", *GPU_OVERLAYS}
    for path in [kube.K8S / "base", *(kube.K8S / "overlays" / o for o in kube.OVERLAYS)]:
        assert kube.render(path), path


@pytest.mark.parametrize("overlay", kube.OVERLAYS)
def test_core_objects_validate_against_the_kubernetes_schemas(overlay):
    core = [o for o in kube.render(overlay) if kube.is_core(o)]
    assert {"ConfigMap", "PersistentVolumeClaim", "NetworkPolicy"} <= {o["kind"] for o in core}
    for obj in core:
        assert kube.validate_core_object(obj) is None, (obj["kind"], kube.validate_core_object(obj))


@needs_crds
@pytest.mark.parametrize("overlay", ["jobset", "kubeflow", ELASTIC])
def test_crd_objects_validate_against_the_upstream_crds(overlay):
    custom = [o for o in kube.render(overlay) if not kube.is_core(o)]
    assert len(custom) == 1
    for obj in custom:
        assert kube.crd_schema(obj) is not None, f"no CRD in {kube.CRDS} for {obj['apiVersion']}"
        assert kube.validate_crd_object(obj) == []


@needs_crds
def test_the_validators_have_teeth():
    job = kube.one(kube.render("gpu"), "Job")
    job["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFS"] = True
    assert "readOnlyRootFS" in kube.validate_core_object(job)
    jobset = kube.one(kube.render("jobset"), "JobSet")
    jobset["spec"]["network"]["enableDNSHostname"] = jobset["spec"]["network"].pop(
        "enableDNSHostnames"
    )
    assert any("enableDNSHostname" in e for e in kube.validate_crd_object(jobset))
    tj = kube.one(kube.render("kubeflow"), "TrainJob")
    tj["spec"]["trainer"]["numProcPerNode"] = str(tj["spec"]["trainer"]["numProcPerNode"])
    assert any("numProcPerNode" in e for e in kube.validate_crd_object(tj))
    pj = kube.one(kube.render(ELASTIC), "PyTorchJob")
    pj["spec"]["elasticPolicy"]["rdzvHosts"] = pj["spec"]["elasticPolicy"].pop("rdzvHost")
    assert any("rdzvHosts" in e for e in kube.validate_crd_object(pj))


# --- the pods ----------------------------------------------------------------------------------


def _mounts(spec: dict, container: dict) -> dict[str, dict]:
    volumes = {v["name"]: v for v in spec["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}


def _memory(q: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    return int(q[:-2]) * units[q[-2:]] if q[-2:] in units else int(q)


@pytest.mark.parametrize("overlay", [*kube.OVERLAYS, RATINGS])
def test_pods_meet_the_restricted_pod_security_profile(overlay):
    check_restricted(kube.render(overlay))


def check_restricted(objs: list[dict]) -> None:
    """Pod Security "restricted" for the workload's pod, every container (sidecars included), and
    for every other pod the render starts (a Deployment's: the elastic overlay's etcd, MLflow)."""
    spec = kube.pods(objs)[0].spec
    uid = int(image().user.split(":")[0])
    assert spec["securityContext"]["runAsUser"] == uid
    check_restricted_pod(spec)
    # No API token: on the pod, or (TrainJob: the runtime patch cannot say it) on its account.
    if "automountServiceAccountToken" in spec:
        assert spec["automountServiceAccountToken"] is False
    else:
        account = kube.one(objs, "ServiceAccount")
        assert spec["serviceAccountName"] == account["metadata"]["name"]
        assert account["automountServiceAccountToken"] is False
    for obj in objs:
        if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Pod"):
            other = obj["spec"] if obj["kind"] == "Pod" else obj["spec"]["template"]["spec"]
            check_restricted_pod(other)
            assert other["automountServiceAccountToken"] is False, obj["metadata"]["name"]


def check_restricted_pod(spec: dict) -> None:
    psc = spec["securityContext"]
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        assert not spec.get(key)
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0
    assert psc["seccompProfile"]["type"] == "RuntimeDefault"
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        csc = c["securityContext"]
        assert csc["allowPrivilegeEscalation"] is False and not csc.get("privileged"), c["name"]
        assert csc["capabilities"]["drop"] == ["ALL"] and not csc["capabilities"].get("add")
        assert csc["readOnlyRootFilesystem"] is True, c["name"]
        assert "runAsUser" not in csc and "runAsNonRoot" not in csc  # nothing overrides the pod's
        assert not any(p.get("hostPort") for p in c.get("ports", [])), c["name"]
    allowed = {
        "configMap",
        "emptyDir",
        "persistentVolumeClaim",
        "projected",
        "secret",
        "csi",
        "downwardAPI",
        "ephemeral",
    }
    for v in spec["volumes"]:
        assert set(v) - {"name"} <= allowed, v


@pytest.mark.parametrize("overlay", kube.OVERLAYS)
def test_every_path_the_image_writes_is_a_volume(overlay):
    """readOnlyRootFilesystem: HOME, the caches, /tmp, /dev/shm (Memory, bounded) and the runs
    volume are mounted; the config file the args name is the mounted ConfigMap."""
    objs = kube.render(overlay)
    pod = kube.pods(objs)[0]
    mounts = _mounts(pod.spec, pod.container)
    img = image()
    writable = {p for p, v in mounts.items() if "configMap" not in v}
    for path in (
        img.env["HOME"],
        img.env["XDG_CACHE_HOME"],
        img.env["TORCHINDUCTOR_CACHE_DIR"],
        img.env["TRITON_CACHE_DIR"],
        "/tmp",
    ):
        assert any(path == w or path.startswith(w + "/") for w in writable), path
    shm = mounts["/dev/shm"]["emptyDir"]
    assert shm["medium"] == "Memory" and _memory(shm["sizeLimit"]) >= 2**28
    limit = _memory(pod.container["resources"]["limits"]["memory"])
    assert limit > _memory(shm["sizeLimit"])  # shm pages count against the memory limit
    for path, volume in mounts.items():
        if "emptyDir" in volume:
            assert "sizeLimit" in volume["emptyDir"], path
    # run_dir is relative to WORKDIR: runs/ is the shared claim, and it is ReadWriteMany
    # (cpu-smoke: one test node, ReadWriteOnce, which every pod on that node can mount).
    runs = mounts[f"{img.workdir}/runs"]["persistentVolumeClaim"]["claimName"]
    claim = kube.one(objs, "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == runs
    assert claim["spec"]["accessModes"] == (
        ["ReadWriteOnce"] if overlay == "cpu-smoke" else ["ReadWriteMany"]
    )
    # --config names a file of the mounted, generated ConfigMap.
    args = pod.argv(img.entrypoint, img.cmd)
    config = Path(args[args.index("--config") + 1])
    cm = mounts[str(config.parent)]["configMap"]["name"]
    assert config.name in kube.one(objs, "ConfigMap")["data"]
    assert cm == kube.one(objs, "ConfigMap")["metadata"]["name"]


@pytest.mark.parametrize("overlay", [*kube.OVERLAYS, RATINGS])
def test_the_grace_period_covers_torchruns_shutdown_timeout(overlay):
    pod = kube.pods(kube.render(overlay))[0]
    shutdown = int(pod.env()["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
    assert shutdown >= 30 and pod.spec["terminationGracePeriodSeconds"] >= shutdown + 15


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_gpu_limit_is_one_gpu_per_process(overlay):
    pods = kube.pods(kube.render(overlay))
    for pod in pods:
        e = pod.env()
        nproc = e.get("PET_NPROC_PER_NODE") or e["NPROC_PER_NODE"]
        gpus = pod.container["resources"]["limits"]["nvidia.com/gpu"]
        assert int(nproc) == int(gpus) > 0
        assert "nvidia.com/gpu" not in pod.container["resources"].get("requests", {}) or (
            pod.container["resources"]["requests"]["nvidia.com/gpu"] == gpus
        )
    assert "nvidia.com/gpu" not in str(kube.pods(kube.render("cpu-smoke"))[0].container)


WORKLOAD_LABEL = {
    "Job": kube.JOB_NAME,
    "JobSet": kube.JOBSET_NAME,
    "TrainJob": kube.JOBSET_NAME,  # its runtime's JobSet has the TrainJob's name
    "PyTorchJob": kube.PYTORCHJOB_NAME,  # set by the operator, which creates the pods itself
}
"""The label each controller puts on the workload's pods, with the workload's name as value."""


@pytest.mark.parametrize("overlay", [*kube.OVERLAYS, RATINGS])
def test_network_policy_admits_exactly_the_jobs_own_pods_on_every_tcp_port(overlay):
    objs = kube.render(overlay)
    # The policy that guards the training pods (others guard a server the job uses: below).
    (policy,) = [
        o["spec"]
        for o in objs
        if o["kind"] == "NetworkPolicy"
        and selects(o["spec"]["podSelector"], kube.pods(objs)[0].labels)
    ]
    selector = policy["podSelector"]["matchLabels"]
    assert set(policy) == {"podSelector", "policyTypes", "ingress"}
    assert policy["policyTypes"] == ["Ingress"] and len(policy["ingress"]) == 1
    (rule,) = policy["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": selector}}]  # same namespace, same job
    assert rule["ports"] == [{"protocol": "TCP"}]  # no port: all of them (NCCL/gloo pick at random)
    # The selector names THIS workload's identity label, which its controller sets on its pods.
    workload = kube.workload(objs)
    assert selector == {WORKLOAD_LABEL[workload["kind"]]: workload["metadata"]["name"]}
    for pod in kube.pods(objs):
        assert selector.items() <= pod.labels.items()
    if workload["kind"] == "Job":  # the headless Service selects the same pods
        service = kube.one(objs, "Service")["spec"]
        assert service["selector"] == selector and service["clusterIP"] == "None"
        assert service["publishNotReadyAddresses"] is True


def port_number(port, containers: list[dict]) -> int:
    """A Service's targetPort or a NetworkPolicy's port: a number, or a container port's name."""
    if isinstance(port, int):
        return port
    (found,) = [p for c in containers for p in c.get("ports", []) if p.get("name") == port]
    return found["containerPort"]


def servers(objs: list[dict]) -> list[tuple[dict, dict, dict]]:
    """(Deployment, its Service, its NetworkPolicy) for each server the render runs beside the job
    (the elastic overlay's etcd)."""
    out = []
    for d in (o for o in objs if o["kind"] == "Deployment"):
        labels = d["spec"]["template"]["metadata"]["labels"]
        (service,) = [
            o
            for o in objs
            if o["kind"] == "Service" and selects({"matchLabels": o["spec"]["selector"]}, labels)
        ]
        (policy,) = [
            o
            for o in objs
            if o["kind"] == "NetworkPolicy" and selects(o["spec"]["podSelector"], labels)
        ]
        out.append((d, service, policy))
    return out


@pytest.mark.parametrize("overlay", kube.OVERLAYS)
def test_a_server_beside_the_job_admits_only_the_jobs_pods_on_its_service_port(overlay):
    """The elastic overlay's etcd takes writes without authentication: its policy admits the
    training pods (every one, and no other job's) on the port its Service sends to, nothing else;
    the training pods' own policy does not select it."""
    objs = kube.render(overlay)
    found = servers(objs)
    assert bool(found) == (overlay == ELASTIC)
    pods = kube.pods(objs)
    w = kube.workload(objs)
    stranger = {**pods[0].labels, WORKLOAD_LABEL[w["kind"]]: "another-job"}
    for deployment, service, policy in found:
        spec = policy["spec"]
        containers = deployment["spec"]["template"]["spec"]["containers"]
        assert set(spec) == {"podSelector", "policyTypes", "ingress"}
        assert spec["policyTypes"] == ["Ingress"]
        (rule,) = spec["ingress"]
        (peer,) = rule["from"]
        assert set(peer) == {"podSelector"}  # same namespace
        assert all(selects(peer["podSelector"], pod.labels) for pod in pods)
        assert not selects(peer["podSelector"], stranger)
        assert not selects(
            peer["podSelector"], deployment["spec"]["template"]["metadata"]["labels"]
        )
        ports = {port_number(p["port"], containers) for p in rule["ports"]}
        assert all(p["protocol"] == "TCP" for p in rule["ports"])
        assert ports == {port_number(p["targetPort"], containers) for p in service["spec"]["ports"]}


# --- exit codes -> Kubernetes' actions ---------------------------------------------------------

# What each trainer exit code should do. Indexed Job: a config error fails the Job, a signalled
# (preempted) pod is not counted, a transient failure counts (backoffLimit 0: the Job fails).
# JobSet: every failure fails the child Job, then the JobSet's rules decide.
JOB_ACTIONS = {
    ExitCode.ERROR: "Count",
    ExitCode.USAGE: "FailJob",
    ExitCode.PREEMPTED: "Ignore",
    ExitCode.RETRYABLE: "Count",
    "DisruptionTarget": "Ignore",
    137: "Count",
}
JOBSET_ACTIONS = {
    ExitCode.ERROR: "RestartJobSet",
    ExitCode.USAGE: "FailJobSet",
    ExitCode.PREEMPTED: "RestartJobSetAndIgnoreMaxRestarts",
    ExitCode.RETRYABLE: "RestartJobSet",
    "DisruptionTarget": "RestartJobSetAndIgnoreMaxRestarts",
    137: "RestartJobSet",
}


PYTORCHJOB_ACTIONS = {
    ExitCode.ERROR: "RestartInPlace",
    ExitCode.USAGE: "RestartInPlace",  # counted: fails again in seconds until backoffLimit
    ExitCode.PREEMPTED: "RestartInPlace",
    ExitCode.RETRYABLE: "RestartInPlace",
    "DisruptionTarget": "Recreate",
    137: "RestartInPlace",
}
"""The elastic PyTorchJob (restartPolicy OnFailure): the kubelet restarts a failed container in
place, counted against runPolicy.backoffLimit; an evicted, preempted or drained pod is deleted and
the operator creates its index again, not counted. Inside the pod, torchrun has already re-formed
the group MAX_RESTARTS times before its node exits."""


JOB_FAILURE_REASONS = {
    "BackoffLimitExceeded",
    "DeadlineExceeded",
    "FailedIndexes",
    "MaxFailedIndexesExceeded",
    "PodFailurePolicy",
}
"""The Job failure reasons JobSet's webhook accepts in onJobFailureReasons (validOnJobFailureReasons
in pkg/webhooks/jobset_webhook.go; not in the CRD's schema)."""


def pod_failure_action(job: dict, container: str, failure) -> tuple[str, int | None]:
    """The Job controller's podFailurePolicy: the first matching rule's action (else Count) and
    the index of that rule (pkg/controller/job/pod_failure_policy.go)."""
    for i, rule in enumerate(job.get("podFailurePolicy", {}).get("rules", [])):
        if "onExitCodes" in rule and isinstance(failure, int):
            on = rule["onExitCodes"]
            if on.get("containerName", container) != container:
                continue
            hit = failure in on["values"]
            if hit == (on["operator"] == "In"):
                return rule["action"], i
        for cond in rule.get("onPodConditions", []):
            if failure == cond["type"] and cond.get("status", "True") == "True":
                return rule["action"], i
    return "Count", None


def job_failure(job: dict, container: str, failure) -> tuple[str, str] | None:
    """(reason, message) the child Job fails with after one pod's failure, or None if it goes on.
    The message is the Job controller's own format for a FailJob rule."""
    action, index = pod_failure_action(job, container, failure)
    if action == "FailJob":
        if isinstance(failure, int):
            return (
                "PodFailurePolicy",
                f"Container {container} for pod ns/pod-0 failed with exit "
                f"code {failure} matching FailJob rule at index {index}",
            )
        return (
            "PodFailurePolicy",
            f"Pod ns/pod-0 has condition {failure} matching FailJob rule at index {index}",
        )
    if action == "Count" and job.get("backoffLimit", 6) == 0:
        return "BackoffLimitExceeded", "Job has reached the specified backoff limit"
    return None


def jobset_rule(jobset: dict, reason: str, message: str) -> dict | None:
    """The JobSet controller's failurePolicy: the first rule whose reasons hold the child Job's
    failure reason and one of whose patterns matches its message (an empty list matches anything;
    pkg/controllers/failure_policy.go, ruleIsApplicable), or None."""
    for rule in jobset["spec"].get("failurePolicy", {}).get("rules", []):
        reasons, patterns = (
            rule.get("onJobFailureReasons", []),
            rule.get("onJobFailureMessagePatterns", []),
        )
        if (not reasons or reason in reasons) and (
            not patterns or any(re.search(p, message) for p in patterns)
        ):
            return rule
    return None


def jobset_action(jobset: dict, reason: str, message: str) -> str:
    """The action JobSet takes: the matching rule's, else its default, RestartJobSet."""
    rule = jobset_rule(jobset, reason, message)
    return rule["action"] if rule else "RestartJobSet"


def pytorchjob_action(replica: dict, failure) -> str:
    """What training-operator v1 and the kubelet do when one pod's training container fails
    (pkg/controller.v1/common/pod.go, ReconcilePods; pkg/core/pod.go, SetRestartPolicy): the
    kubelet restarts it in place (OnFailure, Always), or with ExitCode the operator recreates the
    pod for a code >= 128 and fails the job for any other; Never fails the job."""
    policy = replica.get("restartPolicy", "OnFailure")
    if failure == "DisruptionTarget":  # the pod is deleted: its index is missing, and created
        return "Recreate"
    if policy in ("OnFailure", "Always"):
        return "RestartInPlace"
    if policy == "ExitCode":
        return "Recreate" if failure >= 128 else "FailJob"
    return "FailJob"


def test_every_exit_code_has_a_decided_action():
    assert set(JOB_ACTIONS) >= {c for c in ExitCode if c != ExitCode.OK}
    assert set(JOBSET_ACTIONS) >= {c for c in ExitCode if c != ExitCode.OK}
    assert set(PYTORCHJOB_ACTIONS) >= {c for c in ExitCode if c != ExitCode.OK}


def test_elastic_pytorchjob_restarts_a_failed_pod_in_place_and_counts_it():
    """OnFailure, bounded by runPolicy.backoffLimit. Not ExitCode: it would end the whole job on
    our 3 (preempted after a checkpoint) and 4 (retryable), which are below 128."""
    objs = kube.render(ELASTIC)
    job = kube.one(objs, "PyTorchJob")
    (replica,) = job["spec"]["pytorchReplicaSpecs"].values()
    assert job["spec"]["runPolicy"]["backoffLimit"] >= 1
    for failure, want in PYTORCHJOB_ACTIONS.items():
        assert pytorchjob_action(replica, failure) == want, failure
    assert kube.pods(objs)[0].spec["restartPolicy"] == "OnFailure"  # what the kubelet gets
    assert "restartPolicy" not in replica["template"]["spec"]  # the operator overwrites it
    exit_code = {**replica, "restartPolicy": "ExitCode"}
    assert pytorchjob_action(exit_code, ExitCode.PREEMPTED) == "FailJob"
    assert pytorchjob_action(exit_code, ExitCode.RETRYABLE) == "FailJob"


@pytest.mark.parametrize("overlay", [*JOB_OVERLAYS, RATINGS])
def test_indexed_job_maps_the_trainers_exit_codes(overlay):
    pod = kube.pods(kube.render(overlay))[0]
    job = kube.one(kube.render(overlay), "Job")["spec"]
    assert job["backoffLimit"] == 0 and pod.spec["restartPolicy"] == "Never"
    for failure, want in JOB_ACTIONS.items():
        assert pod_failure_action(job, pod.container["name"], failure)[0] == want, failure
    # Every rule names the training container: a sidecar's exit code must not fail the job.
    for rule in job["podFailurePolicy"]["rules"]:
        if "onExitCodes" in rule:
            assert rule["onExitCodes"]["containerName"] == pod.container["name"]


def test_jobset_restarts_the_whole_group_except_after_a_config_error():
    jobset = kube.one(kube.render("jobset"), "JobSet")
    (rjob,) = jobset["spec"]["replicatedJobs"]
    job, container = rjob["template"]["spec"], kube.pods(kube.render("jobset"))[0].container["name"]
    assert rjob["replicas"] == 1  # one Job: every pod shares its name and uid
    assert job["backoffLimit"] == 0 and jobset["spec"]["failurePolicy"]["maxRestarts"] >= 1
    for failure, want in JOBSET_ACTIONS.items():
        failed = job_failure(job, container, failure)
        assert failed is not None, f"{failure} must fail the child Job so the group restarts"
        assert jobset_action(jobset, *failed) == want, failure
    # A 2x code (20-29) is not a config error.
    assert jobset_action(jobset, *job_failure(job, container, 25)) == "RestartJobSet"


@needs_crds
def test_jobset_failure_rules_are_explicit_valid_and_each_one_is_used():
    """Every trainer failure meets a rule of its own kind (none falls through to JobSet's default),
    every rule is met by some failure, and each rule passes what the JobSet API checks: the CRD's
    schema (the action's enum), the name's pattern that the CRD states (the webhook enforces it,
    pkg/webhooks/jobset_webhook.go), unique names, reasons the webhook accepts."""
    jobset = kube.one(kube.render("jobset"), "JobSet")
    (rjob,) = jobset["spec"]["replicatedJobs"]
    job, container = rjob["template"]["spec"], kube.pods(kube.render("jobset"))[0].container["name"]
    rules = jobset["spec"]["failurePolicy"]["rules"]
    used = {}
    for failure in JOBSET_ACTIONS:
        rule = jobset_rule(jobset, *job_failure(job, container, failure))
        assert rule is not None, f"{failure}: no rule of its own, JobSet's default decides"
        used.setdefault(rule["name"], []).append(failure)
    assert set(used) == {r["name"] for r in rules}, f"rules no failure reaches: {used}"
    # The preemption rule and the transient rule are different rules, counted differently.
    preempted = jobset_rule(jobset, *job_failure(job, container, ExitCode.PREEMPTED))
    transient = jobset_rule(jobset, *job_failure(job, container, ExitCode.RETRYABLE))
    assert preempted["name"] != transient["name"]
    assert jobset_rule(jobset, *job_failure(job, container, "DisruptionTarget")) is preempted

    schema = kube.crd_schema(jobset)["properties"]["spec"]["properties"]["failurePolicy"]
    rule_schema = schema["properties"]["rules"]["items"]
    name_pattern = re.search(
        r'must match the regular expression "([^"]+)"',
        rule_schema["properties"]["name"]["description"],
    ).group(1)
    assert len({r["name"] for r in rules}) == len(rules)
    for rule in rules:
        assert re.fullmatch(name_pattern, rule["name"]) and len(rule["name"]) <= 128, rule["name"]
        assert rule["action"] in rule_schema["properties"]["action"]["enum"]
        assert set(rule.get("onJobFailureReasons", [])) <= JOB_FAILURE_REASONS, rule
        for pattern in rule.get("onJobFailureMessagePatterns", []):
            re.compile(pattern)
    assert kube.validate_crd_object(jobset) == []
    # The default stays Recreate (components/in-place-restart is the opt-in).
    assert jobset["spec"]["failurePolicy"]["restartStrategy"] == "Recreate"
    assert "Recreate" in schema["properties"]["restartStrategy"]["enum"]


# --- the environment trainer-launch gets -------------------------------------------------------


def launch_env_names() -> set[str]:
    """The variables trainer-launch documents that it reads (its --help)."""
    section = launch.USAGE.split("environment", 1)[1].split("exit codes", 1)[0]
    return set(re.findall(r"\b[A-Z][A-Z0-9_]{2,}\b", section))


@pytest.fixture(scope="module")
def torch_and_nccl_text():
    import torch

    folder = Path(torch.__file__).parent
    text = "".join(p.read_text(errors="ignore") for p in (folder / "distributed").rglob("*.py"))
    text += "".join(
        p.read_text(errors="ignore") for p in (folder / "include").rglob("ProcessGroupNCCL.hpp")
    )
    nccl = sorted(Path(sys.prefix).glob("lib/python*/site-packages/nvidia/nccl/lib/libnccl.so*"))
    return text, nccl[0] if nccl else None


@pytest.mark.parametrize("overlay", [*kube.OVERLAYS, RATINGS])
def test_every_variable_is_one_that_something_reads(overlay, torch_and_nccl_text):
    torch_text, libnccl = torch_and_nccl_text
    names = launch_env_names()
    assert {"NNODES", "MASTER_ADDR", "RDZV_JOIN_TIMEOUT", "POD_IP"} <= names  # the parse works
    for var in kube.pods(kube.render(overlay))[0].container["env"]:
        name = var["name"]
        if name in names or name == "OMP_NUM_THREADS":
            continue
        if name.startswith("TORCH_"):
            assert name in torch_text, f"{name}: torch does not read it"
        elif name.startswith("NCCL_"):
            if libnccl is None:
                continue
            with open(libnccl, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                assert m.find(name.encode() + b"\0") >= 0, f"{name}: NCCL does not read it"
        else:
            pytest.fail(
                f"{overlay}: {name} is read by nothing (trainer-launch reads {sorted(names)})"
            )


def flags(plan) -> dict[str, str]:
    out = {}
    for a in plan.argv[3:]:
        if not a.startswith("--"):
            break
        name, _, value = a[2:].partition("=")
        out[name] = value
    return out


def etcd_endpoint(objs: list[dict]) -> str:
    """HOST:PORT of the etcd the render runs: its Service's name and the port it exposes."""
    ((_, service, _),) = servers(objs)
    (port,) = service["spec"]["ports"]
    return f"{service['metadata']['name']}:{port['port']}"


@pytest.mark.parametrize("overlay", kube.OVERLAYS)
def test_each_pods_env_becomes_the_right_torchrun_command(overlay):
    """Every pod (its completion index, pod IP and labels filled in as the controllers would) gets
    the same job shape and rendezvous, rank 0 alone hosts it, at pod 0's DNS name. The elastic
    overlay's pods: MIN:MAX nodes, the rendezvous in the etcd Service of the render, hosted by no
    pod, and the PyTorchJob's name as its id."""
    img = image()
    objs = kube.render(overlay)
    pods = kube.pods(objs)
    policy = kube.workload(objs)["spec"].get("elasticPolicy")
    plans = []
    for pod in pods:
        e = pod.env()
        gpus = int(pod.container["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
        args = pod.argv(img.entrypoint, img.cmd)
        assert args[0] == "trainer-launch"
        plan = make_plan(
            e,
            split_command(args[1:], e),
            gpus=gpus,
            cpus=2,
            python="python",
            probe=lambda node, env: Route(env["POD_IP"], "eth0"),
        )
        plans.append(plan)
        f = flags(plan)
        conf = dict(kv.split("=", 1) for kv in f["rdzv-conf"].split(","))
        assert int(f["nproc-per-node"]) == (gpus or 1)
        if policy:
            assert f["nnodes"] == f"{policy['minReplicas']}:{policy['maxReplicas']}"
            assert f["rdzv-backend"] == "etcd-v2" and "is_host" not in conf
            assert f["rdzv-endpoint"] == etcd_endpoint(objs)
            assert f["rdzv-id"] == e["RDZV_ID"] == kube.workload(objs)["metadata"]["name"]
            assert conf["last_call_timeout"] == str(nodeenv.DEFAULT_LAST_CALL_S)
        else:
            assert f["nnodes"] == str(len(pods)) and f["rdzv-backend"] == "c10d"
            assert conf["is_host"] == ("1" if pod.index == 0 else "0")
            port = e.get("PET_MASTER_PORT") or e["MASTER_PORT"]
            assert f["rdzv-endpoint"] == f"{pods[0].dns_name}:{port}"
            assert f["rdzv-id"] == e["RDZV_ID"] == kube.POD_UID  # the Job's uid, not a pod's
        assert f["local-addr"] == pod.ip
        assert conf["join_timeout"] == e["RDZV_JOIN_TIMEOUT"] != str(nodeenv.DEFAULT_JOIN_TIMEOUT_S)
        assert f["max-restarts"] == (e.get("PET_MAX_RESTARTS") or e["MAX_RESTARTS"])
        tail = ("-m", "trainer", "train", *split_command([], e).trainer_args[1:], *args[1:])
        assert plan.argv[-len(tail) :] == tail  # the manifest's arguments reach every rank
        assert plan.env.get("NCCL_SOCKET_IFNAME") in (None, "eth0")  # a manifest's value wins
    assert len({flags(p)["rdzv-id"] for p in plans}) == 1
    assert len({flags(p)["rdzv-endpoint"] for p in plans}) == 1


def test_trainer_launch_dry_run_with_a_cpu_smoke_pods_env(tmp_path):
    """The real CLI, not just the pure function: pod 1 of cpu-smoke, its config file mounted."""
    objs = kube.render("cpu-smoke")
    pod = kube.pods(objs)[1]
    p = dry_run(mounted_argv(objs, pod, image("cpu"), tmp_path), pod, timeout=60)
    assert p.returncode == 0, p.stderr
    assert f"--rdzv-endpoint={kube.pods(objs)[0].dns_name}:" in p.stdout
    assert "is_host=0" in p.stdout and f"--local-addr={pod.ip}" in p.stdout
    assert "this is node 1" in p.stdout


def mounted_argv(objs: list[dict], pod: kube.Pod, img, folder: Path) -> list[str]:
    """The pod's argv with the ConfigMap's files written to `folder` and its mount path mapped
    there: what trainer-launch reads as --config inside the pod."""
    args = pod.argv(img.entrypoint, img.cmd)
    config = args[args.index("--config") + 1]
    (folder / "config").mkdir()
    for name, text in kube.one(objs, "ConfigMap")["data"].items():
        (folder / "config" / name).write_text(text)
    mounts = {str(Path(config).parent): folder / "config"}
    return [kube.on_this_machine(a, mounts) for a in args]


def dry_run(argv: list[str], pod: kube.Pod, timeout: float = 120) -> subprocess.CompletedProcess:
    """`trainer-launch --dry-run` (the pod's argv, from this venv) with the pod's environment."""
    return subprocess.run(
        [str(Path(sys.executable).parent / argv[0]), "--dry-run", *argv[1:]],
        env={**env(), **pod.env()},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_elastic_overlay_stays_elastic(tmp_path):
    """What makes the elastic overlay elastic, read from the render: a range of pods (min < max,
    the pods started within it), Worker replicas only (no Master pod for the job to depend on),
    worker-group restarts to re-form with, an etcd rendezvous at the Service the render runs, on
    the port it exposes, where etcd listens with its v2 API; and a config that every world in the
    range splits: the real `trainer-launch --dry-run` with a pod's env and the mounted config
    passes, and the same check refuses a global batch that one of those worlds cannot split."""
    from trainer.errors import ConfigError
    from trainer.launch import launcher

    objs = kube.render(ELASTIC)
    job = kube.one(objs, "PyTorchJob")
    policy = job["spec"]["elasticPolicy"]
    lo, hi = policy["minReplicas"], policy["maxReplicas"]
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Worker"}
    assert 1 <= lo < hi and lo <= job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] <= hi
    assert policy["maxRestarts"] >= 1
    assert nodeenv.RDZV_BACKENDS[policy["rdzvBackend"]] == "etcd-v2"
    # rdzvHost:rdzvPort is this render's etcd Service, and etcd serves the v2 API behind it.
    assert f"{policy['rdzvHost']}:{policy['rdzvPort']}" == etcd_endpoint(objs)
    ((etcd, service, _),) = servers(objs)
    assert etcd["spec"]["replicas"] == 1 and etcd["spec"]["strategy"]["type"] == "Recreate"
    pod_spec = etcd["spec"]["template"]["spec"]
    (container,) = pod_spec["containers"]
    defined = {v["name"]: v["value"] for v in container.get("env", [])}
    flags_ = {}
    for a in [*container.get("command", [])[1:], *container["args"]]:
        key, _, value = a.partition("=")
        flags_[key] = kube.expand(value, defined)
    assert "--enable-v2" in flags_  # torchrun's etcd-v2 rendezvous speaks only the v2 API
    (port,) = service["spec"]["ports"]
    listen = flags_["--listen-client-urls"]
    assert listen.rsplit(":", 1)[1] == str(port_number(port["targetPort"], [container]))
    assert flags_["--advertise-client-urls"] == f"http://{etcd_endpoint(objs)}"
    data = _mounts(pod_spec, container)  # the data dir is on a volume (read-only root)
    assert any(
        flags_["--data-dir"].startswith(m + "/") and "emptyDir" in v for m, v in data.items()
    )
    # Every world in MIN..MAX splits the config: the real CLI, with pod 1's env.
    pod = kube.pods(objs)[1]
    argv = mounted_argv(objs, pod, image(), tmp_path)
    p = dry_run(argv, pod)
    assert p.returncode == 0, p.stderr
    command_line = p.stdout.splitlines()[-1].split()
    for flag in (f"--nnodes={lo}:{hi}", "--rdzv-backend=etcd-v2", "--rdzv-endpoint="):
        assert any(a.startswith(flag) for a in command_line), (flag, p.stdout)
    assert f"--rdzv-endpoint={etcd_endpoint(objs)}" in command_line
    assert f"elastic: {lo} to {hi} nodes" in p.stdout
    # The check has teeth: a global batch of the smallest world does not split over the next.
    gpus = int(pod.container["resources"]["limits"]["nvidia.com/gpu"])
    e = pod.env()
    command = split_command(argv[1:], e)
    plan = make_plan(
        e,
        command,
        gpus=gpus,
        cpus=2,
        python="python",
        probe=lambda n, env: Route(env["POD_IP"], "eth0"),
    )
    assert plan.worlds == tuple(n * gpus for n in range(lo, hi + 1))
    launcher.check_elastic_worlds(
        launcher.check_trainer_config(command), plan.worlds, plan.rendezvous
    )
    bad = split_command(argv[1:], {**e, "TRAIN_ARGS": f"data.global_batch_size={plan.worlds[0]}"})
    with pytest.raises(ConfigError, match=f"world of {plan.worlds[1]} ranks"):
        launcher.check_elastic_worlds(
            launcher.check_trainer_config(bad), plan.worlds, plan.rendezvous
        )


def test_make_k8s_render_writes_every_overlay_and_k8s_apply_refuses_a_bad_overlay(tmp_path):
    p = subprocess.run(
        ["make", "-s", "k8s-render", f"K8S_OUT={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert sorted(f.stem for f in tmp_path.glob("*.yaml")) == kube.OVERLAYS
    for overlay in kube.OVERLAYS:
        import yaml

        written = [o for o in yaml.safe_load_all((tmp_path / f"{overlay}.yaml").read_text()) if o]
        assert written == kube.render(overlay)
    for bad in ("", "nope"):
        p = subprocess.run(
            ["make", "-s", "k8s-apply", f"OVERLAY={bad}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 2
        first = p.stderr.splitlines()[0]
        assert all(o in first for o in kube.OVERLAYS) and f"'{bad}'" in first


def test_the_gpu_overlay_checks_run_without_a_gpu(request):
    """The manifest checks are CPU work: the `gpu` parametrize id must not read as the gpu marker."""
    session = request.session
    gpu_overlay = [i for i in session.items if i.module is request.module and "[gpu]" in i.name]
    assert gpu_overlay, "no test here is parametrized over the gpu overlay"
    assert not any(i.get_closest_marker("skip") for i in gpu_overlay), [i.name for i in gpu_overlay]


def test_the_ratings_example_overlay_is_cpu_smoke_running_the_examples_image_and_script():
    """examples/ratings/k8s: cpu-smoke's objects and pods, valid against the Kubernetes schemas,
    with the example's image, whose own command (trainer-launch -- its train.py) every pod runs
    under torchrun across the two pods, and without the digits config or TRAIN_ARGS (which only
    `trainer train` reads)."""
    objs, smoke = kube.render(example_ratings.OVERLAY), kube.render("cpu-smoke")
    assert kube.kinds(objs) == [k for k in kube.kinds(smoke) if k != "ConfigMap"]
    for obj in objs:
        assert kube.validate_core_object(obj) is None, (obj["kind"], kube.validate_core_object(obj))
    img = example_ratings.image("cpu")
    pods, twins = kube.pods(objs), kube.pods(smoke)
    assert len(pods) == len(twins) == 2
    for pod, twin in zip(pods, twins, strict=True):
        c, t = pod.container, twin.container
        assert c["image"].startswith("trainer-ratings:") and c["image"] != t["image"]
        for key in ("resources", "securityContext", "ports", "imagePullPolicy"):
            assert c[key] == t[key], key
        assert set(pod.env()) == set(twin.env()) - {"TRAIN_ARGS"}
        assert not any("configMap" in v for v in pod.spec["volumes"])
        args = pod.argv(img.entrypoint, img.cmd)
        assert args[: 1 + len(img.cmd)] == [*img.entrypoint, *img.cmd]  # then cpu-smoke's device
        e = pod.env()
        plan = make_plan(
            e,
            split_command(args[1:], e),
            gpus=0,
            cpus=2,
            python="python",
            probe=lambda node, env: Route(env["POD_IP"], "eth0"),
        )
        f = flags(plan)
        assert f["nnodes"] == "2" and f["nproc-per-node"] == "1"
        assert f["rdzv-endpoint"] == f"{pods[0].dns_name}:{e['MASTER_PORT']}"
        assert plan.argv[-len(args[2:]) :] == tuple(args[2:])  # torchrun runs the script, as is


# --- components (k8s/components): opt-in conventions on top of the overlays --------------------

COMPONENT_OVERLAYS = {
    "kueue": ("cpu-smoke", "gpu", "jobset", "kubeflow"),
    "exclusive": ("cpu-smoke", "gpu", "jobset"),
    "in-place-restart": ("jobset",),
    "tracking": ("cpu-smoke", "gpu", "jobset", "kubeflow", ELASTIC),
    "bucket": ("cpu-smoke", "gpu", "jobset", ELASTIC),
}
"""Which overlays each component is written for (its kustomization.yaml says the same)."""
QUEUE_NAME = "kueue.x-k8s.io/queue-name"  # Kueue's label (its docs: tasks/run/jobs.md, jobsets.md)
HOSTNAME = "kubernetes.io/hostname"  # the well-known node label: one node, one domain
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
MAX_INT32 = 2**31 - 1


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    """Where the tests write a user's own kustomizations (kube.render_with)."""
    return tmp_path_factory.mktemp("user-kustomizations")


def workload(objs: list[dict]) -> dict:
    return kube.workload(objs)


def child_job(jobset: dict) -> dict:
    """The JobSet's Job template as the Job the JobSet controller creates (for the core schema)."""
    (rjob,) = jobset["spec"]["replicatedJobs"]
    name = f"{jobset['metadata']['name']}-{rjob['name']}-0"
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name}, **rjob["template"]}


def pod_template_spec(w: dict) -> dict:
    if w["kind"] == "JobSet":
        return w["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    if w["kind"] == "PyTorchJob":
        return w["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    return w["spec"]["template"]["spec"]


def validate_all(objs: list[dict]) -> None:
    """Core objects (and a JobSet's child Job) against the Kubernetes schemas, custom ones against
    the upstream CRDs; strict: unknown fields are errors."""
    for obj in objs:
        if kube.is_core(obj):
            assert kube.validate_core_object(obj) is None, (
                obj["kind"],
                kube.validate_core_object(obj),
            )
            continue
        if not kube.CRDS.is_dir():
            pytest.skip(f"needs the upstream CRD schemas in {kube.CRDS}")
        assert kube.validate_crd_object(obj) == [], obj["kind"]
        if obj["kind"] == "JobSet":
            job = child_job(obj)
            assert kube.validate_core_object(job) is None, kube.validate_core_object(job)


def test_every_component_is_listed_with_its_overlays():
    assert set(kube.COMPONENTS) == set(COMPONENT_OVERLAYS)
    for component, overlays in COMPONENT_OVERLAYS.items():
        text = (kube.COMPONENTS_DIR / component / "kustomization.yaml").read_text()
        assert "kind: Component" in text
        assert set(overlays) <= set(kube.OVERLAYS)


@pytest.mark.parametrize(
    ("component", "overlay"),
    [(c, o) for c, overlays in COMPONENT_OVERLAYS.items() for o in overlays],
)
def test_each_component_renders_on_its_overlays_and_validates(component, overlay, user_dir):
    """Rendered on top of the overlay the way a user would (a kustomization of their own), the
    objects validate, the pods stay restricted, and every pod still gets the same trainer-launch
    environment as without the component."""
    objs = kube.render_with(user_dir, overlay, [component])
    validate_all(objs)
    check_restricted(objs)
    plain = kube.pods(kube.render(overlay))
    for pod, twin in zip(kube.pods(objs), plain, strict=True):
        assert pod.env() == twin.env() and pod.container["args"] == twin.container["args"]


@pytest.mark.parametrize("overlay", COMPONENT_OVERLAYS["kueue"])
def test_kueue_labels_the_workload_and_creates_it_suspended(overlay, user_dir):
    """Kueue's conventions: the LocalQueue label on the object Kueue manages (the Job, the JobSet,
    the TrainJob; not a JobSet's child Jobs, not the pods), `spec.suspend: true`; nothing else."""
    objs, plain = kube.render_with(user_dir, overlay, ["kueue"]), kube.render(overlay)
    w = workload(objs)
    queue = w["metadata"]["labels"][QUEUE_NAME]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", queue)  # a LocalQueue's name
    assert w["spec"]["suspend"] is True
    assert str(objs).count(QUEUE_NAME) == 1  # not on child Jobs, pods or other objects
    # Nothing else changed (a JobSet's child Jobs are not suspended themselves, for one): without
    # the label and suspend, the objects are the overlay's.
    del w["metadata"]["labels"][QUEUE_NAME], w["spec"]["suspend"]
    assert objs == plain


def test_kueue_queue_name_is_changed_by_a_patch_of_ones_own(user_dir):
    """docs/kubernetes.md's way to name another LocalQueue: a patch in the user's kustomization
    (the components run before its own patches, so the patch wins)."""
    patch = "- {op: replace, path: /metadata/labels/kueue.x-k8s.io~1queue-name, value: team-a}"
    objs = kube.render_with(
        user_dir, "cpu-smoke", ["kueue"], patches=[{"target": {"kind": "Job"}, "patch": patch}]
    )
    assert workload(objs)["metadata"]["labels"][QUEUE_NAME] == "team-a"


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A metav1.LabelSelector against a pod's labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def merged_selector(term: dict, pod_labels: dict[str, str]) -> dict:
    """What the API server stores for a new pod: each matchLabelKeys key that the pod carries is
    added to the term's labelSelector as `key In (the pod's value)` (KEP-3633)."""
    selector = copy.deepcopy(term["labelSelector"])
    for key in term.get("matchLabelKeys", []):
        if key in pod_labels:
            selector.setdefault("matchExpressions", []).append(
                {"key": key, "operator": "In", "values": [pod_labels[key]]}
            )
    return selector


@pytest.mark.parametrize("overlay", COMPONENT_OVERLAYS["exclusive"])
def test_exclusive_keeps_the_jobs_pods_on_different_nodes(overlay, user_dir):
    """A required anti-affinity per hostname that each pod of the Job matches against every other
    pod of the same Job (the same controller-uid), and against no pod of another Job."""
    objs = kube.render_with(user_dir, overlay, ["exclusive"])
    w = workload(objs)
    (term,) = pod_template_spec(w)["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["topologyKey"] == HOSTNAME
    keys = {e["key"] for e in term["labelSelector"].get("matchExpressions", [])}
    keys |= set(term["labelSelector"].get("matchLabels", {}))
    assert not keys & set(term["matchLabelKeys"])  # the API server refuses a key in both
    pods = kube.pods(objs)
    assert len(pods) >= 2
    other_job = {**pods[0].labels, kube.CONTROLLER_UID: "another-uid", kube.JOB_NAME: "other"}
    for pod in pods:
        selector = merged_selector(term, pod.labels)
        assert all(selects(selector, peer.labels) for peer in pods if peer is not pod)
        assert not selects(selector, other_job)
        assert not selects(selector, {"app": "unrelated"})
    # Not JobSet's exclusive-topology annotation: it places all of a child Job's pods in ONE
    # domain (pods 1..N-1 follow pod 0: JobSet's pkg/webhooks/pod_webhook.go), and this JobSet
    # runs one Job of N pods, so per hostname every pod would be sent to pod 0's node.
    assert EXCLUSIVE_TOPOLOGY not in str(objs)
    # Nothing else changed.
    del pod_template_spec(w)["affinity"]
    assert objs == kube.render(overlay)


def container_restart(container: dict, code: int) -> str | None:
    """The kubelet's container restart rules (KEP-5307/5532): the first rule whose exit codes
    match decides; None: the container's restartPolicy does (Never: it stays terminated)."""
    for rule in container.get("restartPolicyRules", []):
        on = rule["exitCodes"]
        if (code in on["values"]) == (on["operator"] == "In"):
            return rule["action"]
    return None


@needs_crds
def test_in_place_restart_meets_jobsets_rules_and_keeps_the_exit_code_mapping(user_dir):
    """InPlaceRestart as the pinned JobSet accepts it (CRD enum; the webhook's requirements:
    backoffLimit MaxInt32, podReplacementPolicy Failed, completions == parallelism), the agent
    sidecar with its own token, and the trainer's exit codes: 2 still fails the JobSet, 3 and
    DisruptionTarget still recreate the group uncounted, anything else restarts the pod in place."""
    objs = kube.render_with(user_dir, "jobset", ["in-place-restart"])
    jobset = kube.one(objs, "JobSet")
    policy = jobset["spec"]["failurePolicy"]
    schema = kube.crd_schema(jobset)["properties"]["spec"]["properties"]["failurePolicy"]
    assert policy["restartStrategy"] == "InPlaceRestart"
    assert "InPlaceRestart" in schema["properties"]["restartStrategy"]["enum"]
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["backoffLimit"] == MAX_INT32 and job["podReplacementPolicy"] == "Failed"
    assert job["completions"] == job["parallelism"]
    spec = pod_template_spec(jobset)
    (agent,) = spec["initContainers"]
    trainer = kube.training_container(spec)
    assert agent["restartPolicy"] == "Always"  # a sidecar
    assert container_restart(agent, 1) == "RestartAllContainers"
    assert "startupProbe" in agent  # the barrier the trainer waits behind
    # The API token reaches the agent only, through its account, which may do what it needs.
    volumes = {v["name"]: v for v in spec["volumes"]}
    token = {m["name"] for m in agent["volumeMounts"]}
    assert any(
        "serviceAccountToken" in s for v in token for s in volumes[v]["projected"]["sources"]
    )
    assert not token & {m["name"] for m in trainer["volumeMounts"]}
    assert spec["automountServiceAccountToken"] is False
    account = kube.one(objs, "ServiceAccount")["metadata"]["name"]
    assert spec["serviceAccountName"] == account
    binding, role = kube.one(objs, "RoleBinding"), kube.one(objs, "Role")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    grants = {
        (g, r, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert {("", "pods", "patch"), ("jobset.x-k8s.io", "jobsets", "watch")} <= grants
    # Exit codes: what the kubelet does first, then (if the pod fails) the Job's and JobSet's rules.
    assert trainer["restartPolicy"] == "Never"
    for code in (ExitCode.USAGE, ExitCode.PREEMPTED):
        assert container_restart(trainer, code) is None, code  # the pod fails: the rules decide
        assert (
            jobset_action(jobset, *job_failure(job, trainer["name"], code)) == JOBSET_ACTIONS[code]
        )
    assert (
        jobset_action(jobset, *job_failure(job, trainer["name"], "DisruptionTarget"))
        == (JOBSET_ACTIONS["DisruptionTarget"])
    )
    for code in (ExitCode.ERROR, ExitCode.RETRYABLE, 137):
        assert container_restart(trainer, code) == "RestartAllContainers", code
    assert container_restart(trainer, ExitCode.OK) is None


def test_all_components_compose_on_the_jobset_overlay(user_dir):
    objs = kube.render_with(user_dir, "jobset", kube.COMPONENTS)
    validate_all(objs)
    check_restricted(objs)
    jobset = kube.one(objs, "JobSet")
    assert jobset["spec"]["suspend"] is True and QUEUE_NAME in jobset["metadata"]["labels"]
    assert jobset["spec"]["failurePolicy"]["restartStrategy"] == "InPlaceRestart"
    assert pod_template_spec(jobset)["affinity"]["podAntiAffinity"]


@pytest.mark.parametrize("overlay", COMPONENT_OVERLAYS["bucket"])
def test_bucket_replaces_the_shared_claim_with_a_secret_and_room_for_a_local_copy(
    overlay, user_dir
):
    """docs/kubernetes.md, "No shared disk": no runs claim (no RWX storage needed), each pod's
    run folder its own volume, /tmp big enough for a checkpoint's local copy, the keys from the
    trainer-s3 Secret into the environment (never a literal value in the manifests)."""
    objs = kube.render_with(user_dir, overlay, ["bucket"])
    assert [o for o in objs if o["kind"] == "PersistentVolumeClaim"] == []
    for pod in kube.pods(objs):
        volumes = {v["name"]: v for v in pod.spec["volumes"]}
        assert set(volumes["runs"]) == {"name", "emptyDir"}
        assert _memory(volumes["tmp"]["emptyDir"]["sizeLimit"]) >= 50 * 2**30
        assert pod.container["envFrom"] == [{"secretRef": {"name": "trainer-s3"}}]
        assert not any(v["name"].startswith("AWS_") for v in pod.container["env"])
    text = (kube.COMPONENTS_DIR / "bucket" / "kustomization.yaml").read_text()
    assert "kubectl create secret generic trainer-s3" in text
