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


def suite_main(argv, doc: str, run, plot, stem: str, quick_stem: str) -> tuple[dict, Path]:
    """The command line of a suite kept in a file of its own that writes one report: --out,
    --quick (`run(quick)`'s tiny sizes, saved as `quick_stem`), --note; the report (machine,
    note, what `run` returns, seconds) written as OUT/STEM.json and drawn by `plot` as .png.
    Returns the report and OUT/STEM (without a suffix)."""
    import argparse
    import json
    import time

    bench = load()
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default=str(bench.ROOT / "bench" / "results"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes: the machinery only")
    parser.add_argument("--note", help="a line for the JSON")
    args = parser.parse_args(argv)
    started = time.time()
    report = {"machine": bench.machine(), "note": args.note, **run(args.quick)}
    report["seconds"] = time.time() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / (quick_stem if args.quick else stem)
    path.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, path.with_suffix(".png"))
    return report, path
