"""Print pip's configured package sources as `uv pip install` flags (for `make setup`).

uv reads no pip.conf, so `make setup` hands it what pip would use on this machine: the index,
extra indexes, find-links folders and constraint files from `pip config list` (config files,
then PIP_* variables, which win, as in pip). The CA bundle pip is told to trust reaches uv as
SSL_CERT_FILE, which `make setup` sets from the last line (`cert=PATH`, or `cert=` when pip
names none).

Usage: python scripts/uv_flags.py            (run with the venv's python: its pip's view)
"""

from __future__ import annotations

import shlex
import subprocess
import sys

FLAGS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}


# pip's precedence, lowest first: config files (global, user, site), then PIP_* variables.
# `pip config list` prints them sorted by name instead (":env:" first), so order them here.
RANK = {"global": 0, "user": 1, "site": 2, ":env:": 3}


def settings(listing: str) -> dict[str, list[str]]:
    """`pip config list` output -> {setting: values}, each from the source pip would obey."""
    found: dict[str, tuple[int, list[str]]] = {}
    for line in listing.splitlines():
        key, eq, raw = line.partition("=")
        if not eq:
            continue
        source, _, name = key.rpartition(".")
        rank = RANK.get(source, 0)
        if name not in found or rank >= found[name][0]:
            found[name] = (rank, raw.strip().strip("'\"").split())
    return {name: values for name, (_, values) in found.items()}


def flags(found: dict[str, list[str]]) -> list[str]:
    out = []
    for name, flag in FLAGS.items():
        for value in found.get(name, []):
            out += [flag, value]
    return out


def main() -> int:
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    found = settings(listing)
    print(shlex.join(flags(found)))
    print("cert=" + " ".join(found.get("cert", [])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
