"""The names of a checkpoint's files (store.py says what each holds), shared by the folder format
(store.py) and the bucket one (bucket.py)."""

from __future__ import annotations

import os
import re

MANIFEST = "MANIFEST.sha256"
COMMON = ("state.pt", "meta.json", "config.yaml")
WHOLE = ("model.safetensors", "optimizer.pt")
SHARDED_DIR = "dcp"
SHARDED_METADATA = f"{SHARDED_DIR}/.metadata"
FILES = (*WHOLE, *COMMON)
"""The files of a whole checkpoint."""
STEP_DIR = re.compile(r"^step-(\d+)$")


class CorruptCheckpoint(Exception):
    """A checkpoint that fails verification (missing, truncated or altered files)."""


def files_under(folder: str) -> list[str]:
    """Every file below `folder`, as sorted '/'-separated relative paths."""
    found = []
    for here, _dirs, files in os.walk(folder):
        for name in files:
            found.append(os.path.relpath(os.path.join(here, name), folder).replace(os.sep, "/"))
    return sorted(found)
