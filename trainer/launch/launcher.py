"""`trainer-launch`: the container entrypoint. One node's environment -> one torchrun command.

    trainer-launch                          # torchrun ... -m trainer train   (compose, k8s)
    trainer-launch --config digits-lenet optim.lr=0.01
    trainer-launch --dry-run                # print the command and the env it adds; run nothing
    trainer-launch -- python my_script.py   # any torchrun script: the image serves foreign code
    trainer-launch bash -c '...'            # any other command runs as is (`docker run IMAGE CMD`)

The node's shape comes from the environment (trainer.launch.nodeenv has the contract and precedence).
`make_plan` is a pure function of (environment, command, GPU and CPU counts, a route probe); `main`
does the side effects. torchrun runs as a CHILD, not an exec: it exits 1 whenever a worker fails,
which would hide the trainer's exit codes (2 config, 3 preempted, 4 retryable) from Kubernetes'
podFailurePolicy. Each rank leaves its code in $TRAINER_STATUS_DIR and this process exits with the
most significant one. Signals (SIGTERM, SIGINT, SIGHUP) are forwarded to torchrun, which forwards
them to the workers.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from trainer.cli import COMMANDS
from trainer.errors import ExitCode, TrainerError, UsageError, shorten
from trainer.exitstatus import STATUS_DIR_ENV
from trainer.launch import slurm
from trainer.launch.nodeenv import CONSUMED_PET, Node, launched_by_torchrun, read_node
from trainer.launch.threads import available_cpus, threads_per_rank, user_threads

LOOPBACK_ADDR = "--local-addr=127.0.0.1"
"""One node: the address torchrun gives the ranks as MASTER_ADDR (else the host's FQDN)."""

DISTRIBUTED_COMMANDS = ("train",)
"""trainer subcommands that run under torchrun; the others (config, ...) run once, directly."""

TORCH_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""Always given to torchrun: its shared rendezvous TCP store keeps stale state across restarts
(pytorch#135712); here --max-restarts after a SIGKILLed worker failed or hung in 7 of 11 runs
without it and recovered in 6 of 6 with it."""


@dataclass(frozen=True)
class Command:
    """What runs on every rank: the trainer (args after `trainer`) or foreign code (argv)."""

    trainer_args: tuple[str, ...] = ()
    foreign: tuple[str, ...] = ()
    as_is: bool = False
    """foreign is a whole command to run once, as given, without torchrun: what `docker run IMAGE
    CMD ...` appends to the entrypoint (TorchX's local_docker passes `bash -c "torchrun ..."`)."""

    @property
    def is_trainer(self) -> bool:
        return not self.foreign

    @property
    def distributed(self) -> bool:
        if self.as_is:
            return False
        return bool(self.foreign) or self.trainer_args[0] in DISTRIBUTED_COMMANDS

    def direct_argv(self, python: str) -> list[str]:
        """The command to run in this very process (no torchrun)."""
        if self.is_trainer:
            return [python, "-m", "trainer", *self.trainer_args]
        if self.as_is:
            return list(self.foreign)
        if self.foreign[0].endswith(".py"):
            return [python, *self.foreign]
        return list(self.foreign)

    def torchrun_tail(self) -> list[str]:
        """The end of the torchrun command line: what each worker runs."""
        if self.is_trainer:
            return ["-m", "trainer", *self.trainer_args]
        if self.foreign[0].endswith(".py"):
            return list(self.foreign)  # torchrun runs a script with its own interpreter
        return ["--no-python", *self.foreign]  # `python -u x.py`, a binary: run as typed


@dataclass(frozen=True)
class Route:
    """How this node reaches the rendezvous host: its own address and the interface it leaves by."""

    local_addr: str
    ifname: str | None


@dataclass(frozen=True)
class Rendezvous:
    """Where and how this node meets the others: what a failed rendezvous is explained with."""

    endpoint: str
    """host:port"""
    host: str
    nnodes: str
    node_rank: int | None
    join_timeout: str
    """Seconds, as torchrun gets them (--rdzv-conf join_timeout)."""
    where: str | None = None
    """What the platform calls the host (Slurm: its node name), said beside the endpoint."""
    backend: str = "c10d"
    """c10d: the endpoint is node 0's store; etcd-v2: an etcd server (RDZV_ENDPOINT)."""


@dataclass(frozen=True)
class Plan:
    argv: tuple[str, ...]
    env: dict[str, str]
    """Variables set on top of this process's environment."""
    unset: tuple[str, ...]
    """Variables removed from it."""
    child: bool
    """True: run torchrun as a child and report the ranks' exit codes. False: exec argv."""
    summary: str
    world_size: int | None = None
    """Ranks in the job when torchrun is launched with a fixed node count; None otherwise."""
    rendezvous: Rendezvous | None = None
    """The multi-node rendezvous torchrun joins (None: standalone), to name it when it fails."""
    worlds: tuple[int, ...] = ()
    """Every world size the job may form (an elastic job: MIN..MAX nodes x processes per node),
    each checked against the config before torchrun starts."""

    def shell(self) -> str:
        """The plan as one copy-pastable shell line."""
        parts = ["env"]
        for name in self.unset:
            parts += ["-u", name]
        parts += [f"{k}={v}" for k, v in sorted(self.env.items())]
        return shlex.join([*parts, *self.argv]) if len(parts) > 1 else shlex.join(self.argv)


# ---------------------------------------------------------------------------------------------
# The pure part: command line and environment -> plan.


def split_command(args: Sequence[str], env: Mapping[str, str]) -> Command:
    """trainer-launch's arguments (its own options already removed) -> what each rank runs.

    `-- CMD ...` is foreign code. Otherwise the arguments go to `trainer`: a leading bare word is
    its subcommand (train's own arguments are options or key=value overrides), else `train`.
    For train, TRAIN_ARGS (a shell-quoted string) goes first, so command-line overrides win.
    A leading bare word that is no trainer subcommand but an executable on env's PATH (`bash`,
    `torchrun`, ...) is a command to run as is, the docker-entrypoint convention.
    """
    args = list(args)
    if args and args[0] == "--":
        if len(args) == 1:
            raise UsageError(
                "nothing after '--': give the command to launch, e.g. -- python train.py"
            )
        return Command(foreign=tuple(args[1:]))
    if args and not args[0].startswith("-") and "=" not in args[0]:
        sub, rest = args[0], args[1:]
        if sub not in COMMANDS and _on_path(sub, env):
            return Command(foreign=tuple(args), as_is=True)
    else:
        sub, rest = "train", args
    extra: list[str] = []
    if sub == "train" and env.get("TRAIN_ARGS", "").strip():
        try:
            extra = shlex.split(env["TRAIN_ARGS"])
        except ValueError as e:
            raise UsageError(f"TRAIN_ARGS: cannot split it like a shell would ({e})") from None
    return Command(trainer_args=(sub, *extra, *rest))


def _on_path(name: str, env: Mapping[str, str]) -> bool:
    import shutil

    return shutil.which(name, path=env.get("PATH") or os.defpath) is not None


def make_plan(
    env: Mapping[str, str],
    command: Command,
    *,
    gpus: int,
    cpus: int,
    python: str,
    probe: Callable[[Node, Mapping[str, str]], Route | None] | None = None,
) -> Plan:
    """What to run on this node; pure apart from `probe` (how this node reaches the rendezvous)."""
    if launched_by_torchrun(env) or not command.distributed:
        return _direct_plan(env, command, python)
    node = read_node(env, gpus=gpus, cpus=cpus)
    unset = tuple(v for v in CONSUMED_PET if v in env)
    extra = dict(TORCH_ENV)
    if (threads := threads_per_rank(env, cpus, node.nproc)) is not None:
        extra["OMP_NUM_THREADS"] = str(threads)  # torchrun sets it only for nproc > 1, to 1
    meeting = _multi_node(node, env, probe) if node.multi_node else _standalone(node, env)
    extra.update(meeting.env)
    argv = [python, "-m", "torch.distributed.run", *meeting.flags]
    argv.append(f"--max-restarts={node.max_restarts}")
    argv += command.torchrun_tail()
    world = int(node.nnodes) * node.nproc if node.nnodes.isdigit() else None
    return Plan(
        argv=tuple(argv),
        env=extra,
        unset=unset,
        child=True,
        summary=meeting.summary,
        world_size=world,
        rendezvous=meeting.rendezvous,
        worlds=tuple(n * node.nproc for n in range(node.min_nodes, node.max_nodes + 1)),
    )


def _direct_plan(env: Mapping[str, str], command: Command, python: str) -> Plan:
    """Run the command in this process, without torchrun: this process already is a rank under
    torchrun, or the command runs once (a trainer subcommand other than train, or as is)."""
    if launched_by_torchrun(env):
        summary = (
            f"already rank {env['RANK']} of {env['WORLD_SIZE']} under torchrun: running it directly"
        )
    elif command.as_is:
        summary = f"`{command.foreign[0]}` is no trainer subcommand: running it as is"
    else:
        summary = f"`trainer {command.trainer_args[0]}` runs once, without torchrun"
    return Plan(
        argv=tuple(command.direct_argv(python)), env={}, unset=(), child=False, summary=summary
    )


class _Meeting(NamedTuple):
    """How this node's ranks meet the job's others: torchrun's rendezvous flags, the variables
    they need, a summary line and (several nodes) the rendezvous to name when it fails."""

    flags: list[str]
    env: dict[str, str]
    summary: str
    rendezvous: Rendezvous | None = None


def _standalone(node: Node, env: Mapping[str, str]) -> _Meeting:
    """All ranks on this host: they meet on loopback, not at this host's name, which need not
    resolve (`docker run --network=none`, a container without its name in /etc/hosts): torchrun
    would retry the lookup for ever and gloo would warn on every rank."""
    flags = ["--standalone", "--nnodes=1", f"--nproc-per-node={node.nproc}", LOOPBACK_ADDR]
    added = {} if env.get("GLOO_SOCKET_IFNAME") else {"GLOO_SOCKET_IFNAME": "lo"}
    return _Meeting(flags, added, f"1 node x {node.nproc} process(es), standalone rendezvous")


def _multi_node(
    node: Node,
    env: Mapping[str, str],
    probe: Callable[[Node, Mapping[str, str]], Route | None] | None,
) -> _Meeting:
    """Several nodes: a c10d rendezvous at node.host, left by the address and interface that
    `probe` finds towards it (POD_IP and the user's own *_SOCKET_IFNAME win)."""
    assert node.host is not None
    route = probe(node, env) if probe else None
    conf = _rdzv_conf(node)
    local_addr = env.get("POD_IP", "").strip() or (route.local_addr if route else "")
    endpoint = f"[{node.host}]" if ":" in node.host else node.host
    flags = [
        f"--nnodes={node.nnodes}",
        f"--nproc-per-node={node.nproc}",
        f"--rdzv-backend={node.backend}",
        f"--rdzv-endpoint={endpoint}:{node.port}",
        f"--rdzv-id={node.rdzv_id}",
        "--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items()),
    ]
    if local_addr:
        flags.append(f"--local-addr={local_addr}")
    added = _socket_ifnames(route, env)
    rank = "?" if node.node_rank is None else node.node_rank
    kind = "etcd rendezvous" if node.backend != "c10d" else "rendezvous"
    summary = (
        f"{node.nnodes} nodes x {node.nproc} process(es), this is node {rank}, "
        f"{kind} at {node.host}:{node.port} (id {node.rdzv_id})"
    )
    if node.elastic:
        summary += (
            f"; elastic: {node.min_nodes} to {node.max_nodes} nodes, {node.max_restarts} "
            f"restart(s), last call {conf['last_call_timeout']} s"
        )
    rendezvous = Rendezvous(
        endpoint=f"{endpoint}:{node.port}",
        host=node.host,
        nnodes=node.nnodes,
        node_rank=node.node_rank,
        join_timeout=conf["join_timeout"],
        backend=node.backend,
    )
    return _Meeting(flags, added, summary, rendezvous)


def _socket_ifnames(route: Route | None, env: Mapping[str, str]) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME: the interface towards the rendezvous host,
    unless the user set them."""
    if route is None or not route.ifname:
        return {}
    names = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
    return {var: route.ifname for var in names if not env.get(var)}


def _rdzv_conf(node: Node) -> dict[str, str]:
    """torchrun's --rdzv-conf: the node's own settings, then is_host and the join/read timeouts."""
    conf = dict(node.rdzv_conf)
    if node.node_rank is not None and node.backend == "c10d":
        # Node 0 hosts the store: said explicitly, because a DNS name (a pod's headless
        # service name) often does not match what the pod believes its own hostname is.
        conf.setdefault("is_host", "1" if node.node_rank == 0 else "0")
    conf.setdefault("join_timeout", str(node.join_timeout))
    if node.backend == "c10d":
        conf.setdefault("read_timeout", str(node.join_timeout))  # also bounds the store connect
    if node.elastic:
        conf.setdefault("last_call_timeout", str(node.last_call))
    return conf


def slurm_plan(
    plan: Plan, job: slurm.SlurmJob, env: Mapping[str, str], cpus: int, route: Route | None = None
) -> Plan:
    """The plan for a Slurm job step: Slurm's summary first; one task per process runs the
    command directly with its rank's variables (threads, the interface towards the first node
    for gloo/NCCL, a run folder that stays the same across requeues), as torchrun would have
    given them. `route`: how this node reaches the first node (several nodes)."""
    from trainer.rundir import STABLE_ENV

    summary = f"{job.summary}; {plan.summary}" if not job.per_task else job.summary
    if not job.per_task:
        meeting = plan.rendezvous
        if meeting is not None:
            named = f"Slurm node {job.first_node}, the first of the step's nodes"
            meeting = dataclasses.replace(meeting, where=named)
        return dataclasses.replace(plan, summary=summary, rendezvous=meeting)
    added = {**job.env, **TORCH_ENV, **_socket_ifnames(route, env)}
    added.setdefault(STABLE_ENV, env.get(STABLE_ENV) or "1")
    if (threads := threads_per_rank(env, cpus, 1)) is not None:
        added["OMP_NUM_THREADS"] = str(threads)
    world = int(job.env["WORLD_SIZE"])  # checked against the config before the rank starts
    return dataclasses.replace(plan, env=added, summary=summary, world_size=world)


# ---------------------------------------------------------------------------------------------
# The side effects: GPUs, network, config check, running torchrun, signals.


def visible_gpus() -> int:
    """CUDA devices this process can use (honours CUDA_VISIBLE_DEVICES and the container's GPUs)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()


def probe_route(node: Node, env: Mapping[str, str]) -> Route | None:
    """This node's address (POD_IP, else the one it reaches node 0 from) and its interface."""
    from trainer.launch import netif

    addr = env.get("POD_IP", "").strip()
    try:
        if not addr:
            assert node.host is not None
            addr = netif.source_address(node.host, node.port)
        return Route(addr, netif.interface_for(addr, netif.interface_addresses()))
    except OSError as e:
        print(
            f"trainer-launch: note: cannot tell how this node reaches {node.host} ({e}); "
            "leaving --local-addr and GLOO/NCCL_SOCKET_IFNAME to torchrun's defaults "
            "(set POD_IP to avoid this)",
            file=sys.stderr,
            flush=True,
        )
        return None


def check_trainer_config(command: Command):
    """Load and validate the trainer's config in this process, before torchrun starts; returns it.

    Parsed by the trainer's own command line, so the arguments mean exactly what they will mean
    on every rank.
    """
    from trainer import cli

    return cli.load_config(cli.parse(list(command.trainer_args)))


def check_run_folder(cfg) -> None:
    """The run folder the ranks will write (run_dir, else runs/<name>: trainer-launch pins it
    for its ranks) and a local ckpt.dir, probed on this node before torchrun starts: a folder
    no rank can write is one line here (exit 2 when the path is at fault, 4 when it may clear
    up), on every node, not a rank's error after the rendezvous with the other nodes' torchrun
    reports after it."""
    from trainer import rundir, storage
    from trainer.errors import io_error

    folder = cfg.run_dir or rundir.runs_of(cfg.name)
    checks = [
        (path, key, f"point {key} at writable storage")
        for path, key in ((folder, "run_dir"), (cfg.ckpt.dir, "ckpt.dir"))
        if path and not storage.is_url(path)
    ]
    for path, key, fix in checks:
        if (e := rundir.probe_nearest(path)) is not None:
            raise io_error(e, f"{key} {path} is not writable on this node", fix)


def check_elastic_worlds(cfg, worlds: Sequence[int], rendezvous: Rendezvous | None) -> None:
    """An elastic job may form any world in `worlds`: the config must hold on every one of them
    (the global batch splits, world_invariant's shards split, the layout fits), else the job
    would stop at the first membership change. One line, exit 2, before torchrun starts."""
    from trainer.errors import ConfigError

    errors = {world: _world_error(cfg, world) for world in worlds}
    failing = [(world, e) for world, e in errors.items() if e is not None]
    if not failing:
        return
    world, e = failing[0]
    nnodes = rendezvous.nnodes if rendezvous else "1"
    per_node = worlds[0] // int(nnodes.partition(":")[0])
    fits = [w for w, err in errors.items() if err is None]
    hint = f" (of its worlds, {', '.join(map(str, fits))} would)" if fits else ""
    where = (
        f"NNODES={nnodes} may form a world of {world} ranks ({world // per_node} node(s) "
        f"x {per_node}), where "
    )
    if split := _split_for_all(cfg, worlds, world):
        reason, fix = split
        raise ConfigError(f"{where}{reason}{hint}: {fix}, or narrow NNODES")
    raise ConfigError(
        f"{where}{e}{hint}: choose settings that every world in the range splits, or narrow NNODES"
    )


def _split_for_all(cfg, worlds: Sequence[int], world: int) -> tuple[str, str] | None:
    """(what `world` cannot split, the value every world splits) when the trouble is a count
    the data-parallel degrees must divide (the shards, the global batch); None otherwise. The
    fix names a multiple of all of them: one world's own suggestion may fail on another."""
    import math

    from trainer.config import layout_of
    from trainer.errors import ConfigError

    try:
        degrees = [layout_of(cfg, w).dp for w in worlds]
        dp = layout_of(cfg, world).dp
    except ConfigError:
        return None
    step = math.lcm(*degrees)
    k, b = cfg.repro.shards, cfg.data.global_batch_size
    if cfg.repro.world_invariant and k % dp:
        return (
            f"repro.world_invariant=true cuts each global batch into repro.shards={k} shards, "
            f"which {dp} ranks cannot split evenly",
            f"set repro.shards to a multiple of {step}, which every world in the range splits "
            f"(e.g. repro.shards={math.lcm(k, step)})",
        )
    if b % dp:
        lo, hi = (b // step) * step, (b // step + 1) * step
        return (
            f"data.global_batch_size={b} does not split over {dp} ranks",
            f"use a multiple of {step}, which every world in the range splits (e.g. "
            f"data.global_batch_size={f'{lo} or {hi}' if lo else hi})",
        )
    return None


def _world_error(cfg, world: int):
    """The ConfigError the config meets on `world` ranks, or None."""
    from trainer.config import check_world_size, resolve_strategy
    from trainer.errors import ConfigError

    try:
        check_world_size(cfg, world)
        resolve_strategy(cfg, world)
        _check_layout(cfg, world)
    except ConfigError as e:
        return e
    return None


def _check_layout(cfg, world: int) -> None:
    """dist.mesh against the model on `world` ranks, as every rank checks it before any work
    (parallel.layout.check_model: a built-in model without split points or plan, pp's stages
    against the GPT's blocks); a plug-in model is checked when its ranks build it."""
    from trainer.config import layout_of
    from trainer.parallel.layout import check_model

    check_model(cfg, layout_of(cfg, world))


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _die_with_parent() -> None:
    # If trainer-launch is SIGKILLed, torchrun gets SIGTERM and takes its workers down with it.
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Forwarder:
    """Catches SIGTERM, SIGINT and SIGHUP from the start, and passes them on to the child once
    there is one. From the start, because PID 1 in a pod ignores any signal it has no handler for."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.child = None
        self.forward = True
        """False under a Slurm job step: slurmstepd signals every process of the step itself
        (torchrun and the ranks too), and a second SIGTERM would break torchrun's shutdown."""
        self._previous: dict = {}

    def install(self) -> None:
        import signal

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, _frame) -> None:
        self.received.append(signum)
        if self.forward and self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    @property
    def last(self) -> int | None:
        return self.received[-1] if self.received else None


def run_child(plan: Plan, signals: Forwarder) -> int:
    """Run torchrun, forwarding signals; the ranks' most significant exit code.

    torchrun's stderr (the ranks' too: they inherit it) passes through a StderrFilter, so that
    when a rank reports an error of its own, the node's output ends with that one line, once,
    instead of a copy per rank followed by torchrun's ChildFailedError traceback.
    """
    import shutil
    import subprocess
    import tempfile

    from trainer.exitstatus import node_message
    from trainer.launch import oom

    if signals.last is not None:  # stopped before anything started
        return 128 + signals.last
    status_dir = tempfile.mkdtemp(prefix="trainer-status-")
    env = {k: v for k, v in os.environ.items() if k not in plan.unset}
    env.update(plan.env)
    env[STATUS_DIR_ENV] = status_dir
    from trainer.rundir import STABLE_ENV

    env.setdefault(STABLE_ENV, "1")  # no run_dir: runs/<name>, so a restarted pod resumes
    out = StderrFilter(sys.stderr)
    memory, seen = oom.memory(), collections.deque(maxlen=400)  # torchrun's last words
    try:
        # A session of its own: a terminal's Ctrl-C reaches torchrun once (from us), not twice.
        # Not under Slurm, which signals the step's processes itself (all of them, or with
        # proctrack/pgid the process group: then torchrun must be in ours).
        signals.child = subprocess.Popen(
            plan.argv,
            env=env,
            start_new_session=signals.forward,
            preexec_fn=_die_with_parent,
            stderr=subprocess.PIPE,
        )
        if signals.last is not None:  # a signal arrived while torchrun was starting
            signals.child.send_signal(signals.last)
        assert signals.child.stderr is not None
        for raw in iter(signals.child.stderr.readline, b""):
            seen.append(raw)
            out.feed(raw)
        out.close()
        rc = signals.child.wait()
        code = exit_code(rc, status_dir, signals.last)
        line = node_message(status_dir, code) if rc != 0 else None
        if rc != 0 and not signals.last and (killed := _oom_line(plan, memory, seen)):
            line, code = killed, ExitCode.USAGE  # the cause; the peers' lines are its effects
        if rc != 0 and out.rendezvous and plan.rendezvous and not signals.last:
            line, code = _rendezvous_ending(out, plan.rendezvous, line, code)
        out.finish(line)
        return code
    finally:
        out.finish(None)
        shutil.rmtree(status_dir, ignore_errors=True)


def _rendezvous_ending(
    out: StderrFilter, rendezvous: Rendezvous, line: str | None, code: int
) -> tuple[str | None, int]:
    """The node's line and code when torchrun ended in a rendezvous failure: one line, exit 4,
    where no rank said why; and where torchrun lost the others while its ranks ran and stopped
    them (SIGTERM), in place of their lines ("stopped by SIGTERM", a broken collective) and
    their exit 3 or 4, which are its effects, not a preemption to requeue. A rank's own 1 or 2
    keeps its line."""
    assert out.rendezvous is not None
    if line is None:
        return rendezvous_error(out.rendezvous, rendezvous), ExitCode.RETRYABLE
    if code in (ExitCode.PREEMPTED, ExitCode.RETRYABLE) and lost_while_running(out.rendezvous):
        out.errors.clear()
        return rendezvous_error(out.rendezvous, rendezvous), ExitCode.RETRYABLE
    return line, code


def _oom_line(plan: Plan, before, seen) -> str | None:
    """The node's line when the OOM killer ended a rank while torchrun ran (launch/oom.py)."""
    from trainer.launch import oom

    per = [a.split("=", 1)[1] for a in plan.argv if a.startswith("--nproc-per-node=")]
    return oom.line(before, oom.memory(), oom.killed_rank(list(seen)), per[0] if per else "?")


RENDEZVOUS_FAILURE = re.compile(
    rb"^torch\.distributed\.elastic\.rendezvous\.api\.(Rendezvous(?!GracefulExit)\w*Error)\b:? ?(.*)"
)
"""The last line of torchrun's traceback when this node could not join the others."""
RENDEZVOUS_CAUSES = (
    b"torch.distributed.",
    b"etcd.",
    b"urllib3.exceptions.",
    b"ConnectionRefusedError",
    b"ConnectionResetError",
    b"TimeoutError",
    b"socket.",
)
"""What the inner causes of a rendezvous failure are: torch's store errors, and the etcd
rendezvous' client (python-etcd over urllib3) and the socket errors under it. A traceback ending
in one of these is held until its chain ends; any other is judged at its last line."""


class Traceback:
    """A Python traceback, chained causes included, taken line by line as it arrives."""

    CHAINED = (b"The above exception was", b"During handling of the above exception")

    def __init__(self, first: bytes, early: bool = True) -> None:
        self.lines = [first]
        self.early = early
        """It began before anything else was printed."""
        self.exceptions: list[bytes] = []
        """Each part's final line (`module.Type: message`), innermost cause first."""
        self._state = "frames"
        self.judged = False
        """Its last line settles what it is: no need to wait for the next line."""

    def take(self, raw: bytes) -> bool:
        """Whether `raw` continues the traceback (then it is kept); False: it ended before."""
        text = raw.rstrip(b"\r\n")
        state = self._state
        if state == "frames" and text.startswith((b" ", b"\t")):
            pass
        elif state == "frames" and text:
            self.exceptions.append(text)
            self._state = "exception"
            self.lines.append(raw)
            # Judged at once unless it may be the inner cause of torchrun's rendezvous failure
            # (a torch.distributed error): a worker's traceback is never held for longer.
            self.judged = bool(RENDEZVOUS_FAILURE.match(text)) or not text.startswith(
                RENDEZVOUS_CAUSES
            )
            return True
        elif state in ("exception", "cause") and not text:
            pass
        elif state == "exception" and text.startswith(self.CHAINED):
            self._state = "cause"
        elif state == "cause" and text.startswith(b"Traceback (most recent call last):"):
            self._state = "frames"
        else:
            return False
        self.lines.append(raw)
        return True

    def complete(self) -> bool:
        return bool(self.exceptions) and self._state != "frames"


class StderrFilter:
    """Passes torchrun's stderr through line by line, holding back four things: the ranks'
    `trainer: error:` and `trainer: stopped by` lines, torchrun's own log lines (`E1123 12:00:00.000 123 torch/...`), the
    traceback torchrun prints after a worker failed or after it was signalled (SIGTERM: a
    SignalException, ~29 lines, in every preempted pod's log), and one that comes before anything
    else was printed until it ends: when it is torchrun's failure to join the other nodes, it is
    `rendezvous` (dropped for one line, `rendezvous_error`). `finish(line)`: with a rank's line,
    drop what was held and print that line last; without one, print everything held, in order.
    c10d's rendezvous retries (trainer.noise.C10dNoise) are dropped as they come."""

    RANK_LINES = (b"trainer: error: ", b"trainer: stopped by ")
    """The ranks' own last lines: an error's, or a stop's by a signal (exit 3, not an error)."""
    AGENT = re.compile(rb"^[IWEF]\d{4} [\d:.]+ \d+ \S*torch/distributed/")
    C10D = re.compile(rb"^\[[IWEF]\d{4} [\d:.]+ \w+\.cpp:\d+\] \[c10d\] ")
    """c10d's C++ log lines (a store connection that broke: `recvVector failed on SocketImpl`),
    each followed by its C++ backtrace: torchrun's own words, held as AGENT's are."""
    FAILED = re.compile(rb"failed \(exitcode: ")
    SIGNALLED = re.compile(rb"Received \d+ death signal, shutting down workers")

    def __init__(self, stream) -> None:
        from trainer.noise import C10dNoise, CppLogLines

        self.stream = stream
        self.held: list[bytes] = []
        self.errors: list[bytes] = []
        self.failed = False
        self.signalled = False
        """torchrun was signalled: its traceback follows whatever the workers print meanwhile."""
        self.tail = False
        self.done = False
        self.noise = C10dNoise()
        self.started = False
        """Something was printed: a traceback now may be a worker's, so it passes as it comes."""
        self.block: Traceback | None = None
        self.rendezvous: Traceback | None = None
        """torchrun's traceback for a rendezvous this node could not join or lost, held back."""
        self.c10d = CppLogLines(self.C10D)
        """c10d's C++ log lines and their backtraces (held)."""

    def _write(self, *chunks: bytes) -> None:
        buffer = getattr(self.stream, "buffer", None)
        for chunk in chunks:
            if buffer is not None:
                buffer.write(chunk)
            else:
                self.stream.write(chunk.decode("utf-8", "replace"))
        self.stream.flush()

    def feed(self, raw: bytes) -> None:
        if self.block is not None:
            if self.block.take(raw):
                if self.block.judged:
                    self._end_block()
                return
            self._end_block()
        if self.tail:
            self.held.append(raw)
        elif self.noise.known(raw):
            return
        elif self.c10d.known(raw):
            self.held.append(raw)
        elif raw.startswith(self.RANK_LINES):
            self.errors.append(raw)
        elif self.AGENT.match(raw):
            self.held.append(raw)
            self.failed = self.failed or bool(self.FAILED.search(raw))
            self.signalled = self.signalled or bool(self.SIGNALLED.search(raw))
        elif (self.failed or self.signalled) and raw.startswith(
            b"Traceback (most recent call last):"
        ):
            self.tail = True  # the workers are gone: the rest is torchrun's own report
            self.held.append(raw)
        elif raw.startswith(b"Traceback (most recent call last):") and (
            not self.started or self.held
        ):
            # Before anything was printed it may be torchrun's failure to join; later, right
            # after torchrun's own held lines (a keep-alive that failed, its workers stopped),
            # its loss of the others while the ranks ran. A worker's traceback otherwise passes
            # as it comes (in a block: whole, once its last line shows it is not torchrun's).
            self.block = Traceback(raw, early=not self.started)
        elif self.signalled:  # the workers' lines while they stop; torchrun's stay held
            self._write(raw)
            self.started = True
        else:
            self._write(*self.held, raw)
            self.held.clear()
            self.failed = False
            self.started = True

    def _end_block(self) -> None:
        block, self.block = self.block, None
        if block is None:
            return
        if (
            block.complete()
            and RENDEZVOUS_FAILURE.match(block.exceptions[-1])
            and (block.early or lost_while_running(block))
        ):  # a failure to join once something was printed (a restart's) stays whole
            self.rendezvous = block
        else:
            self._write(*self.held, *block.lines)
            self.held.clear()
            self.started = True

    def close(self) -> None:
        """The stream ended: a traceback still open is complete."""
        self._end_block()

    def finish(self, line: str | None) -> None:
        if self.done:
            return
        self.done = True
        self.close()
        if line is None and self.rendezvous is not None:  # nobody explains it: keep it whole
            self._write(*self.rendezvous.lines)
        if line is not None:
            # Other ranks' lines that say something else are kept, above it; copies are not.
            chosen = self._unranked(line.encode("utf-8", "backslashreplace"))
            others: list[bytes] = []
            for raw in self.errors:
                if self._unranked(raw) != chosen and self._unranked(raw) not in map(
                    self._unranked, others
                ):
                    others.append(raw)
            self._write(*others, (line + "\n").encode("utf-8", "backslashreplace"))
            return
        self._write(*self.errors, *self.held)

    RANK = re.compile(rb"^trainer: error: \[rank \d+\] ")

    def _unranked(self, raw: bytes) -> bytes:
        return self.RANK.sub(b"trainer: error: ", raw.rstrip(b"\r\n"))


def rendezvous_error(failure: Traceback, rendezvous: Rendezvous) -> str:
    """One line for torchrun's failure to join the other nodes (exit 4: a later try may meet
    them), naming the endpoint, the likely cause and the fix, in place of its ~40-line traceback."""
    from trainer.ranks import unresolved

    match = RENDEZVOUS_FAILURE.match(failure.exceptions[-1])
    assert match is not None
    kind = match.group(1).decode()
    node = "this node" if rendezvous.node_rank is None else f"node {rendezvous.node_rank}"
    etcd = rendezvous.backend != "c10d"
    where = f"the {'etcd ' if etcd else ''}rendezvous at {rendezvous.endpoint}"
    if rendezvous.where:
        where += f" ({rendezvous.where})"
    if lost_while_running(failure):
        reason = shorten(_innermost(failure), 160)
        if etcd:
            return (
                f"trainer-launch: error: {node} lost {where} while its ranks ran ({reason}): "
                "check that etcd still runs there, then start the job again (it resumes from the "
                "last checkpoint)"
            )
        return (
            f"trainer-launch: error: {node} lost {where} while its ranks ran ({reason}): node 0 "
            "ended first; its log says why (a rank's error there ends the job), then start all "
            "nodes again (the job resumes from the last checkpoint)"
        )
    if etcd:
        return _etcd_error(kind, failure, rendezvous, node, where)
    if unknown := unresolved(rendezvous.host):
        return (
            f"trainer-launch: error: {node} cannot reach {where}: MASTER_ADDR {rendezvous.host} "
            f"does not resolve ({unknown}): check the name (on Kubernetes, the rank-0 pod's "
            "service or hostname)"
        )
    if kind == "RendezvousTimeoutError":
        return (
            f"trainer-launch: error: {where} did not gather {rendezvous.nnodes} nodes within "
            f"{rendezvous.join_timeout} s: start every node (NODE_RANK 0 to "
            f"{_last_rank(rendezvous.nnodes)}) with the same MASTER_ADDR, MASTER_PORT and "
            "rendezvous id, or raise RDZV_JOIN_TIMEOUT"
        )
    if kind == "RendezvousClosedError":
        return (
            f"trainer-launch: error: {where} was closed before {node} joined (the other nodes "
            "finished or gave up): start all nodes of the job again"
        )
    reason = _innermost(failure)
    return (
        f"trainer-launch: error: {node} cannot reach {where} ({shorten(reason, 160)}): check "
        "that node 0 is running and that MASTER_ADDR and MASTER_PORT name it (a firewall or "
        "NetworkPolicy must let this node reach that port)"
    )


def lost_while_running(failure: Traceback) -> bool:
    """Whether torchrun met the rendezvous failure while its ranks ran: in the agent's watch of
    the other nodes (num_nodes_waiting), after the ranks had started, not in joining."""
    return any(b"num_nodes_waiting" in line for line in failure.lines)


def _innermost(failure: Traceback) -> str:
    """The innermost cause's message (`ExcType: message`'s message, else the type's name)."""
    inner = failure.exceptions[0].decode("utf-8", "replace")
    return inner.partition(": ")[2].strip() or inner.rpartition(".")[2]


def _etcd_error(kind: str, failure: Traceback, rendezvous: Rendezvous, node: str, where: str):
    """rendezvous_error's line for the etcd rendezvous: the fix is the etcd server or its
    address (RDZV_ENDPOINT), never node 0."""
    from trainer.ranks import unresolved

    if unknown := unresolved(rendezvous.host):
        return (
            f"trainer-launch: error: {node} cannot reach {where}: RDZV_ENDPOINT's host "
            f"{rendezvous.host} does not resolve ({unknown}): check the name (on Kubernetes, "
            "the etcd Service's)"
        )
    least = rendezvous.nnodes.partition(":")[0]
    if kind == "RendezvousTimeoutError":
        return (
            f"trainer-launch: error: {where} did not gather {least} nodes within "
            f"{rendezvous.join_timeout} s: start at least {least} nodes with the same "
            "RDZV_ENDPOINT and RDZV_ID, or raise RDZV_JOIN_TIMEOUT"
        )
    if kind == "RendezvousClosedError":
        return (
            f"trainer-launch: error: {where} was closed before {node} joined (the job under "
            "this RDZV_ID ended): give a new job a new RDZV_ID"
        )
    reason = _innermost(failure)
    return (
        f"trainer-launch: error: {node} cannot reach {where} ({shorten(reason, 160)}): check "
        "that etcd runs there with its v2 API (etcd --enable-v2, etcd 3.4 or 3.5) and that "
        "RDZV_ENDPOINT names it"
    )


def _last_rank(nnodes: str) -> str:
    top = nnodes.rpartition(":")[2]
    return str(int(top) - 1) if top.isdigit() else "NNODES-1"


def exit_code(returncode: int, status_dir: str, signalled: int | None) -> int:
    """Node exit code: 0 if torchrun succeeded, else the ranks' most significant code, else
    128+signal (killed, or stopped by a forwarded signal with no rank reporting), else torchrun's."""
    from trainer.exitstatus import node_exit_code

    if returncode == 0:
        return 0  # a restarted attempt succeeded: codes left by earlier attempts do not count
    if returncode < 0:
        fallback = 128 - returncode
    elif signalled is not None:
        fallback = 128 + signalled
    else:
        fallback = returncode
    return node_exit_code(status_dir, fallback, signalled=signalled is not None)


USAGE = """usage: trainer-launch [--dry-run] [TRAINER_ARGS ... | -- COMMAND ... | COMMAND ...]

Launch this node's part of a training job with torchrun, configured from the environment
(compose, Kubernetes Indexed Job/JobSet, Kubeflow PyTorchJob/TrainJob, TorchX).

  TRAINER_ARGS   passed to `trainer` (default subcommand: train), after $TRAIN_ARGS
  -- COMMAND     launch any torchrun script instead, e.g. -- python my_script.py --lr 0.1
  COMMAND        any other executable (bash, torchrun, ...) runs as is, once, without torchrun
                 (`docker run IMAGE bash`; TorchX's local_docker starts its torchrun this way)
  --dry-run      print the command and the environment it would add, then exit
  -h, --help     show this help

environment (first set wins): PET_NNODES|NNODES, PET_NPROC_PER_NODE|NPROC_PER_NODE (auto, gpu,
cpu or N), PET_NODE_RANK|NODE_RANK|JOB_COMPLETION_INDEX, PET_MASTER_ADDR|MASTER_ADDR,
PET_MASTER_PORT|MASTER_PORT (29500), PET_RDZV_ID|RDZV_ID|JOBSET_NAME|JOB_NAME, PET_MAX_RESTARTS|
MAX_RESTARTS (0), RDZV_JOIN_TIMEOUT (600 s), POD_IP, TRAIN_ARGS. Elastic jobs (NNODES=MIN:MAX):
PET_RDZV_BACKEND|RDZV_BACKEND (c10d, or etcd: the rendezvous in an etcd server, which survives
any node), PET_RDZV_ENDPOINT|RDZV_ENDPOINT (etcd: HOST[:2379]), RDZV_LAST_CALL_TIMEOUT (30 s).

exit codes: the trainer's (0 done, 2 bad input, 3 preempted after a checkpoint, 4 retryable),
1 for other failures, 128+N when stopped by signal N with no rank reporting.
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    dry_run = False
    while args and args[0] in ("--dry-run", "-h", "--help"):
        if args.pop(0) == "--dry-run":
            dry_run = True
        else:
            print(USAGE, end="")
            return ExitCode.OK
    try:
        return _launch(args, dry_run)
    except SystemExit as e:  # argparse (the trainer's parser, in the config check): printed
        return e.code if isinstance(e.code, int) else ExitCode.USAGE
    except TrainerError as e:
        print(f"trainer-launch: error: {e}", file=sys.stderr, flush=True)
        return int(e.exit_code)


def _launch(args: list[str], dry_run: bool) -> int:
    signals = Forwarder()
    if not dry_run:
        signals.install()
    try:
        return _launch_with(args, dry_run, signals)
    finally:
        signals.restore()


def _slurm_step_plan(
    plan: Plan, job: slurm.SlurmJob, env: Mapping[str, str], gpus: int, cpus: int
) -> Plan:
    """The plan for a Slurm job step (slurm_plan), with the route towards the first node (one
    task per process on several nodes); one task per node warns when its processes outnumber
    the task's CPUs (SLURM_CPUS_PER_TASK)."""
    route = None
    if job.per_task and job.nodes > 1:
        first = {k: job.env[k] for k in ("MASTER_ADDR", "MASTER_PORT")}
        route = probe_route(read_node(first, gpus=0, cpus=1), env)
    elif not job.per_task:
        warning = slurm.nproc_warning(env, read_node(env, gpus=gpus, cpus=cpus).nproc)
        if warning:
            print(warning, file=sys.stderr, flush=True)
    return slurm_plan(plan, job, env, cpus, route)


def _launch_with(args: list[str], dry_run: bool, signals: Forwarder) -> int:
    env = os.environ
    user_threads(env)  # a bad OMP_NUM_THREADS: one line here, before torch's OpenMP complains
    command = split_command(args, env)
    gpus, cfg = 0, None
    if command.distributed and not launched_by_torchrun(env):
        cfg = check_trainer_config(command) if command.is_trainer else None
        gpus = 0 if cfg is not None and cfg.dist.device == "cpu" else visible_gpus()
    job, cpus = None, available_cpus()  # the container's CPU quota too, not only its affinity
    if command.distributed and not launched_by_torchrun(env) and slurm.in_job_step(env):
        job = slurm.read_slurm(env, gpus=gpus, first_node=slurm.first_node)
        cpus = slurm.cpus_for_task(env, cpus, job)
        env = {**env, **job.env} if job else env
    plan = make_plan(env, command, gpus=gpus, cpus=cpus, python=sys.executable, probe=probe_route)
    if job is not None:
        plan = _slurm_step_plan(plan, job, env, gpus, cpus)
        signals.forward = False
    if cfg is not None and plan.world_size:
        from trainer.config import check_world_size, resolve_strategy

        check_world_size(cfg, plan.world_size)  # exit 2 here, not one failed rank per process
        resolve_strategy(cfg, plan.world_size)
        _check_layout(cfg, plan.world_size)
    elif cfg is not None and plan.worlds and job is None:
        check_elastic_worlds(cfg, plan.worlds, plan.rendezvous)
    if cfg is not None and not dry_run:
        check_run_folder(cfg)  # every node, before torchrun: not ~30 s later in every rank
    if "--rdzv-backend=etcd-v2" in plan.argv and not _importable("etcd"):
        raise UsageError(
            "RDZV_BACKEND=etcd: torchrun's etcd rendezvous needs the python-etcd package, "
            "missing here: pip install python-etcd (the image has it)"
        )
    if dry_run:
        print(f"# {plan.summary}")
        if plan.child:
            print(f"# and {STATUS_DIR_ENV}=<a fresh node-local temp dir> for the ranks' exit codes")
        print(plan.shell())
        return ExitCode.OK
    if plan.child or env.get("RANK", "0") in ("", "0"):  # in place: one line per job, not per rank
        print(
            f"trainer-launch: {plan.summary}\ntrainer-launch: {plan.shell()}",
            file=sys.stderr,
            flush=True,
        )
    if job is not None and job.hosts_store:
        slurm.check_port_free(job.port, job.first_node)
    if not plan.child:
        signals.restore()
        try:
            os.execvpe(plan.argv[0], list(plan.argv), {**os.environ, **plan.env})
        except FileNotFoundError:
            raise UsageError(f"{plan.argv[0]}: command not found") from None
    return run_child(plan, signals)
