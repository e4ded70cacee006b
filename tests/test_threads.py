"""Threads per rank from the CPUs a container may use: fake cgroup trees as Docker and Kubernetes
lay them out, and trainer-launch's plan carrying the result."""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers import BIN, env
from trainer.errors import UsageError
from trainer.launch import Command, make_plan
from trainer.launch.threads import available_cpus, cgroup_cpu_quota, threads_per_rank


def tree(root, files: dict[str, str], self_cgroup: str):
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text + "\n")
    proc = root.parent / "proc-self-cgroup"
    proc.write_text(self_cgroup)
    return root, proc


@pytest.mark.parametrize(
    "cpus, ranks, want",
    [(2, 1, 2), (2, 2, 1), (16, 8, 2), (16, 3, 5), (1, 4, 1), (96, 8, 12), (4, 0, 4)],
)
def test_threads_are_the_cpus_shared_by_the_local_ranks_at_least_one(cpus, ranks, want):
    assert threads_per_rank({}, cpus, ranks) == want


def test_a_users_omp_num_threads_is_left_alone():
    assert threads_per_rank({"OMP_NUM_THREADS": "3"}, 16, 2) is None
    assert threads_per_rank({"OMP_NUM_THREADS": " "}, 16, 2) == 8  # empty counts as unset


@pytest.mark.parametrize("raw", ["two", "0", "-1", "1.5"])
def test_a_bad_omp_num_threads_is_a_usage_error_naming_it(raw):
    with pytest.raises(UsageError, match=r"^OMP_NUM_THREADS="):
        threads_per_rank({"OMP_NUM_THREADS": raw}, 16, 2)


def test_cgroup_v2_namespaced_container_reads_cpu_max_at_the_root(tmp_path):
    # docker --cpus=1.5 with a private cgroup namespace: the container's cgroup is the mount root
    root, proc = tree(tmp_path / "cg", {"cpu.max": "150000 100000"}, "0::/\n")
    assert cgroup_cpu_quota(root, proc) == 1.5
    assert available_cpus(root, proc, affinity=8) == 1  # floor: 1.5 CPUs cannot run 2 threads
    assert available_cpus(root, proc, affinity=1) == 1


def test_cgroup_v2_takes_the_tightest_of_the_cgroup_and_its_parents(tmp_path):
    # a Kubernetes pod limit (parent, 2 CPUs) over a container without one of its own
    files = {
        "kubepods/pod1/cpu.max": "200000 100000",
        "kubepods/pod1/ctr/cpu.max": "max 100000",
        "kubepods/cpu.max": "max 100000",
    }
    root, proc = tree(tmp_path / "cg", files, "0::/kubepods/pod1/ctr\n")
    assert cgroup_cpu_quota(root, proc) == 2.0
    assert available_cpus(root, proc, affinity=64) == 2


def test_cgroup_v2_without_a_limit_leaves_the_affinity(tmp_path):
    root, proc = tree(tmp_path / "cg", {"cpu.max": "max 100000"}, "0::/\n")
    assert cgroup_cpu_quota(root, proc) is None
    assert available_cpus(root, proc, affinity=6) == 6


def test_cgroup_v1_docker_mounts_the_containers_cgroup_at_the_controller_root(tmp_path):
    # Docker on cgroup v1 (this CI machine's engine): /proc/self/cgroup names the host's path,
    # /sys/fs/cgroup/cpu shows the container's own cgroup; `cpus: 1` is a 100000/100000 quota
    files = {"cpu/cpu.cfs_quota_us": "100000", "cpu/cpu.cfs_period_us": "100000"}
    self_cgroup = "12:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n"
    root, proc = tree(tmp_path / "cg", files, self_cgroup)
    assert cgroup_cpu_quota(root, proc) == 1.0
    assert available_cpus(root, proc, affinity=2) == 1


def test_cgroup_v1_host_view_and_no_quota(tmp_path):
    files = {
        "cpu,cpuacct/cpu.cfs_quota_us": "-1",
        "cpu,cpuacct/cpu.cfs_period_us": "100000",
        "cpu,cpuacct/batch/job/cpu.cfs_quota_us": "300000",
        "cpu,cpuacct/batch/job/cpu.cfs_period_us": "100000",
    }
    root, proc = tree(tmp_path / "cg", files, "4:cpu,cpuacct:/batch/job\n0::/\n")
    assert cgroup_cpu_quota(root, proc) == 3.0
    (root / "cpu,cpuacct/batch/job/cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(root, proc) is None


def test_no_cgroup_files_at_all(tmp_path):
    assert cgroup_cpu_quota(tmp_path / "none", tmp_path / "missing") is None
    assert available_cpus(tmp_path / "none", tmp_path / "missing", affinity=3) == 3
    assert available_cpus(tmp_path / "none", tmp_path / "missing") >= 1  # this machine's


def test_garbage_in_cgroup_files_is_no_limit(tmp_path):
    root, proc = tree(tmp_path / "cg", {"cpu.max": "lots 100000"}, "0::/\n")
    assert cgroup_cpu_quota(root, proc) is None


# --- in trainer-launch's plan ------------------------------------------------------------------


TWO_NODE = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "node0", "NPROC_PER_NODE": "1"}


@pytest.mark.parametrize(
    "environ, cpus, want",
    [
        ({"NPROC_PER_NODE": "1"}, 2, "2"),
        ({"NPROC_PER_NODE": "2"}, 2, "1"),
        ({"NPROC_PER_NODE": "4"}, 16, "4"),
        (TWO_NODE, 1, "1"),  # compose's two-node profile: `cpus: 1` per container
        ({**TWO_NODE, "OMP_NUM_THREADS": "7"}, 1, None),  # the user's value: not in the plan
    ],
)
def test_the_plan_sets_threads_per_rank_for_any_nproc(environ, cpus, want):
    p = make_plan(environ, Command(trainer_args=("train",)), gpus=0, cpus=cpus, python="python")
    assert p.env.get("OMP_NUM_THREADS") == want


def test_dry_run_shows_the_threads_from_this_machines_cpus():
    e = env(NPROC_PER_NODE="1")
    e.pop("OMP_NUM_THREADS")
    p = subprocess.run(
        [str(BIN / "trainer-launch"), "--dry-run"], env=e, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr
    assert f"OMP_NUM_THREADS={available_cpus()}" in p.stdout
    e["OMP_NUM_THREADS"] = "3"
    p = subprocess.run(
        [str(BIN / "trainer-launch"), "--dry-run"], env=e, capture_output=True, text=True
    )
    assert "OMP_NUM_THREADS" not in p.stdout  # inherited as is, not overridden
    e["OMP_NUM_THREADS"] = "many"
    p = subprocess.run(
        [str(BIN / "trainer-launch"), "--dry-run"], env=e, capture_output=True, text=True
    )
    assert p.returncode == 2 and p.stderr.startswith("trainer-launch: error: OMP_NUM_THREADS=")
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
