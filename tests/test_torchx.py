"""trainer-launch under TorchX's local_docker: Docker appends the container command to the image's
ENTRYPOINT, so trainer-launch must run `bash -c "torchrun ..."` as is."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers import BIN, env


def test_entrypoint_runs_any_executable_as_is_and_trainer_subcommands_as_before():
    from trainer.launch import make_plan, split_command, trainer_commands

    path = {"PATH": os.environ["PATH"]}
    command = ["bash", "-c", "torchrun --nnodes 1 -m trainer train"]
    c = split_command(command, path)
    assert c.as_is and not c.distributed
    p = make_plan(path, c, gpus=0, cpus=2, python=sys.executable)
    assert list(p.argv) == command and not p.child and not p.env
    assert "train" in trainer_commands() and "config" in trainer_commands()
    assert split_command(["config", "show"], path).trainer_args == ("config", "show")
    assert split_command(["no-such-program-here"], path).trainer_args == ("no-such-program-here",)
    assert split_command(["optim.lr=1"], path).trainer_args == ("train", "optim.lr=1")
    launched = subprocess.run([str(BIN / "trainer-launch"), "sh", "-c", "exit 7"], env=env())
    assert launched.returncode == 7  # exec'd: the command's own exit code
