"""Checkpoints, in one place.

    store.py    the on-disk format: atomic step directories, the sha256 manifest, verification,
                newest-valid fallback, pruning; loads that never run code (weights_only)
    manager.py  what a run saves and restores (LoopState, model, optimizer, schedule, RNG), where
                (checkpoint_dir) and who does what across ranks (Checkpointer)
    weights.py  plain weights in and out: any prefix, any device, safetensors export

Importing this package loads nothing; import the module you need.
"""
