"""Batch delivery: augmentation from (seed, epoch, index) only; host, worker and device-resident
paths give identical batches; an empty rank share keeps the batch's shape."""

import dataclasses

import pytest
import torch

from trainer import data
from trainer.config import DataConfig, SyntheticConfig
from trainer.datasets.augment import crop_flip, crop_flip_params
from trainer.sampler import EpochPlan


def _cfg(**kw) -> DataConfig:
    kw.setdefault(
        "synthetic", SyntheticConfig(shape=[3, 8, 8], num_classes=4, size=37, test_size=26)
    )
    return DataConfig(name="synthetic", **kw)


def _train_batches(*args):
    """data.train_batches with each (x, y) batch spread out: (step, x, y, global count)."""
    for step, (x, y), count in data.train_batches(*args):
        yield step, x, y, count


def _epoch(spec, plan, world):
    """Every rank's batches of one epoch, joined per step into the global batch."""
    per_rank = [list(_train_batches(spec, plan, r, world)) for r in range(world)]
    steps = []
    for parts in zip(*per_rank, strict=True):
        assert len({p[0] for p in parts}) == 1 and len({p[3] for p in parts}) == 1
        steps.append(
            (torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts]), parts[0][3])
        )
    return steps


def _assert_same(a, b, tol=0.0):
    assert len(a) == len(b)
    for (xa, ya, ca), (xb, yb, cb) in zip(a, b, strict=True):
        assert ca == cb
        torch.testing.assert_close(xa, xb, rtol=tol, atol=tol)
        torch.testing.assert_close(ya, yb, rtol=0, atol=0)


def test_crop_flip_is_a_pure_function_of_seed_epoch_and_index():
    x = torch.arange(2 * 3 * 5 * 6, dtype=torch.uint8).reshape(2, 3, 5, 6)
    idx = torch.tensor([7, 1234567])
    a = crop_flip(x, idx, 0, 3, 2)
    # The same sample alone, or in another batch position, gets the same crop and flip.
    torch.testing.assert_close(crop_flip(x[1:], idx[1:], 0, 3, 2), a[1:], rtol=0, atol=0)
    swapped = crop_flip(x.flip(0), idx.flip(0), 0, 3, 2)
    torch.testing.assert_close(swapped.flip(0), a, rtol=0, atol=0)
    # Reference: pad, crop at (dy, dx), flip, written out directly for one sample.
    dy, dx, flip = crop_flip_params(0, 3, idx, 2)
    padded = torch.nn.functional.pad(x[0], (2, 2, 2, 2))
    ref = padded[:, dy[0] : dy[0] + 5, dx[0] : dx[0] + 6]
    torch.testing.assert_close(a[0], ref.flip(-1) if flip[0] else ref, rtol=0, atol=0)


def test_crop_flip_params_cover_their_range_and_change_with_epoch_and_seed():
    idx = torch.arange(4000)
    dy, dx, flip = crop_flip_params(0, 0, idx, 4)
    assert set(dy.tolist()) == set(range(9)) == set(dx.tolist())
    assert 0.45 < flip.float().mean().item() < 0.55
    # Offsets look uniform: each of the 9 values within 20% of its expected count.
    counts = torch.bincount(dy, minlength=9).float()
    assert (counts / (4000 / 9) - 1).abs().max() < 0.2
    other_epoch = crop_flip_params(0, 1, idx, 4)
    other_seed = crop_flip_params(1, 0, idx, 4)
    for other in (other_epoch, other_seed):
        assert (other[0] != dy).float().mean() > 0.8  # ~8/9 differ when independent
    assert (other_epoch[2] != flip).float().mean() > 0.4


@pytest.mark.parametrize("world", [2, 3, 8])
def test_augmented_batches_do_not_depend_on_world_size(world):
    spec = data.build(_cfg(augment=True, crop_padding=2), seed=0)
    plan = EpochPlan(n=len(spec.train), global_batch=8, seed=5, epoch=2)
    # 37 samples, batch 8: 3 ranks get unequal shares; on 8 ranks the tail of 5 leaves 3 empty.
    _assert_same(_epoch(spec, plan, world), _epoch(spec, plan, 1))


