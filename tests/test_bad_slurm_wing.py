"""Bad Slurm variables through `trainer-launch --dry-run` (issue 55 item 4, issue 56 item 2).

A table of cases generated per sub-area, run by tests/badwing.py's harness in this process:

- every SLURM_* number trainer-launch reads x bad forms (empty, negative, other scripts' digits,
  a fraction, garbage, larger than Slurm's 32 bits, zero where a count must be >= 1);
- variables that contradict each other (a rank of 7 in 4 tasks, a local index past this node's
  tasks, fewer tasks than nodes, a node index past the nodes, node lists and task spreads that do
  not match the counts): each line names the SLURM_* variables, never only our NNODES/RANK;
- scontrol missing, failing, not executable, printing nothing or an address that does not
  resolve: one line saying so and that MASTER_ADDR is the way around it; with MASTER_ADDR set,
  scontrol is never run and the same steps plan;
- valid steps (uneven task spreads, `srun -E`, a 1-node step of a 4-node job, two-dimensional
  node lists, more processes than CPUs with a warning) still plan: `runs=` cases, and unit tests
  below check the printed plan.
"""

from __future__ import annotations

import os

import pytest

from tests.badwing import WingCase, check, good_run
from tests.test_bad_input import run_in_process
from trainer import launch
from trainer.errors import UsageError
from trainer.launch import slurm

ARGV = ("--dry-run", "dist.device=cpu", "data.global_batch_size=24")
"""trainer-launch --dry-run of the default config on CPU; 24 splits over 1-4 and 8 ranks."""

PER_NODE = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_RESTART_COUNT": "0",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_NTASKS": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_CPUS_PER_TASK": "2",
    "SLURM_CPUS_ON_NODE": "2",
    "SLURM_GPUS_ON_NODE": "0",
    "MASTER_ADDR": "127.0.0.1",
}
"""`srun --ntasks-per-node=1` on 2 nodes, node 1 (MASTER_ADDR given: no scontrol needed)."""

PER_TASK = {
    **PER_NODE,
    "SLURM_JOB_NUM_NODES": "1",
    "SLURM_NNODES": "1",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_TASKS_PER_NODE": "4",
    "SLURM_STEP_TASKS_PER_NODE": "4",
    "SLURM_NODEID": "0",
    "SLURM_PROCID": "2",
    "SLURM_LOCALID": "2",
    "SLURM_JOB_NODELIST": "gpu07",
    "SLURM_STEP_NODELIST": "gpu07",
    "SLURM_CPUS_ON_NODE": "8",
}
"""`srun --ntasks-per-node=4` on 1 node: task 2, one rank without torchrun."""

NUMBERS = {
    # variable: (the step it is read in, the smallest valid value)
    "SLURM_JOB_ID": (PER_NODE, 0),
    "SLURM_STEP_ID": (PER_NODE, 0),
    "SLURM_RESTART_COUNT": (PER_NODE, 0),
    "SLURM_JOB_NUM_NODES": (PER_NODE, 1),
    "SLURM_NNODES": (PER_NODE, 1),
    "SLURM_STEP_NUM_NODES": (PER_NODE, 1),
    "SLURM_NTASKS": (PER_TASK, 1),
    "SLURM_STEP_NUM_TASKS": (PER_TASK, 1),
    "SLURM_NODEID": (PER_NODE, 0),
    "SLURM_PROCID": (PER_TASK, 0),
    "SLURM_LOCALID": (PER_TASK, 0),
    "SLURM_CPUS_PER_TASK": (PER_NODE, 1),
    "SLURM_CPUS_ON_NODE": (PER_TASK, 1),
    "SLURM_GPUS_ON_NODE": (PER_TASK, 0),
}
"""Every SLURM_* number trainer-launch reads."""

