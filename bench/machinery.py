"""bench/bench.py's machinery (Row, run_row, machine, steady, summarize, alternation, ratios)
for the suites kept in files of their own (headline.py, parallel.py, loader.py): bench.py loaded
once by path under a name of its own, which dataclasses resolve their module by. bench.py imports
a suite only to run it; a suite never imports bench.py, so the two never import each other.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAME = "_bench_machinery"


def load():
    """bench/bench.py as module `_bench_machinery` (loaded once per process)."""
    if NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(NAME, HERE / "bench.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[NAME] = module
        spec.loader.exec_module(module)
    return sys.modules[NAME]
