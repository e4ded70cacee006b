"""The task plug-in: how a batch reaches the model, the loss as a SUM, the metrics as sums and
counts. The trainer divides by the global counts, so the numbers are the same on any world size."""

import math

import torch.nn.functional as F

from trainer import Task


class RatingTask(Task):
    """Huber loss on the predicted stars (robust to the odd wild rating); evaluation reports
    RMSE, MAE and the share of predictions within half a star."""

    name = "ratings"

    def __init__(self, delta: float = 1.0):
        self.delta = delta

    def forward(self, model, batch):
        return model(batch["user"], batch["item"])  # two inputs

    def loss(self, pred, batch):
        # A SUM over the slice's ratings (one term each: terms_per_sample = 1).
        return F.huber_loss(pred, batch["rating"], delta=self.delta, reduction="sum")

    def metrics(self, pred, batch):
        err = pred.float() - batch["rating"]
        n = len(err)
        return {
            "loss": (self.loss(pred, batch), n),
            "squared_error": ((err**2).sum(), n),
            "mae": (err.abs().sum(), n),
            "within_half_star": ((err.abs() <= 0.5).sum(), n),
        }

    def summarize(self, totals):
        out = super().summarize(totals)  # each sum / its count
        out["rmse"] = math.sqrt(out.pop("squared_error"))
        return out
