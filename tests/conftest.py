"""Shared, session-scoped reference runs: each is launched once and compared against by many tests."""

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


def pytest_collection_modifyitems(config, items):
    """GPU-marked tests skip themselves where CUDA is absent (CI, laptops). Image-marked tests
    (minutes, an engine, ~10 GB) run only when `-m` asks for them: `make test-image`.

    The marker, not `item.keywords`: keywords also hold parametrize ids, so a CPU test
    parametrized over the `gpu` k8s overlay would be skipped too.
    """
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
