"""The trainer and the hand-written loop in one process, their windows alternating.

    python bench/interleaved.py OUT.json train --config digits-mlp OVERRIDE... run_dir=DIR
    torchrun --standalone --nproc-per-node=2 bench/interleaved.py OUT.json train ...   # DDP

Runs `trainer train` unchanged, in this process, and after each of its logged windows (every
log.every_steps steps) runs as many steps of bench/bare.py's loop on its own copy of the model,
optimizer and data (DDP over the same process group under torchrun), with the trainer's clock
paused: the trainer's windows in metrics.jsonl are its own steps alone. Each trainer window and
the bare window after it ran within a second of each other, on the same core, at the same load:
their ratio is what the stack costs per step, without the drift of a shared machine between two
separate runs (on this repo's 2-core VM one process's speed moves by 1.6x from one run to the
next and within a run). OUT.json gets, on rank 0, the bare windows by the trainer step they
follow: {"bare": [[step, samples_per_s], ...]}.

The bare loop is built at the end of the trainer's first window from the trainer's own config;
its RNG draws (init, permutation, dropout) are forked off the trainer's: the trainer's run is the
same run, bit for bit.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import bare  # bench/bare.py
import torch


def interleave(loop_module, windows: list) -> None:
    """Wrap the trainer loop's window record (`_log_train`) so that `windows` collects one bare
    window of the same number of steps after each trainer window, run with the trainer's clock
    paused."""
    log_train = loop_module._log_train
    built: dict = {}

    def with_bare_window(run, losses, clock):
        steps = losses.window_steps  # read before the record resets the window
        result = log_train(run, losses, clock)
        # Paused: the trainer's clock and its stall watchdog (as for an evaluation); forked: the
        # RNG, for the bare steps' dropout draws too.
        with clock.paused(), run.watchdog.paused(), torch.random.fork_rng():
            if "loop" not in built:
                built["loop"], built["i"] = bare.build(run.cfg, run.total_steps), 0
            loop = built["loop"]
            loop.sync()
            start = time.perf_counter()
            for _ in range(steps):
                loop.step(built["i"] % run.total_steps)
                built["i"] += 1
            loop.sync()
            windows.append((run.state.step, steps * loop.samples / (time.perf_counter() - start)))
        return result

    loop_module._log_train = with_bare_window


def main(argv: list[str]) -> int:
    out, args = Path(argv[0]), argv[1:]
    from trainer import cli
    from trainer import loop as trainer_loop

    windows: list = []
    interleave(trainer_loop, windows)
    code = cli.main(args)
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps({"bare": windows}) + "\n")
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
