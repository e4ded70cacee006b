"""A data plug-in for tests/test_shards.py: tests.helpers' tiny dataset, whose train split says
its data ahead cannot be read (as a ShardSplit's `unavailable` does when its prefetch gave up)
once it has served TRAINER_TEST_UNAVAILABLE_AFTER batches."""

from __future__ import annotations

import os

from tests.helpers import tiny


class _Failing:
    lazy = False

    def __init__(self, split, after: int):
        self.split, self.after, self.served = split, after, 0

    def __len__(self) -> int:
        return len(self.split)

    def take(self, idx):
        self.served += 1
        return self.split.take(idx)

    @property
    def unavailable(self):
        from trainer.errors import DataUnavailable

        if self.served >= self.after:
            return DataUnavailable(
                "data.shards: reading shard s3://b/train-00007.tar: cannot reach the S3 endpoint (retried for 60 s)"
            )
        return None


def tiny_failing(cfg, seed):
    import dataclasses

    spec = tiny(cfg, seed)
    after = int(os.environ.get("TRAINER_TEST_UNAVAILABLE_AFTER", "3"))
    return dataclasses.replace(spec, train=_Failing(spec.train, after))