def test_augmentation_changes_with_epoch_and_is_off_for_evaluation():
    spec = data.build(_cfg(augment=True), seed=0)
    plain = data.build(_cfg(augment=False), seed=0)
    e0 = EpochPlan(n=len(spec.train), global_batch=37, seed=0, epoch=0, shuffle=False)
    e1 = EpochPlan(n=len(spec.train), global_batch=37, seed=0, epoch=1, shuffle=False)
    (_, x0, _, _), (_, x1, _, _) = (next(_train_batches(spec, p, 0, 1)) for p in (e0, e1))
    (_, raw, _, _) = next(_train_batches(plain, e0, 0, 1))
    assert x0.shape == x1.shape == raw.shape == (37, 3, 8, 8)
    differs = [not torch.equal(x0[i], x1[i]) for i in range(37)]
    assert sum(differs) >= 30  # a fresh draw per epoch (a few samples may repeat by chance)
    assert sum(not torch.equal(x0[i], raw[i]) for i in range(37)) >= 30
    (xa, _), (xb, _) = (
        next(data.eval_batches(spec, 64, 0, 1)),
        next(data.eval_batches(plain, 64, 0, 1)),
    )
    torch.testing.assert_close(xa, xb, rtol=0, atol=0)


@pytest.mark.parametrize("workers", [1, 2])
def test_worker_processes_give_the_same_batches(workers):
    ref = data.build(_cfg(augment=True), seed=0)
    spec = data.build(_cfg(augment=True, num_workers=workers, persistent_workers=True), seed=0)
    for epoch in (0, 1):  # the second epoch reuses the persistent workers
        plan = EpochPlan(n=len(ref.train), global_batch=8, seed=1, epoch=epoch)
        _assert_same(_epoch(spec, plan, 2), _epoch(ref, plan, 1))
    assert len(spec._loaders) == 2  # one DataLoader per rank, kept across epochs


def test_device_resident_path_matches_the_host_path_on_cpu():
    host = data.build(_cfg(augment=True), seed=0)
    resident = data.build(_cfg(augment=True, device_resident=True), seed=0, device="cpu")
    assert resident.loader.device_resident
    plan = EpochPlan(n=len(host.train), global_batch=8, seed=3, epoch=1)
    _assert_same(_epoch(resident, plan, 2), _epoch(host, plan, 1))
    ev_host = list(data.eval_batches(host, 10, 0, 1))
    per_rank = zip(*(data.eval_batches(resident, 10, r, 2) for r in (0, 1)), strict=True)
    ev_res = [
        (torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])) for parts in per_rank
    ]
    assert len(ev_host) == len(ev_res) == 3  # the 26-sample test split in batches of 10
    for (xa, ya), (xb, yb) in zip(ev_host, ev_res, strict=True):
        torch.testing.assert_close(xa, xb, rtol=0, atol=0)
        torch.testing.assert_close(ya, yb, rtol=0, atol=0)


def test_an_empty_rank_share_is_an_empty_batch_of_the_right_shape():
    for kw in ({}, {"device_resident": True}, {"augment": True}):
        spec = data.build(_cfg(synthetic=SyntheticConfig(shape=[3, 8, 8], size=9), **kw), 0)
        plan = EpochPlan(n=9, global_batch=4, seed=0, epoch=0)
        last = [list(_train_batches(spec, plan, r, 4))[-1] for r in range(4)]
        shapes = sorted(tuple(x.shape) for _, x, _, _ in last)
        assert shapes == [(0, 3, 8, 8)] * 3 + [(1, 3, 8, 8)]
        assert all(x.dtype == torch.float32 and count == 1 for _, x, _, count in last)


def test_batches_are_normalised_floats_from_uint8_storage():
    spec = data.build(_cfg(synthetic=SyntheticConfig(shape=[3, 16, 16], size=512)), 0)
    assert spec.train.x.dtype == torch.uint8  # a quarter of float32's memory
    plan = EpochPlan(n=512, global_batch=512, seed=0, epoch=0)
    (_, x, _, _) = next(_train_batches(spec, plan, 0, 1))
    assert x.dtype == torch.float32
    assert abs(x.mean().item()) < 0.05 and 0.9 < x.std().item() < 1.1
    raw = data.build(_cfg(normalize=False), 0)
    (_, x, _, _) = next(_train_batches(raw, plan.__class__(37, 37, 0, 0), 0, 1))
    assert x.min() >= 0 and x.max() <= 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_resident_on_gpu_copies_once_and_matches_the_cpu_batches():
    gpu = data.build(_cfg(augment=True, device_resident=True), seed=0, device="cuda")
    cpu = data.build(_cfg(augment=True), seed=0)
    assert gpu.train.x.is_cuda and gpu.test.x.is_cuda and gpu.train.x.dtype == torch.uint8
    plan = EpochPlan(n=len(cpu.train), global_batch=8, seed=2, epoch=1)
    g, c = _epoch(gpu, plan, 2), _epoch(cpu, plan, 1)
    assert all(x.is_cuda and y.is_cuda for x, y, _ in g)
    # Crops and flips are integer work, identical on both; CUDA may divide by 255 as a multiply
    # by its reciprocal, so the floats may differ in the last bit.
    _assert_same([(x.cpu(), y.cpu(), n) for x, y, n in g], c, tol=1e-6)
    # The host path pins memory and copies asynchronously; same numbers on arrival.
    host = data.build(_cfg(augment=True), seed=0, device="cuda")
    assert host.loader.pin_memory
    h = _epoch(host, plan, 1)
    _assert_same([(x.cpu(), y.cpu(), n) for x, y, n in h], c, tol=1e-6)


