"""trainer-launch, the container entrypoint: one node's environment -> one torchrun command.

    launcher.py   command, plan, config check, torchrun as a child, exit codes (`main`)
    nodeenv.py    the node env contract (PET_*, NNODES, NODE_RANK, ...) -> Node, pure
    netif.py      this node's address and interface towards the rendezvous host
    threads.py    CPUs this container may use (affinity, cgroup quota) -> OMP_NUM_THREADS per rank
    slurm.py      a Slurm job step (SLURM_*, scontrol) -> the node contract or a rank's variables

Only the launcher imports these; the trainer's ranks never do.
"""

from trainer.launch.launcher import (
    TORCH_ENV,
    USAGE,
    Command,
    Forwarder,
    Plan,
    Route,
    StderrFilter,
    exit_code,
    main,
    make_plan,
    run_child,
    split_command,
)

__all__ = [
    "TORCH_ENV",
    "USAGE",
    "Command",
    "Forwarder",
    "Plan",
    "Route",
    "StderrFilter",
    "exit_code",
    "main",
    "make_plan",
    "run_child",
    "split_command",
]
