"""When the loop logs, evaluates and saves: the pure predicates behind `fit`."""

import signal

import torch

from trainer import loop, signals
from trainer.config import CkptConfig, TrainConfig
from trainer.loop import LossSums, TrainClock, should_eval, should_log, should_save
from trainer.signals import StopSignal, StopVote


def test_a_train_record_every_n_steps_and_at_the_last():
    assert [s for s in range(1, 24) if should_log(10, s, 23)] == [10, 20, 23]


def test_evaluation_every_n_steps_or_at_every_nth_epoch_end():
    steps = TrainConfig(eval_every_steps=5)
    assert [s for s in range(1, 13) if should_eval(steps, step=s)] == [5, 10]
    assert not should_eval(steps, step=10, epoch_done=2)  # steps rule: epoch ends do not count
    epochs = TrainConfig(eval_every_epochs=2)
    assert not any(should_eval(epochs, step=s) for s in range(1, 13))
    assert [e for e in range(1, 7) if should_eval(epochs, step=0, epoch_done=e)] == [2, 4, 6]


def test_periodic_saves_never_duplicate_the_final_one():
    steps = CkptConfig(every_steps=4, every_epochs=0)
    assert [s for s in range(1, 13) if should_save(steps, step=s, total_steps=12)] == [4, 8]
    assert not should_save(steps, step=8, total_steps=12, epoch_done=2)
    epochs = CkptConfig(every_epochs=2)
    done = [e for e in range(1, 5) if should_save(epochs, step=3 * e, total_steps=12, epoch_done=e)]
    assert done == [2]  # epoch 4 ends at the last step: the final save covers it
    assert not should_save(CkptConfig(every_steps=0, every_epochs=0), step=5, total_steps=12)


def _falls_due(cfg, s: int, total: int) -> bool:
    return (
        s == total
        or should_log(cfg.log.every_steps, s, total)
        or should_eval(cfg.train, step=s)
        or should_save(cfg.ckpt, step=s, total_steps=total)
    )


def test_the_steps_before_next_due_need_no_record_evaluation_or_save():
    """next_due: the loop skips the record, evaluation and save checks before it, so no step
    before it may be one of theirs, and it is one (or the last step), from any step on."""
    from trainer.config import Config, LogConfig

    cases = [(10, 0, 0, 23), (4, 6, 0, 30), (7, 0, 5, 40), (50, 15, 12, 100), (1, 0, 0, 5)]
    for log_every, eval_every, save_every, total in cases:
        cfg = Config(
            log=LogConfig(every_steps=log_every),
            train=TrainConfig(eval_every_steps=eval_every),
            ckpt=CkptConfig(every_steps=save_every),
        )
        for step in range(total):
            due = loop.next_due(cfg, step, total)
            first = min(s for s in range(step + 1, total + 1) if _falls_due(cfg, s, total))
            assert due == first, (cfg, step, due)