class _Rows:
    """A split that is not an ArrayDataset: take() may depend on the whole batch asked for."""

    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def take(self, idx):
        return self.inner.take(idx)


@pytest.mark.parametrize("shape, several", [([3, 8, 8], True), ([3, 5, 5], False)])
def test_every_steps_float_batch_starts_aligned_as_its_own_take_would(shape, several):
    """A view into a several-step take is used only where it starts where a take of its own
    would (data.ALIGN): the CPU's matmuls give other bits for an input at another offset. 8x8
    RGB rows are 768 float bytes (aligned); 5x5 rows are 300: one take a step."""
    syn = SyntheticConfig(shape=shape, num_classes=4, size=37, test_size=26)
    resident = data.build(_cfg(synthetic=syn, device_resident=True), seed=0, device="cpu")
    for world in (1, 2):
        plan = EpochPlan(n=len(resident.train), global_batch=4 * world, seed=3, epoch=1)
        spans = list(plan.rank_spans(0, world, 0))
        assert (data.steps_per_take(resident.train, spans) > 1) == several
        for start in (0, 1):
            for _, x, _, _ in _train_batches(resident, plan, 0, world, start):
                assert x.dtype == torch.float32 and x.data_ptr() % data.ALIGN == 0


@pytest.mark.parametrize("world, augment", [(1, True), (2, True), (1, False), (2, False)])
def test_a_device_resident_array_gathers_several_steps_in_one_take(world, augment, monkeypatch):
    """The same batches as one take a step (the host path), from any step on, while an
    ArrayDataset's takes each serve several steps (here 3, by TAKE_BYTES, which counts the
    pixels as float: without augmentation a take is converted at once); another split keeps
    one take a step."""
    host = data.build(_cfg(augment=augment), seed=0)
    resident = data.build(_cfg(augment=augment, device_resident=True), seed=0, device="cpu")
    x, y = resident.train.x, resident.train.y
    assert x.dtype == torch.uint8
    row = x[0].numel() * 4 + y[0].numel() * y.element_size()
    monkeypatch.setattr(data, "TAKE_BYTES", 3 * 4 * row)  # 3 steps of 4 samples a rank
    plan = EpochPlan(n=len(host.train), global_batch=4 * world, seed=3, epoch=1)
    expected, takes, take = _epoch(host, plan, 1), [], type(resident.train).take
    monkeypatch.setattr(
        type(resident.train), "take", lambda s, i: takes.append(len(i)) or take(s, i)
    )
    _assert_same(_epoch(resident, plan, world), expected)
    steps = len(plan)  # 37 samples: 9 steps of 4 and a tail at world 1, 4 of 8 and a tail at 2
    assert takes == ([12, 12, 12, 1] if world == 1 else [12, 6, 12, 7]), takes  # 3 steps a take
    later = list(_train_batches(resident, plan, 0, world, 2))  # a resumed epoch: from step 2 on
    whole = list(_train_batches(resident, plan, 0, world))[2:]
    assert [s for s, *_ in later] == [s for s, *_ in whole]
    for (_, xa, ya, _), (_, xb, yb, _) in zip(later, whole, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    other = dataclasses.replace(resident, train=_Rows(resident.train))
    takes.clear()
    assert len(list(_train_batches(other, plan, 0, 1))) == steps and len(takes) == steps


def test_cut_gives_views_of_every_batch_shape():
    """batches.cut: a flat (x, y) tuple (sliced directly) and every other shape (the walk)
    give samples lo..hi-1 of each tensor as views; other leaves stay as they are."""
    from trainer import batch as batches

    x, y = torch.arange(12.0).reshape(6, 2), torch.arange(6)
    shapes = [(x, y), [x, y], {"x": x, "y": y}, x, (x, (y, "tag")), (x, torch.nn.Parameter(x))]
    for batch in shapes:
        got = batches.cut(batch, 1, 4)
        assert type(got) is type(batch)
        want, have = batches.tensors(batch), batches.tensors(got)
        assert len(have) == len(want)
        for t, v in zip(want, have, strict=True):
            assert torch.equal(v, t[1:4]) and v.data_ptr() == t[1:4].data_ptr()
    assert batches.cut((x, (y, "tag")), 0, 2)[1][1] == "tag"
