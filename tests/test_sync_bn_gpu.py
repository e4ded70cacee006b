"""SyncBatchNorm under DDP, on a GPU (torch runs SyncBatchNorm on CUDA only; skipped without one).

Two processes share one GPU over gloo (NCCL refuses two ranks on one device), so the check runs
on a single-GPU machine: with model.sync_bn the 2-rank run equals the 1-process run of the same
global batch; without it, each rank normalises with its own half and the runs part.
"""

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STEPS = 6


def _train(rank: int, world: int, port: int, sync_bn: bool, out: str) -> None:
    import torch.distributed as dist

    from trainer import config, strategy
    from trainer.config import ModelConfig
    from trainer.models import build
    from trainer.parallel.dims import describe
    from trainer.ranks import World
    from trainer.sampler import rank_chunk

    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.cuda.set_device(0)
    me = World(device="cuda:0", backend="gloo")
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        me = World(
            rank=rank,
            size=world,
            local_size=world,
            master_addr="127.0.0.1",
            master_port=port,
            device="cuda:0",
            backend="gloo",
        )
    torch.manual_seed(0)
    model = build(ModelConfig(name="vgg11"), (3, 8, 8), 4).cuda()
    cfg = config.load(None, [f"model.sync_bn={str(sync_bn).lower()}"])
    model = strategy.replicate(model, describe(cfg, world, on_cuda=True), me)
    synced = sum(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 3, 8, 8, generator=g).cuda()
    y = torch.randint(0, 4, (16,), generator=g).cuda()
    mine = torch.from_numpy(rank_chunk(torch.arange(16).numpy(), rank, world)).cuda()
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        local = torch.nn.functional.cross_entropy(model(x[mine]), y[mine], reduction="sum")
        (local * (world / 16)).backward()  # the trainer's global-count normalisation
        opt.step()
        total = local.detach() / 16
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item())
    if rank == 0:
        torch.save({"losses": losses, "synced": synced}, out)
    if world > 1:
        dist.destroy_process_group()


def _run(tmp_path, world: int, sync_bn: bool) -> dict:
    from tests.helpers import free_port

    out = str(tmp_path / f"w{world}-{sync_bn}.pt")
    if world == 1:
        _train(0, 1, 0, sync_bn, out)
    else:
        torch.multiprocessing.spawn(_train, args=(world, free_port(), sync_bn, out), nprocs=world)
    return torch.load(out)


def test_sync_bn_two_ranks_on_one_gpu_match_one_process(tmp_path):
    ref = _run(tmp_path, 1, sync_bn=True)
    synced = _run(tmp_path, 2, sync_bn=True)
    plain = _run(tmp_path, 2, sync_bn=False)
    assert ref["synced"] == 0  # world 1 leaves BatchNorm alone
    assert synced["synced"] == 8 and plain["synced"] == 0
    for a, b in zip(synced["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(b), (synced["losses"], ref["losses"])
    # Per-rank statistics (no sync) give different losses from the second step on.
    assert (
        max(abs(a - b) / abs(b) for a, b in zip(plain["losses"], ref["losses"], strict=True)) > 1e-3
    )
