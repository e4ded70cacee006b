"""Shared reference runs (each launched once per session, compared against by many tests), and
how the suite runs on several workers (`make test`: pytest-xdist, `--dist loadgroup`).

Several workers: most tests wait on real processes (startup, rendezvous, restarts) and leave a
core idle. A run that many tests compare against is made once for the whole session, whichever
worker asks first (helpers.shared_run: a folder per run under the session's temp root, made under a
file lock); the others wait for it, so those tests need not share a worker. Tests that use
another module-scoped fixture stay on one worker (an xdist_group). Tests marked `serial` measure
a bound in time: `make test` runs them in a second pass of their own, without workers.
"""

import re
from pathlib import Path

import pytest

from tests.helpers import REFERENCE, shared_run, train_here, trainer


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory):
    """reference_runs(world, *extra) -> the run dir of an uninterrupted run, launched on first use."""

    def get(world: int, *extra: str):
        def make(folder: Path) -> None:
            args = (
                "train",
                *REFERENCE,
                "model.kwargs.delay=0",
                *extra,
                f"run_dir={folder / 'run'}",
            )
            if world == 1:  # the numbers are the point: in this process (no torch import)
                train_here(*args)
            else:  # the ranks started directly (helpers.ranks): no torchrun process
                trainer(*args, nproc=world, torchrun=False)

        return shared_run(tmp_path_factory, f"reference {world} {extra!r}", make) / "run"

    return get


SHARED = ("reference_runs", "runs")
"""Fixtures whose runs any worker can reuse (shared_run): no worker group for their tests."""


def _xdist_group(item) -> str | None:
    """The worker group of a test that uses another module-scoped fixture: its module's."""
    defs = getattr(item, "_fixtureinfo", None)
    if defs is None:
        return None
    scopes = {name: d[-1].scope for name, d in defs.name2fixturedefs.items() if d}
    own = [n for n, s in scopes.items() if s == "module" and n not in SHARED]
    return item.module.__name__ if own else None


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups
def pytest_collection_modifyitems(config, items):
    """Grouped tests (shared runs) first, so the long groups start early on two workers and no
    worker ends alone with one; otherwise the collection order.

    GPU-marked tests skip themselves where CUDA is absent (CI, laptops). Image-marked tests
    (minutes, an engine, ~10 GB) run only when `-m` asks for them: `make test-image`; so do the
    Slurm-marked ones (a cluster of daemons, root): `make test-slurm`, and the four-process
    model-parallel runs (`mesh`: 4 ranks on 2 cores, or compiled stages, a minute or more each):
    `make test-mesh`, and the long end-to-end runs (`long`: whole programs, 30 s to 2 min each):
    `make test-long`.

    The marker, not `item.keywords`: keywords also hold parametrize ids, so a CPU test
    parametrized over the `gpu` k8s overlay would be skipped too.
    """
    for item in items:
        if group := _xdist_group(item):
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)
    expr = config.getoption("markexpr", "") or ""
    for marker in (
        "image",
        "slurm",
        "mlflow",
        "mesh",
        "long",
        "memory",
        "s3",
        "shards",
        "elastic",
    ):  # their own targets: make test-image, test-slurm, test-mlflow, test-mesh, test-long, ...
        if not re.search(rf"(?<!not )\b{marker}\b", expr):
            chosen = [item for item in items if item.get_closest_marker(marker)]
            if chosen:
                config.hook.pytest_deselected(items=chosen)
                items[:] = [item for item in items if not item.get_closest_marker(marker)]
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip)
