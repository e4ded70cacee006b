"""The last collective this rank entered (trainer/ranks.py counts each one), for the stall files."""

from __future__ import annotations


class Collectives:
    """The last collective this rank entered: its name and a sequence number (per process)."""

    name: str | None = None
    seq: int = 0

    @classmethod
    def enter(cls, name: str) -> None:
        cls.name, cls.seq = name, cls.seq + 1

    @classmethod
    def last(cls) -> str:
        return f"{cls.name} #{cls.seq}" if cls.name else "none yet"
