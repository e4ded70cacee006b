"""World (rank facts, device, backend) from the exact variables torchrun sets; inconsistent values
are one-line errors."""

import pytest

from trainer.errors import EnvError
from trainer.ranks import World, choose_device, from_env

TORCHRUN_RANK3 = {  # what torchrun 2.x sets for local rank 1 on node 1 of 2 nodes x 2 procs
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "ROLE_RANK": "3",
    "ROLE_WORLD_SIZE": "4",
    "MASTER_ADDR": "node0.example",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RESTART_COUNT": "2",
    "TORCHELASTIC_MAX_RESTARTS": "3",
    "TORCHELASTIC_RUN_ID": "job",
}


def test_no_torchrun_env_is_a_single_process():
    d = from_env({"PATH": "/bin"})
    assert d == World() and d.size == 1 and d.is_main and not d.distributed


def test_torchrun_env_is_read_once_into_rank_facts():
    d = from_env(TORCHRUN_RANK3)
    assert (d.rank, d.local_rank, d.size, d.local_size, d.node_rank) == (3, 1, 4, 2, 1)
    assert (d.master_addr, d.master_port, d.restart_count) == ("node0.example", 29500, 2)
    assert d.distributed and not d.is_main


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"RANK": "4"}, "RANK=4 must be < WORLD_SIZE=4"),
        ({"RANK": "x"}, "RANK='x' is not an integer"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
        ({"LOCAL_RANK": "2"}, "LOCAL_RANK=2 must be < LOCAL_WORLD_SIZE=2"),
        ({"LOCAL_WORLD_SIZE": "8"}, "LOCAL_WORLD_SIZE=8 exceeds WORLD_SIZE=4"),
        ({"WORLD_SIZE": None}, "WORLD_SIZE is not set"),
        ({"MASTER_ADDR": None}, "needs MASTER_ADDR and MASTER_PORT"),
        ({"MASTER_PORT": "70000"}, "not a TCP port"),
        ({"RANK": "-1"}, "RANK=-1 must be >= 0"),
    ],
)
def test_inconsistent_env_is_a_clear_error(change, fragment):
    env = {**TORCHRUN_RANK3, **change}
    env = {k: v for k, v in env.items() if v is not None}
    with pytest.raises(EnvError) as e:
        from_env(env)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def _device(world, device, backend, gpus):
    w = choose_device(world, device, backend, gpus)
    return w.device, w.backend


def test_device_and_backend():
    one = World()
    assert _device(one, "auto", "auto", 0) == ("cpu", "gloo")
    assert _device(one, "auto", "auto", 2) == ("cuda:0", "nccl")
    assert _device(World(local_rank=1, local_size=2), "cuda", "auto", 2) == ("cuda:1", "nccl")
    assert _device(one, "cpu", "auto", 8) == ("cpu", "gloo")
    assert _device(one, "cuda", "gloo", 1) == ("cuda:0", "gloo")
    # The rank facts travel with the device: one record, read once.
    w = choose_device(World(rank=3, local_rank=1, size=4, local_size=2), "auto", "auto", 2)
    assert (w.rank, w.local_rank, w.size, w.device, w.on_cuda) == (3, 1, 4, "cuda:1", True)


@pytest.mark.parametrize(
    "world, device, backend, gpus, fragment",
    [
        (World(), "cuda", "auto", 0, "no CUDA GPU is visible (CUDA_VISIBLE_DEVICES='')"),
        (
            World(local_rank=2, local_size=4),
            "auto",
            "auto",
            2,
            "LOCAL_RANK=2 but only 2 GPU(s)",
        ),
        (World(), "cpu", "nccl", 0, "nccl needs CUDA"),
    ],
)
def test_device_errors(world, device, backend, gpus, fragment):
    with pytest.raises(EnvError) as e:
        choose_device(world, device, backend, gpus, "")
    assert fragment in str(e.value)


def test_a_lost_peer_is_retryable_and_a_bug_is_not():
    import torch.distributed as dist

    from trainer.errors import RetryableError
    from trainer.ranks import peer_failures_are_retryable

    two = World(rank=1, size=2, local_rank=1, local_size=2, master_addr="h", master_port=1)
    gloo = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:5000"
    for error in (RuntimeError(gloo), dist.DistBackendError("NCCL communicator was aborted")):
        with (
            pytest.raises(RetryableError, match="another rank probably died") as e,
            peer_failures_are_retryable(two, 30),
        ):
            raise error
        assert e.value.exit_code == 4
    with pytest.raises(RuntimeError, match="shape mismatch"), peer_failures_are_retryable(two, 30):
        raise RuntimeError("shape mismatch")  # a bug keeps its traceback
    with (
        pytest.raises(RuntimeError, match="Connection closed"),
        peer_failures_are_retryable(World(), 30),
    ):
        raise RuntimeError(gloo)  # a single process has no peers
