"""Experiment tracking (docs/training.md, "Tracking"): MLflow and Weights & Biases, fed by rank 0
off the training thread through a bounded queue, so a tracking outage never costs a run.

sender.py       the bounded queue and the thread that retries a sink while it is down
mlflow_rest.py  an MLflow tracking server through its REST API (standard library only)
wandb_sink.py   W&B through the wandb package (offline or online)
tracker.py      the checks before any work, what a run reports, and the hook `tracked(run)`
"""

from trainer.tracking.tracker import check, tracked

__all__ = ["check", "tracked"]
