"""A safetensors file written tensor by tensor: the header first (every name, dtype and shape is
known before any value: a laid-out model's ModelParts holds them), then each tensor's bytes as it
arrives, so the writer never holds more than one tensor. What the final weights and exports of a
model that no rank holds whole are written with; the file is plain safetensors (any reader
loads it), written to a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import os
import struct

import torch

from trainer.checkpoint.store import umask

_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip
"""safetensors' names of the dtypes a model's state holds."""


class StreamWriter:
    """Write `layout` ({name: (shape, dtype)}, in file order) to `path`: `write(name, tensor)`
    for each name in that order, then `close()`; `abort()` leaves nothing behind."""

    def __init__(self, path: str, layout: dict, metadata: dict[str, str] | None = None):
        self.path, self.order = path, list(layout)
        self._tmp = f"{path}.{os.getpid()}.tmp"
        self._next = 0
        entries, offset = {}, 0
        for name, (shape, dtype) in layout.items():
            size = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            entries[name] = {
                "dtype": _CODES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        header = {"__metadata__": metadata, **entries} if metadata else entries
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        self._file = open(self._tmp, "wb")  # noqa: SIM115  (closed by close/abort)
        self._file.write(struct.pack("<Q", len(text)) + text)
        self._sizes = {n: e["data_offsets"][1] - e["data_offsets"][0] for n, e in entries.items()}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor's bytes (its name, shape and dtype as the layout said)."""
        expected = self.order[self._next]
        data = tensor.detach().to("cpu").contiguous()
        if name != expected or data.numel() * data.element_size() != self._sizes[name]:
            raise ValueError(f"stream of {self.path}: got {name}, expected {expected}")
        self._file.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))  # no copy
        self._next += 1

    def close(self) -> str:
        """Flush, sync and rename into place once every tensor is written."""
        if self._next != len(self.order):
            raise ValueError(f"stream of {self.path}: {len(self.order) - self._next} missing")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.chmod(self._tmp, 0o666 & ~umask())
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        self._file.close()
        if os.path.exists(self._tmp):
            os.remove(self._tmp)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