BAD_NUMBERS = (
    "",  # set but empty: `export SLURM_NODEID=$UNSET`
    " ",
    "-1",
    "²",  # superscript two: int() refuses it, str.isdigit() does not
    "٣",  # Arabic-Indic three: int() takes it as 3
    "1.5",
    "1e3",
    "0x10",
    "1_000",
    "abc",
    "2 3",
    "99999999999",  # beyond Slurm's 32 bits
    "9" * 5000,  # beyond Python's int() digit limit
)

SPREADS = ("", "two", "0(x2)", "1(x0)", "2(x2", "٣", "1(x2),", "-1(x2)", "1(x99999999999)")
"""Bad SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE values (Slurm's format: 2(x3),1)."""


def _step(base: dict[str, str], **changes: str | None) -> tuple[tuple[str, str], ...]:
    """A case's environment: base with changes; a None value leaves the variable out."""
    env = {**base, **changes}
    return tuple((k, v) for k, v in env.items() if v is not None)


def number_cases() -> list[WingCase]:
    cases = []
    for var, (base, lo) in NUMBERS.items():
        bad = [v for v in BAD_NUMBERS if not (v.strip() == "" and var in ("SLURM_JOB_ID",))]
        if var == "SLURM_STEP_ID":  # empty: the batch script, not a step (below)
            bad = [v for v in bad if v.strip()]
        if lo == 1:
            bad.append("0")
        for value in bad:
            env = _step(base, **{var: value})
            cases.append(WingCase("slurm numbers", ARGV, var, env=env, launch=True))
    return cases


CONTRADICTIONS = [
    # (the step, changes, what the line must name)
    (PER_TASK, {"SLURM_PROCID": "7"}, "SLURM_PROCID=7 but SLURM_STEP_NUM_TASKS=4"),
    (PER_TASK, {"SLURM_PROCID": "4"}, "SLURM_PROCID=4 but SLURM_STEP_NUM_TASKS=4"),
    (PER_TASK, {"SLURM_LOCALID": "4"}, "SLURM_LOCALID=4"),
    (PER_TASK, {"SLURM_LOCALID": "6", "SLURM_PROCID": "1"}, "SLURM_STEP_TASKS_PER_NODE=4"),
    (PER_NODE, {"SLURM_LOCALID": "1"}, "SLURM_LOCALID=1"),
    (PER_NODE, {"SLURM_PROCID": "2"}, "SLURM_PROCID=2 but SLURM_STEP_NUM_TASKS=2"),
    (PER_NODE, {"SLURM_STEP_NUM_TASKS": "1"}, "SLURM_STEP_NUM_TASKS=1 but SLURM_STEP_NUM_NODES=2"),
    (
        PER_NODE,
        {"SLURM_STEP_NUM_TASKS": None, "SLURM_NTASKS": "1"},
        "SLURM_NTASKS=1 but SLURM_STEP_NUM_NODES=2",
    ),
    (PER_NODE, {"SLURM_NODEID": "5"}, "SLURM_NODEID=5 but SLURM_STEP_NUM_NODES=2"),
    (PER_NODE, {"SLURM_NODEID": "2"}, "SLURM_NODEID=2"),
    (PER_NODE, {"SLURM_STEP_NUM_NODES": "3"}, "SLURM_JOB_NUM_NODES=2"),
    (PER_NODE, {"SLURM_STEP_NUM_NODES": "3", "SLURM_JOB_NUM_NODES": "3"}, "SLURM_NNODES=2"),
    (PER_NODE, {"SLURM_STEP_NODELIST": "gpu07"}, "SLURM_STEP_NODELIST"),
    (PER_NODE, {"SLURM_STEP_NODELIST": "gpu[07-09]"}, "SLURM_STEP_NODELIST"),
    (PER_NODE, {"SLURM_JOB_NODELIST": "gpu[01-09999999999]"}, "SLURM_JOB_NODELIST"),
    (PER_NODE, {"SLURM_STEP_TASKS_PER_NODE": "1(x3)"}, "SLURM_STEP_TASKS_PER_NODE"),
    (PER_NODE, {"SLURM_STEP_TASKS_PER_NODE": "2(x2)"}, "SLURM_STEP_TASKS_PER_NODE"),
    (PER_NODE, {"SLURM_STEP_TASKS_PER_NODE": "1(x9999999999)"}, "SLURM_STEP_TASKS_PER_NODE"),
    (PER_TASK, {"SLURM_STEP_TASKS_PER_NODE": "3"}, "SLURM_STEP_TASKS_PER_NODE"),
    (
        PER_NODE,
        {"SLURM_STEP_TASKS_PER_NODE": None, "SLURM_TASKS_PER_NODE": "2"},
        "SLURM_TASKS_PER_NODE",
    ),
    (
        PER_NODE,
        {
            "SLURM_STEP_TASKS_PER_NODE": None,
            "SLURM_TASKS_PER_NODE": None,
            "SLURM_STEP_NUM_TASKS": "3",
        },
        "SLURM_STEP_NUM_TASKS=3",
    ),
    (
        PER_NODE,
        {"SLURM_STEP_NUM_NODES": "10000", "SLURM_JOB_NUM_NODES": "10000"},
        "SLURM_STEP_NUM_NODES",
    ),
    (PER_NODE, {"NNODES": "3"}, "SLURM_STEP_NUM_NODES=2"),
    (PER_NODE, {"NODE_RANK": "0"}, "SLURM_NODEID=1"),
    (PER_NODE, {"SLURM_STEP_ID": None}, "srun"),  # a 2-node job's batch script, without srun
    (PER_TASK, {"NPROC_PER_NODE": "4"}, "NPROC_PER_NODE"),
]
"""Slurm variables that disagree with each other (or with ours): one line naming them."""


