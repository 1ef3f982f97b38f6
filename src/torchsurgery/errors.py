"""Errors that carry their facts as fields, so callers render them in their own terms.

A message is built from the fields when the error is raised; the command line, for
instance, renders the same error with its option names instead of the function's
argument names, from the fields, without parsing or rewriting the text.

Each error is also the built-in exception a caller would expect (``ValueError`` or
``TypeError``), so ``except ValueError`` keeps working, and each survives pickling with
its fields and notes (so it can cross process boundaries), where its value pickles.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Setting:
    """An argument and a value for it, as a fix suggests it.

    Attributes:
        arg: the argument's name (``"groups"``).
        value: the value to give it (``"leaves"``).

    Example:
        >>> str(Setting("groups", "leaves"))
        "groups='leaves'"
    """

    arg: str
    value: Any

    def __str__(self) -> str:
        return f"{self.arg}={self.value!r}"


class NoMatchError(ValueError):
    """A name or glob that selects nothing, with the names that come close.

    Attributes:
        what: who asked (``"torchsurgery.patch"``, ``"--groups"``): the message's prefix.
        wanted: the name or glob as given.
        near: existing names close to ``wanted``, best first (may be empty).
        kind: what was looked for: ``"submodule"`` or ``"parameter"``.
        advice: a further hint for this caller, appended after the near matches.
        arg: the argument that held ``wanted`` when it is not the function's main one
            (``"groups"``), shown after ``what``; ``""`` otherwise.

    Example:
        >>> error = NoMatchError("torchsurgery.patch", "layer.0", ["layers.0"])
        >>> str(error)
        "torchsurgery.patch: 'layer.0' matches no submodule of the model; did you mean 'layers.0'?"
        >>> error.render("--hook")
        "--hook: 'layer.0' matches no submodule of the model; did you mean 'layers.0'?"
    """

    def __init__(
        self,
        what: str,
        wanted: str,
        near: Sequence[str] = (),
        kind: str = "submodule",
        advice: str = "",
        arg: str = "",
    ) -> None:
        self.what = what
        self.wanted = wanted
        self.near = tuple(near)
        self.kind = kind
        self.advice = advice
        self.arg = arg
        super().__init__(self.render())

    def render(self, what: str | None = None) -> str:
        """The message, prefixed with ``what`` instead of :attr:`what` (and :attr:`arg`) when given."""
        prefix = what or (f"{self.what} ({self.arg})" if self.arg else self.what)
        hint = f"; did you mean {', '.join(repr(name) for name in self.near)}?" if self.near else ""
        advice = f"; {self.advice}" if self.advice else ""
        return f"{prefix}: {self.wanted!r} matches no {self.kind} of the model{hint}{advice}"

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.what, self.wanted, self.near, self.kind, self.advice, self.arg), self.__dict__


class ArgumentError(Exception):
    """An argument a function refuses: which function, which argument, its value, why, and the fix.

    Raised as :class:`ArgumentValueError` or :class:`ArgumentTypeError`; catch this class
    to handle both.

    Attributes:
        what: the function (``"torchsurgery.offload"``).
        arg: the argument's name (``"device"``).
        value: the value given.
        problem: what is wrong, as it follows the argument's name
            (``"'xpu' is not available: this PyTorch reports only 'cpu'"``).
        fix: what to do instead (may be ``""``); a ``{}`` in it stands for :attr:`setting`.
        setting: an argument and value the fix suggests, or ``None``; each caller writes
            it in its own terms (``device='cpu'`` here, ``--device cpu`` on the command line).

    Example:
        >>> error = ArgumentValueError("f", "device", "xpu", "'xpu' is not available", "use {}", Setting("device", "cpu"))
        >>> str(error)
        "f: device 'xpu' is not available; use device='cpu'"
        >>> error.fix_in(lambda s: f"--{s.arg} {s.value}")
        'use --device cpu'
    """

    def __init__(
        self, what: str, arg: str, value: Any, problem: str, fix: str = "", setting: Setting | None = None
    ) -> None:
        self.what = what
        self.arg = arg
        self.value = value
        self.problem = problem
        self.fix = fix
        self.setting = setting
        super().__init__(self.render())

    def fix_in(self, write: Callable[[Setting], str] = str) -> str:
        """:attr:`fix` with :attr:`setting` written by ``write`` (a ``Setting -> str``)."""
        return self.fix.format(write(self.setting)) if self.setting is not None else self.fix

    def render(self) -> str:
        """The message in the function's terms: ``what: arg problem; fix``."""
        fix = self.fix_in()
        return f"{self.what}: {self.arg} {self.problem}" + (f"; {fix}" if fix else "")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.what, self.arg, self.value, self.problem, self.fix, self.setting), self.__dict__


class ArgumentValueError(ArgumentError, ValueError):
    """An :class:`ArgumentError` about the value (the right type, a value it cannot take).

    Example:
        >>> isinstance(ArgumentValueError("f", "prefetch", -1, "must be >= 0, got -1"), ValueError)
        True
    """


class ArgumentTypeError(ArgumentError, TypeError):
    """An :class:`ArgumentError` about the type (a string where a ``torch.dtype`` belongs).

    Example:
        >>> isinstance(ArgumentTypeError("f", "dtype", "bf16", "must be a torch.dtype, got 'bf16'"), TypeError)
        True
    """


class BudgetError(ArgumentValueError):
    """A memory budget smaller than what must fit in it: the largest group of weights, or
    what streaming holds on the device at once (the ring's slots at its prefetch).

    Attributes:
        budget: the budget in bytes.
        needed: the least budget that is accepted, in bytes.
        group: the largest group's module name (``""`` for the root).
        finer: whether smaller groups exist (``False`` when the groups are leaves already);
            the fix then suggests them as :attr:`setting` ``groups='leaves'``.
        holding: what ``needed`` counts, where it is more than the largest group (``None``:
            the largest group).

    Example:
        >>> error = BudgetError("torchsurgery.offload", 1000, 4096, "layers.0")
        >>> str(error)
        "torchsurgery.offload: budget=1000 bytes cannot hold the largest group 'layers.0' (4096 bytes); give at least that, or smaller groups (groups='leaves')"
        >>> error.needed - error.budget
        3096
    """

    def __init__(
        self, what: str, budget: int, needed: int, group: str, finer: bool = True, holding: str | None = None
    ) -> None:
        self.budget = budget
        self.needed = needed
        self.group = group
        self.finer = finer
        self.holding = holding
        largest = f"the largest group {group or '<root>'!r} ({needed} bytes)"
        super().__init__(
            what,
            "budget",
            budget,
            f"cannot hold {holding or largest}",
            "give at least that, or smaller groups ({})" if finer else "give at least that",
            Setting("groups", "leaves") if finer else None,
        )

    def render(self) -> str:
        """The message in the function's terms: ``what: budget=N bytes cannot hold ...``."""
        return f"{self.what}: {self.arg}={self.budget} bytes {self.problem}; {self.fix_in()}"

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.what, self.budget, self.needed, self.group, self.finer, self.holding), self.__dict__


__all__ = ["ArgumentError", "ArgumentTypeError", "ArgumentValueError", "BudgetError", "NoMatchError", "Setting"]
