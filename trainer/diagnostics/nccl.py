"""NCCL's flight recorder: on for GPU jobs, its dumps beside the stall files (diagnostics/nccl/)."""

from __future__ import annotations

import os

from trainer.diagnostics.stall import FOLDER


def flight_recorder_env(run_dir: str, environ) -> dict[str, str]:
    """NCCL's flight recorder, on for GPU jobs unless the user set its variables: a ring of the
    last 2,000 collectives per rank, dumped on a timeout to run_dir/diagnostics/nccl/ (torch
    appends the rank). torch 2.14 reads TORCH_FR_* and the older TORCH_NCCL_* names."""
    prefix = os.path.join(run_dir, FOLDER, "nccl", "trace-rank-")
    wanted = {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
    }
    return {k: v for k, v in wanted.items() if k not in environ}
