"""Checkpoints, in one place.

    store.py    the on-disk format: atomic step directories, the sha256 manifest, verification,
                newest-valid fallback, pruning; loads that never run code (weights_only)
    manager.py  the Checkpointer: fed the run's Stateful parts (trainer/state.py), it decides the
                format (whole or sharded), writes (in place or on its writer thread), verifies,
                restores and falls back; where (checkpoint_dir) and who does what across ranks
    resume.py   resume decisions as pure functions: which checkpoint, and the Resume record
    writer.py   the background writer: one write in flight on rank 0's thread
    sharded.py  DCP shards: every rank writes and reads its own, any world size on load
    weights.py  plain weights in and out: any prefix, any device, safetensors export

Importing this package loads nothing; import the module you need.
"""
