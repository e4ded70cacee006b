"""examples/ratings as its launchers run it: its image (examples/ratings/Dockerfile on top of
docker/Dockerfile), the folder that image adds (/opt/ratings: train.py, ratings.yaml and the CSVs),
stood in for on this machine, and the one reference run every launcher's run must equal.

The reference is train.py's own call, `trainer.fit(ratings.yaml, overrides, model=, data=, task=)`,
in this process on one rank; the launchers run it on two, under repro.world_invariant, so the
metrics and weights must match to the bit. Made once per session (helpers.shared_run), whichever
test or worker asks first.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path

from tests import dockerfile
from tests.helpers import ROOT, shared_run

EXAMPLE = ROOT / "examples" / "ratings"
DOCKERFILE = EXAMPLE / "Dockerfile"
COMPOSE_FILE = EXAMPLE / "compose.yaml"
OVERLAY = EXAMPLE / "k8s"
SHORT = ["train.max_steps=30", "repro.world_invariant=true"]
"""What the launcher tests add to the example's own arguments: a short run whose numbers are the
same bits on 1 and 2 ranks."""


def image(variant: str = "cpu", base_env=None) -> dockerfile.Image:
    """The example image's runtime config: its own instructions over the trainer image's."""
    args = {"VARIANT": variant}
    trainer = dockerfile.read(ROOT / "docker" / "Dockerfile", args, base_env=base_env)
    return dockerfile.read(DOCKERFILE, args, base=trainer)


def app_dir(img: dockerfile.Image) -> str:
    """Where the image keeps the script (the folder of the script its CMD runs)."""
    assert img.cmd[0] == "--", img.cmd  # trainer-launch -- SCRIPT ...
    return os.path.dirname(img.cmd[1])


def _import_example():
    """Make the example's package importable here (as `pip install` makes it in the image)."""
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))


def data(tmp_path_factory) -> Path:
    """data.root with ratings/{train,test}.csv, written by the example's prepare step."""

    def make(folder: Path) -> None:
        _import_example()
        from ratings import prepare

        with contextlib.redirect_stdout(None):
            prepare.main(str(folder))

    return shared_run(tmp_path_factory, "ratings data", make)


def stand_in(folder: Path, data_root: Path, img: dockerfile.Image) -> dict[str, Path]:
    """The image's app folder on this machine (train.py and ratings.yaml copied as the Dockerfile
    copies them, data/ the prepared CSVs): {path in the image: local folder}."""
    app = app_dir(img)
    text = DOCKERFILE.read_text()
    assert f"COPY train.py ratings.yaml {app}/" in text and f"prepare {app}/data" in text
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("train.py", "ratings.yaml"):
        shutil.copy(EXAMPLE / name, folder / name)
    (folder / "data").symlink_to(data_root)
    return {app: folder}


def reference(tmp_path_factory) -> Path:
    """The run folder of train.py's trainer.fit on one rank in this process, with SHORT."""
    root = data(tmp_path_factory)

    def make(folder: Path) -> None:
        import torch

        import trainer

        _import_example()
        from ratings.data import load
        from ratings.model import build
        from ratings.task import RatingTask

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as each rank of the launched runs has: the same bits
        try:
            overrides = [*SHORT, f"data.root={root}", "dist.device=cpu", f"run_dir={folder}/run"]
            trainer.fit(
                str(EXAMPLE / "ratings.yaml"),
                overrides,
                model=build,
                data=load,
                task=RatingTask,
                exit_on_error=False,
            )
        finally:
            torch.set_num_threads(threads)

    return shared_run(tmp_path_factory, f"ratings reference {SHORT!r}", make) / "run"