def contradiction_cases() -> list[WingCase]:
    cases = [
        WingCase("slurm contradictions", ARGV, names, env=_step(base, **changes), launch=True)
        for base, changes, names in CONTRADICTIONS
    ]
    for value in SPREADS:  # the step's spread; SLURM_TASKS_PER_NODE is read only without it
        step = {"SLURM_STEP_TASKS_PER_NODE": value, "SLURM_TASKS_PER_NODE": "1(x2)"}
        job = {"SLURM_STEP_TASKS_PER_NODE": None, "SLURM_TASKS_PER_NODE": value}
        for changes in (step, job):
            var = next(k for k, v in changes.items() if v == value)
            env = _step(PER_NODE, **changes)
            cases.append(WingCase("slurm spreads", ARGV, var, env=env, launch=True))
    return cases


RUNS = [
    (PER_NODE, {}, "one task per node, node 1 of 2, MASTER_ADDR given"),
    (PER_NODE, {"SLURM_NODEID": "0", "SLURM_PROCID": "0"}, "node 0 of 2"),
    (PER_TASK, {}, "one task per process, rank 2 of 4"),
    (PER_TASK, {"SLURM_PROCID": "3", "SLURM_LOCALID": "3"}, "the last task of 4"),
    (
        PER_TASK,
        {
            "SLURM_STEP_NUM_NODES": "2",
            "SLURM_JOB_NUM_NODES": "2",
            "SLURM_NNODES": "2",
            "SLURM_NODEID": "1",
            "SLURM_STEP_NUM_TASKS": "3",
            "SLURM_NTASKS": "3",
            "SLURM_STEP_TASKS_PER_NODE": "2,1",
            "SLURM_TASKS_PER_NODE": "2,1",
            "SLURM_PROCID": "2",
            "SLURM_LOCALID": "0",
            "SLURM_STEP_NODELIST": "gpu[07-08]",
            "SLURM_JOB_NODELIST": "gpu[07-08]",
        },
        "an uneven spread (2,1): the second node's one task",
    ),
    (
        PER_NODE,
        {"SLURM_NNODES": "4", "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "1(x4)"}
        | {"SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "gpu[07-10]"},
        "srun -E in a 4-node job: SLURM_NNODES/NTASKS keep the job's counts",
    ),
    (
        PER_TASK,
        {"SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "gpu[01-04]"}
        | {"SLURM_STEP_NODELIST": "gpu03", "SLURM_NNODES": "1"},
        "a one-node srun inside a 4-node job",
    ),
    (
        PER_NODE,
        {"SLURM_STEP_NUM_NODES": "4", "SLURM_JOB_NUM_NODES": "4", "SLURM_NNODES": "4"}
        | {"SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "1(x4)"}
        | {"SLURM_TASKS_PER_NODE": "1(x4)", "SLURM_STEP_NODELIST": "rack[1-2]-n[01,03]"}
        | {"SLURM_JOB_NODELIST": "rack[1-2]-n[01,03]", "SLURM_NODEID": "3", "SLURM_PROCID": "3"},
        "a two-dimensional node list (4 nodes)",
    ),
    (PER_NODE, {"SLURM_NODEID": " 1 ", "SLURM_CPUS_PER_TASK": "08"}, "spaces, leading zero"),
    (PER_NODE, {"NPROC_PER_NODE": "4"}, "4 processes in a task of 2 CPUs: a warning, not an error"),
    (PER_NODE, {"SLURM_JOB_ID": ""}, "SLURM_JOB_ID empty: not in a Slurm job, an ordinary node"),
    (
        PER_NODE,
        {"SLURM_STEP_ID": "", "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1"},
        "a one-node job's batch script",
    ),
    (PER_NODE, {"SLURM_GPUS_PER_NODE": "a100:2"}, "SLURM_GPUS_PER_NODE: not read"),
]
"""Valid steps that must still plan (exit 0)."""


def runs_cases() -> list[WingCase]:
    return [
        WingCase("slurm valid", ARGV, "", env=_step(base, **changes), launch=True, runs=why)
        for base, changes, why in RUNS
    ]


# --- scontrol: asked for the first node only without MASTER_ADDR --------------------------------

SCONTROLS = {
    "ok": 'if [ "$2" = hostnames ]; then echo gpu07; echo gpu08; '
    'else echo "NodeName=gpu07 NodeAddr=127.0.0.1 State=IDLE"; fi',
    "failing": 'echo "scontrol: error: Invalid node name specified" >&2; exit 1',
    "silent": "exit 0",
    "unresolvable": 'if [ "$2" = hostnames ]; then echo nx-gpu07.invalid; '
    'else echo "NodeName=nx-gpu07.invalid NodeAddr=nx-gpu07.invalid"; fi',
    "garbage": "if [ \"$2\" = hostnames ]; then echo gpu07; else printf 'NodeAddr=\\377\\376x\\n'; fi",
    "not executable": None,
    "missing": None,
}
"""A fake scontrol per behaviour, each alone on PATH ("missing": a folder without one)."""

SCONTROL_NAMES = {
    "failing": "scontrol show hostnames",
    "silent": "names no node",
    "unresolvable": "does not resolve here",
    "garbage": "does not resolve here",
    "not executable": "cannot run `scontrol",
    "missing": "cannot run `scontrol",
}


@pytest.fixture(scope="module")
def fake_scontrols(tmp_path_factory) -> dict[str, str]:
    """behaviour -> a folder to use as PATH."""
    root = tmp_path_factory.mktemp("scontrol")
    out = {}
    for name, body in SCONTROLS.items():
        folder = root / name.replace(" ", "-")
        folder.mkdir()
        if name != "missing":
            script = folder / "scontrol"
            script.write_text(f"#!/bin/sh\n{body or 'exit 0'}\n")
            mode = 0o644 if name == "not executable" else 0o755
            script.chmod(mode)
        out[name] = str(folder)
    return out


TWO_NODES = {
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
}
TWO_NODE_STEPS = (
    {**PER_NODE, **TWO_NODES},
    {**PER_TASK, **TWO_NODES, "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_LOCALID": "0"}
    | {"SLURM_TASKS_PER_NODE": "2(x2)"},
)
"""The two layouts on two nodes: the rendezvous host is the first node, found by scontrol."""


def scontrol_cases(paths: dict[str, str]) -> list[WingCase]:
    cases = []
    for name, folder in paths.items():
        for base in TWO_NODE_STEPS:
            given = _step(base, PATH=folder)
            why = f"MASTER_ADDR set: the {name} scontrol is never run"
            cases.append(WingCase("slurm scontrol", ARGV, "", env=given, launch=True, runs=why))
            asked = _step(base, PATH=folder, MASTER_ADDR=None)
            if name == "ok":
                why = "scontrol names the first node and its NodeAddr"
                case = WingCase("slurm scontrol", ARGV, "", env=asked, launch=True, runs=why)
            else:
                case = WingCase(
                    "slurm scontrol", ARGV, SCONTROL_NAMES[name], env=asked, launch=True
                )
            cases.append(case)
    return cases


# --- the tests -----------------------------------------------------------------------------------


@pytest.fixture
def slurm_env(monkeypatch, tmp_path):
    """No SLURM_*, torchrun, node-contract or thread variables from the test runner; no GPU."""
    from trainer.exitstatus import STATUS_DIR_ENV
    from trainer.ranks import TORCHRUN_VARS

    prefixes = ("SLURM_", "PET_", "RDZV_")
    names = (
        *TORCHRUN_VARS,
        STATUS_DIR_ENV,
        "NNODES",
        "NODE_RANK",
        "NPROC_PER_NODE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "JOB_COMPLETION_INDEX",
        "JOBSET_NAME",
        "JOB_NAME",
        "POD_IP",
        "OMP_NUM_THREADS",
        "TRAIN_ARGS",
        "MAX_RESTARTS",
        "GLOO_SOCKET_IFNAME",
        "NCCL_SOCKET_IFNAME",
    )
    for name in list(os.environ):
        if name.startswith(prefixes) or name in names:
            monkeypatch.delenv(name)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_bad_slurm_variables_are_one_line_each(slurm_env, fake_scontrols, tmp_path_factory):
    cases = [
        *number_cases(),
        *contradiction_cases(),
        *runs_cases(),
        *scontrol_cases(fake_scontrols),
    ]
    assert len(cases) >= 40
    check(cases, good_run(tmp_path_factory))


def test_the_table_covers_every_slurm_number_trainer_launch_reads():
    """Every SLURM_* variable trainer/launch/slurm.py names is in a table: NUMBERS, or the node
    lists and task spreads (CONTRADICTIONS, SPREADS)."""
    import re
    from pathlib import Path

    source = Path(slurm.__file__).read_text()
    named = set(re.findall(r'"(SLURM_[A-Z_]+)"', source))
    lists = {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}
    spreads = {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}
    assert named == set(NUMBERS) | lists | spreads, named ^ (set(NUMBERS) | lists | spreads)


# --- unit tests: the plan printed for valid steps, the node lists, the warning -------------------


def _dry_run(env: dict[str, str]):
    for k, v in env.items():
        os.environ[k] = v
    try:
        return run_in_process(ARGV, main=launch.main)
    finally:
        for k in env:
            os.environ.pop(k, None)


def test_valid_steps_print_the_plan_slurm_says(slurm_env):
    uneven = dict(RUNS[4][1])
    o = _dry_run({**PER_TASK, **uneven})
    assert o.code == 0, o.stderr
    assert "one task per process, rank 2 of 3 (no torchrun)" in o.stdout
    for part in ("RANK=2", "WORLD_SIZE=3", "LOCAL_RANK=0", "LOCAL_WORLD_SIZE=1"):
        assert f" {part} " in o.stdout, o.stdout
    o = _dry_run(dict(PER_NODE))
    assert o.code == 0, o.stderr
    assert "node 1 of 2, rendezvous on gpu07 (127.0.0.1):19242" in o.stdout
    assert "--nnodes=2 --nproc-per-node=1" in o.stdout and "warning" not in o.stderr
    o = _dry_run({**PER_NODE, "NPROC_PER_NODE": "4"})
    assert o.code == 0 and "--nproc-per-node=4" in o.stdout
    assert o.stderr.strip() == (
        "trainer-launch: warning: NPROC_PER_NODE=4 starts 4 processes in a task of "
        "SLURM_CPUS_PER_TASK=2 CPU(s): they will share them, one thread each; ask for "
        "--cpus-per-task=4 or more (sbatch/srun), or lower NPROC_PER_NODE"
    )


def test_master_addr_means_scontrol_is_never_asked():
    def never(_):
        raise AssertionError("scontrol asked though MASTER_ADDR is set")

    env = dict(PER_NODE, MASTER_ADDR="10.0.0.9", SLURM_NODEID="0", SLURM_PROCID="0")
    job = slurm.read_slurm(env, gpus=0, first_node=never)
    assert job is not None and job.first_node == "gpu07" and job.hosts_store
    assert "MASTER_ADDR" not in job.env and "rendezvous on gpu07 (10.0.0.9):19242" in job.summary
    per_task = dict(PER_TASK, SLURM_STEP_NUM_NODES="2", SLURM_JOB_NUM_NODES="2")
    per_task |= {"SLURM_NNODES": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_LOCALID": "0"}
    per_task |= {"SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    job = slurm.read_slurm({**per_task, "MASTER_ADDR": "head"}, gpus=0, first_node=never)
    assert job.env["MASTER_ADDR"] == "head" and job.first_node == "gpu07"


@pytest.mark.parametrize(
    "nodelist, count, first",
    [
        ("gpu07", 1, "gpu07"),
        ("gpu[07-08]", 2, "gpu07"),
        ("gpu[07-08,10],cpu01", 4, "gpu07"),
        ("rack[1-2]-n[01,03-04]", 6, "rack1-n01"),
        ("n[001-100]", 100, "n001"),
        ("a,b,c", 3, "a"),
        ("gpu[08-07]", None, None),  # not Slurm's syntax: scontrol has the last word
        ("gpu[07-08", None, None),
        ("gpu07]", None, None),
        ("a,,b", None, None),
        ("gpu[x]", None, None),
        ("gpu 07", None, None),
        ("", None, None),
    ],
)
def test_node_lists_are_counted_without_scontrol(nodelist, count, first):
    assert slurm.hostlist_count(nodelist) == count
    assert slurm.first_host(nodelist) == first


def test_scontrol_trouble_names_master_addr_as_the_way_around():
    import subprocess

    def missing(argv, **_):
        raise FileNotFoundError(2, "No such file or directory", "scontrol")

    def failing(argv, **_):
        return subprocess.CompletedProcess(argv, 1, "", "scontrol: error: no config")

    def stuck(argv, **kw):
        raise subprocess.TimeoutExpired(argv, kw["timeout"])

    for run, says in ((missing, "cannot run"), (failing, "failed"), (stuck, "timed out")):
        with pytest.raises(UsageError) as e:
            slurm.first_node("gpu[07-08]", run=run)
        line = str(e.value)
        assert says in line and "set MASTER_ADDR" in line and "\n" not in line, line


def test_every_number_error_names_its_variable_and_says_why():
    for value, says in (
        ("", "is set but empty"),
        ("-3", "is negative"),
        ("٣", "not a number in ASCII digits"),
        ("4294967296", "larger than any number Slurm sets"),
    ):
        with pytest.raises(UsageError) as e:
            slurm.slurm_int({"SLURM_PROCID": value}, "SLURM_PROCID", "a rank")
        assert str(e.value).startswith("SLURM_PROCID") and says in str(e.value), str(e.value)
    assert slurm.slurm_int({"SLURM_PROCID": "4294967295"}, "SLURM_PROCID", "a rank") == 2**32 - 1
    assert slurm.slurm_int({}, "SLURM_PROCID", "a rank") is None
    assert slurm.nproc_warning({"SLURM_CPUS_PER_TASK": "8"}, 8) is None
    assert slurm.nproc_warning({}, 8) is None
    assert "(unset: one per GPU)" in slurm.nproc_warning({"SLURM_CPUS_PER_TASK": "4"}, 8)
