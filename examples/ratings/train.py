"""Train the ratings example with trainer.fit, from this script:

    python -m ratings.prepare examples/ratings/data                       # once: the CSV files
    torchrun --standalone --nproc-per-node=2 examples/ratings/train.py    # 2 processes, CPU
    python examples/ratings/train.py optim.lr=0.02 train.epochs=4         # 1 process, overrides
    trainer-launch -- /opt/ratings/train.py                               # in the image

Every `key=value` argument overrides ratings.yaml. It is `trainer train` with this package's
objects: run folder, checkpoints, resume, SIGTERM, exit codes and world invariance included.
"""

import os
import sys

from ratings.data import load
from ratings.model import build
from ratings.task import RatingTask

import trainer

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ratings.yaml")

if __name__ == "__main__":
    trainer.fit(CONFIG, sys.argv[1:], model=build, data=load, task=RatingTask)
