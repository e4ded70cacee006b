"""A digest of weights by their tensors alone, for "the same bits" checks between runs.

Two runs that end on the same weights write different `final/model.safetensors` files: the
file's metadata holds each run's config, its run_dir included. The digest covers only what
the weights are: every tensor's name, dtype, shape and bytes, taken in name order, so it is the
same whatever the metadata, the order the tensors were written in, or the layout (whole, FSDP,
pipeline stages) that wrote them. summary.json's `weights_sha256` is final/'s digest;
`python -m trainer.checkpoint.digest FILE...` prints any safetensors file's.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch


class TensorDigest:
    """Tensors added one at a time (streamed, as final/ is written); `hexdigest()` at the end."""

    def __init__(self) -> None:
        self.parts: dict[str, tuple[str, list[int], str]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().cpu().contiguous().reshape(-1)
        h = hashlib.sha256(t.view(torch.uint8).numpy().tobytes())
        self.parts[name] = (
            str(tensor.dtype).removeprefix("torch."),
            list(tensor.shape),
            h.hexdigest(),
        )

    def hexdigest(self) -> str:
        h = hashlib.sha256()
        for name in sorted(self.parts):
            h.update(json.dumps([name, *self.parts[name]]).encode() + b"\n")
        return h.hexdigest()


def file_digest(path: str) -> str:
    """The digest of a safetensors file's tensors (read one at a time)."""
    from safetensors import safe_open

    digest = TensorDigest()
    with safe_open(path, framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            digest.add(name, f.get_tensor(name))
    return digest.hexdigest()


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(f"{file_digest(arg)}  {arg}")
