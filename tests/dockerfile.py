"""What a Dockerfile's image runs, read from the file: so tests execute exactly what it says.

A small reader for the instructions that shape the runtime (FROM stages, ARG, ENV, USER, WORKDIR,
ENTRYPOINT, CMD); build steps (RUN, COPY, ...) are skipped. Enough for docker/Dockerfile, not a
general implementation: no ONBUILD, no `${VAR:-default}` forms.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

_VAR = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


@dataclass
class Image:
    env: dict[str, str] = field(default_factory=dict)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    user: str = ""
    workdir: str = "/"
    labels: dict[str, str] = field(default_factory=dict)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue  # comments may sit between continuation lines too
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _expand(value: str, scope: Mapping[str, str]) -> str:
    return _VAR.sub(lambda m: scope.get(m.group(1) or m.group(2), ""), value)


def _exec_form(args: str, scope: Mapping[str, str]) -> list[str]:
    if args.startswith("["):
        return [str(a) for a in json.loads(args)]
    return ["/bin/sh", "-c", _expand(args, scope)]


def read(
    path: str | Path,
    build_args: Mapping[str, str] | None = None,
    base_env: Mapping[str, str] | None = None,
    base: Image | None = None,
) -> Image:
    """The final stage's runtime config. `base_env`: what the base image's ENV is taken to be;
    `base`: the base image itself (another Dockerfile's `read`), for a file built FROM it."""
    build_args = dict(build_args or {})
    global_args: dict[str, str] = {}
    stages: dict[str, Image] = {}
    image: Image | None = None
    args: dict[str, str] = {}
    for word, rest in instructions(Path(path).read_text()):
        scope = {**args, **(image.env if image else {})}
        if word == "ARG":
            name, eq, default = rest.partition("=")
            value = build_args.get(name, default.strip('"') if eq else global_args.get(name, ""))
            (args if image else global_args)[name] = _expand(value, scope)
        elif word == "FROM":
            words = [w for w in rest.split() if not w.startswith("--")]  # --platform=...
            ref = _expand(words[0], {**global_args, **build_args})
            alias = words[2] if len(words) >= 3 and words[1].lower() == "as" else ""
            parent = stages.get(ref, base)
            image = (
                Image(
                    env=dict(parent.env),
                    entrypoint=list(parent.entrypoint),
                    cmd=list(parent.cmd),
                    user=parent.user,
                    workdir=parent.workdir,
                    labels=dict(parent.labels),
                )
                if parent
                else Image(env=dict(base_env or {}))
            )
            args = {}
            if alias:
                stages[alias] = image
        elif image is None:
            continue
        elif word in ("ENV", "LABEL"):
            target = image.env if word == "ENV" else image.labels
            for token in shlex.split(rest):
                key, _, value = token.partition("=")
                target[key] = _expand(value, scope)
        elif word == "ENTRYPOINT":
            image.entrypoint = _exec_form(rest, scope)
            image.cmd = []  # Docker resets an inherited CMD when ENTRYPOINT is set
        elif word == "CMD":
            image.cmd = _exec_form(rest, scope)
        elif word == "USER":
            image.user = _expand(rest, scope)
        elif word == "WORKDIR":
            image.workdir = _expand(rest, scope)
    if image is None:
        raise ValueError(f"{path}: no FROM")
    return image
