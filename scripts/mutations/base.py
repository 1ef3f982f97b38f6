"""One mutation: a piece of source taken out, and the tests that must then fail."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    """``old`` (occurring exactly once in ``path``) replaced by ``new`` breaks what ``tests`` check."""

    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
