"""Small files written atomically: the whole new file or the old one, never half of either (a
reader, a kill or a full disk mid-write). Used for metrics' summary.json, the run lock, the
tracking sinks' state and the stall watchdog's stack files.
"""

from __future__ import annotations

import contextlib
import json
import os


def write_text(path: str, text: str, tag: str | None = None) -> None:
    """`text` into `path` by a write to a temporary name beside it and a rename. `tag` names the
    temporary file apart from another writer's of the same path (default: this process's pid;
    processes on other machines sharing the folder need their own)."""
    tmp = f"{path}.{tag or os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_json(path: str, obj, *, tag: str | None = None, **dump) -> None:
    """`obj` as JSON (json.dumps' keywords: indent, sort_keys, ...) into `path`, atomically."""
    write_text(path, json.dumps(obj, **dump) + "\n", tag)


def read_json(path: str):
    """What `path` holds as JSON; None when it is missing or is not JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