def test_the_clock_counts_earlier_segments_and_leaves_pauses_out(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("trainer.loop.time.perf_counter", lambda: now[0])
    clock = TrainClock(before=7.0)
    now[0] += 2.0
    assert clock.lap() == (2.0, 0.0) and clock.total == 9.0
    with clock.paused():
        now[0] += 50.0  # evaluation or a checkpoint save
    now[0] += 1.0
    assert clock.since_lap() == 1.0 and clock.since_lap() == 1.0  # a peek starts no new lap
    assert clock.lap() == (1.0, 0.0) and clock.total == 10.0


def test_the_stop_vote_cadence_is_about_a_fifth_of_a_second_of_steps():
    assert StopVote.cadence(1.0) == 1  # slow steps: a vote every step
    assert StopVote.cadence(0.02) == 10
    assert StopVote.cadence(0.0001) == signals.MAX_EVERY
    assert StopVote.cadence(0.0) == StopVote.cadence(float("nan")) == signals.MAX_EVERY


def test_stop_votes_are_posted_every_n_steps_and_read_one_step_later(monkeypatch):
    """The schedule every rank follows, so all read the same votes at the same steps; a signal
    in step k stops after step k + every at the latest."""
    import torch.distributed as dist

    posted, read = [], []
    step = 0

    class Work:
        def __init__(self, at):
            self.at = at

        def wait(self):
            read.append((self.at, step))

    def all_reduce(flag, op, group, async_op):
        posted.append(step)
        return Work(step)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    stop = StopSignal()
    vote = StopVote(stop, group=object())
    vote.every = 5
    stops = []
    for step in range(1, 31):
        if step == 17:  # a signal lands during step 17
            stop.signum = signal.SIGTERM
        if vote.poll(step):
            stops.append(step)
            break
    assert posted == [5, 10, 15, 20]
    assert read == [(5, 6), (10, 11), (15, 16), (20, 21)]
    assert stops == [21]  # = 17 + 4 <= 17 + every


def test_a_cadence_that_changes_every_step_still_votes_within_every_steps(monkeypatch):
    """The agreed cadence changes at log steps (here 10 and 9 by turns, every 10 steps). Each
    vote comes at most `every` steps after the last, so a signal in step k stops by k + every.
    At `step % every == 0` steps 1-17 had none, and 20-35: a stop up to 17 steps late."""
    import torch.distributed as dist

    posted = []
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: posted.append(step) or Work())

    class Work:
        def wait(self):
            pass

    vote = StopVote(StopSignal(), group=object())
    for step in range(1, 200):
        vote.every = 10 if (step // 10) % 2 == 0 else 9
        vote.poll(step)
    gaps = [b - a for a, b in zip([0, *posted], posted, strict=False)]
    assert max(gaps) <= 10 and posted[:4] == [10, 19, 29, 38], posted[:5]


def test_loss_sums_add_in_step_order_with_the_bits_of_a_float64_accumulator():
    # The steps' float32 losses wait in a list and are added at a window or epoch end: the same
    # float64 additions, in the same order, as the float64 tensors += each step made.
    gen = torch.Generator().manual_seed(0)
    losses = (torch.rand(23, generator=gen) * torch.logspace(-6, 3, 23)).float()
    sums = LossSums("cpu", world_size=1)
    window = torch.zeros((), dtype=torch.float64)
    epoch = torch.zeros((), dtype=torch.float64)
    for i, loss in enumerate(losses):
        sums.add(loss, 64)
        window += loss
        epoch += loss
        if i % 5 == 4:
            assert sums.window().loss == window.item() / 5
            window.zero_()
    assert sums.epoch_mean() == epoch.item() / 23
    assert sums.epoch_mean() is None  # a new epoch without steps


def test_the_log_window_all_reduce_carries_the_agreed_vote_cadence(monkeypatch):
    # Two ranks: the other one's shares arrive through the all-reduce (loss 1, cadence 10,
    # metrics errno 5, a save asked for, its forward 0.3 s and data wait 0.4 s in rank 1's
    # slots); the cadence is the ranks' mean rounded up, the flags their sum, a save is due if
    # any rank (rank 0, by its clock) asked, and each rank's pair lands in its own slots.
    two = LossSums("cpu", world_size=2)
    two.add(torch.tensor(2.0), 64)
    other = torch.tensor([1.0, 10.0, 5.0, 1.0, 0.0, 0.3, 0.0, 0.4], dtype=torch.float64)
    monkeypatch.setattr(loop.ranks, "all_reduce_sum", lambda t: t + other)
    window = two.window(rank=0, vote_every=7, forward_s=0.1, data_wait_s=0.2)
    assert (window.loss, window.vote_every, window.metrics_errno, window.save_due) == (
        3.0,
        9,
        5,
        True,
    )
    assert (window.forward_s, window.data_wait_s) == ([0.1, 0.3], [0.2, 0.4])
    monkeypatch.undo()
    sums = LossSums("cpu", world_size=1)
    sums.add(torch.tensor(2.0), 64)
    sums.add(torch.tensor(4.0), 64)
    window = sums.window(vote_every=7)
    assert (window.loss, window.vote_every, window.metrics_errno, window.save_due) == (
        3.0,
        7,
        0,
        False,
    )
    sums.add(torch.tensor(1.0), 64)
    window = sums.window(metrics_errno=28, save_due=True)  # rank 0's write errno
    assert (window.loss, window.vote_every, window.metrics_errno, window.save_due) == (
        1.0,
        1,
        28,
        True,
    )
