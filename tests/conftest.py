"""Shared, session-scoped reference runs (each launched once, compared against by many tests),
and how the suite runs on two workers (`make test`: pytest-xdist, `-n 2 --dist loadgroup`).

Two workers: most tests wait on real processes (startup, rendezvous, restarts) and leave a core
idle. Tests that share a module- or session-scoped run stay on one worker (an xdist_group), so
the run is made once. Tests marked `serial` measure a bound in time (how soon a signal stops the
ranks): `make test` runs them in a second pass of their own, without workers.
"""

import re

import pytest

from tests.helpers import REFERENCE, trainer


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory):
    """reference_runs(world, *extra) -> the run dir of an uninterrupted run, launched on first use."""
    cache = {}

    def get(world: int, *extra: str):
        key = (world, extra)
        if key not in cache:
            run_dir = tmp_path_factory.mktemp(f"ref-w{world}") / "run"
            trainer(
                "train",
                *REFERENCE,
                "model.kwargs.delay=0",
                *extra,
                f"run_dir={run_dir}",
                nproc=None if world == 1 else world,
            )
            cache[key] = run_dir
        return cache[key]

    return get


_OWN_FIXTURES = ("reference_runs",)
"""Session-scoped fixtures of this suite (not pytest's, like tmp_path_factory): a run they make
is shared by tests in several files, which therefore share one worker."""


def _xdist_group(item) -> str | None:
    """The worker group of a test that uses a shared run: the session's, else its module's."""
    defs = getattr(item, "_fixtureinfo", None)
    if defs is None:
        return None
    scopes = {name: d[-1].scope for name, d in defs.name2fixturedefs.items() if d}
    if any(name in _OWN_FIXTURES for name in scopes):
        return "session-runs"
    own = [n for n, s in scopes.items() if s == "module"]
    return item.module.__name__ if own else None


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups
def pytest_collection_modifyitems(config, items):
    """Grouped tests (shared runs) first, so the long groups start early on two workers and no
    worker ends alone with one; otherwise the collection order.

    GPU-marked tests skip themselves where CUDA is absent (CI, laptops). Image-marked tests
    (minutes, an engine, ~10 GB) run only when `-m` asks for them: `make test-image`.

    The marker, not `item.keywords`: keywords also hold parametrize ids, so a CPU test
    parametrized over the `gpu` k8s overlay would be skipped too.
    """
    for item in items:
        if group := _xdist_group(item):
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)
    expr = config.getoption("markexpr", "") or ""
    if not re.search(r"(?<!not )\bimage\b", expr):
        image = [item for item in items if item.get_closest_marker("image")]
        if image:
            config.hook.pytest_deselected(items=image)
            items[:] = [item for item in items if not item.get_closest_marker("image")]
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip)
