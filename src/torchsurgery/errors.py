"""Errors that carry their facts as fields, so callers render them in their own terms.

A message is built from the fields when the error is raised; the command line, for
instance, renders the same error with its option name instead of the function's name,
without parsing or rewriting the text.
"""

from __future__ import annotations

from collections.abc import Sequence


class NoMatchError(ValueError):
    """A name or glob that selects nothing, with the names that come close.

    Attributes:
        what: who asked (``"torchsurgery.patch"``, ``"--groups"``): the message's prefix.
        wanted: the name or glob as given.
        near: existing names close to ``wanted``, best first (may be empty).
        kind: what was looked for: ``"submodule"`` or ``"parameter"``.
        advice: a further hint for this caller, appended after the near matches.

    Example:
        >>> error = NoMatchError("torchsurgery.patch", "layer.0", ["layers.0"])
        >>> str(error)
        "torchsurgery.patch: 'layer.0' matches no submodule of the model; did you mean 'layers.0'?"
        >>> error.render("--hook")
        "--hook: 'layer.0' matches no submodule of the model; did you mean 'layers.0'?"
    """

    def __init__(
        self, what: str, wanted: str, near: Sequence[str] = (), kind: str = "submodule", advice: str = ""
    ) -> None:
        self.what = what
        self.wanted = wanted
        self.near = tuple(near)
        self.kind = kind
        self.advice = advice
        super().__init__(self.render())

    def render(self, what: str | None = None) -> str:
        """The message, prefixed with ``what`` instead of :attr:`what` when given."""
        hint = f"; did you mean {', '.join(repr(name) for name in self.near)}?" if self.near else ""
        advice = f"; {self.advice}" if self.advice else ""
        return f"{what or self.what}: {self.wanted!r} matches no {self.kind} of the model{hint}{advice}"

    def __reduce__(self) -> tuple[type[NoMatchError], tuple[str, str, tuple[str, ...], str, str]]:
        return type(self), (self.what, self.wanted, self.near, self.kind, self.advice)


__all__ = ["NoMatchError"]
