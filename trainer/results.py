"""Results: what a run has measured so far. The loop writes it, each checkpoint's meta.json
carries it (so a resumed run's summary covers every segment), and train.finish summarises it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Results:
    train_loss: float | None = None
    """The latest mean train loss per step: of a log window, or of a whole epoch."""
    train_epoch: int | None = None
    """The epoch (0-based) that train_loss is the mean of; None when it is a log window's."""
    eval: dict[str, float] = field(default_factory=dict)
    """The latest evaluation's metrics (loss, accuracy, count, ...); empty before the first."""
    eval_step: int | None = None
    """The optimizer step that evaluation ran after."""
    train_time_s: float = 0.0
    """Training wall time of all segments so far (evaluation and saves excluded)."""
    data_wait_s: float = 0.0
    """Of which rank 0 waited for data."""

    def record_train(self, loss: float | None, epoch: int | None = None) -> None:
        """A log window's mean loss (epoch None), or an epoch's."""
        if loss is not None:
            self.train_loss, self.train_epoch = loss, epoch

    def record_eval(self, metrics: dict[str, float], step: int) -> None:
        self.eval, self.eval_step = dict(metrics), step

    def train(self) -> dict:
        """{"loss": ...} (and "epoch" for an epoch's mean): summary.json's "train"."""
        if self.train_loss is None:
            return {}
        out: dict = {"loss": self.train_loss}
        if self.train_epoch is not None:
            out["epoch"] = self.train_epoch
        return out

    def to_dict(self) -> dict:
        """The JSON object meta.json holds (the shape checkpoints have always had)."""
        out: dict = {"train": self.train(), "eval": dict(self.eval)}
        if self.eval_step is not None:
            out["eval"]["step"] = self.eval_step
        out["train_time_s"] = self.train_time_s
        out["data_wait_s"] = self.data_wait_s
        return out

    def state_dict(self) -> dict:
        return self.to_dict()

    def load_state_dict(self, saved: dict) -> None:
        """From meta.json's "results", in place (the loop and the checkpointer share this one)."""
        self.__dict__.update(Results.from_dict(saved).__dict__)

    @classmethod
    def from_dict(cls, saved: dict) -> Results:
        """From meta.json's "results" (store.check_payload has checked its shape)."""
        train, evaluated = dict(saved.get("train") or {}), dict(saved.get("eval") or {})
        step = evaluated.pop("step", None)
        return cls(
            train_loss=train.get("loss"),
            train_epoch=train.get("epoch"),
            eval=evaluated,
            eval_step=step,
            train_time_s=float(saved.get("train_time_s", 0.0)),
            data_wait_s=float(saved.get("data_wait_s", 0.0)),
        )
