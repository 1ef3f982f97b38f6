"""``expected_shape`` hints that nothing needs: checked against the real shape, a mismatch told once.

flex_model reads a hook's ``expected_shape`` only to find the dimension a tensor-parallel
activation is sharded on. Where no dimension is sharded (one process, one tensor-parallel
rank, or a hint that names no sharded dimension) it ignores the hint, so a program may run
under flex_model with a hint that does not match its activations. Such a program runs here
too: the hint is compared with the activation and a mismatch is reported once per hook
(or parameter) and wrapper, as a :class:`ShapeHintWarning`, instead of stopping the run.
Where the hint is needed to gather a sharded activation, a hint that cannot be right stays
an error (:func:`torchsurgery.flex.parallel.sharding.dim_from_expected_shape`).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence

import torch

from torchsurgery.flex.hook_function import Shape

__all__ = ["ShapeHintWarning", "hint_fits", "HintCheck"]


class ShapeHintWarning(UserWarning):
    """A hook's ``expected_shape`` does not match its activation, where nothing needs the hint.

    Filter it like any warning:
    ``warnings.filterwarnings("ignore", category=torchsurgery.ShapeHintWarning)``.

    Example:
        >>> import warnings
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> flex = torchsurgery.FlexModel(nn.Linear(2, 3), {})
        >>> flex.register_forward_hook(torchsurgery.HookFunction("", expected_shape=(None, 6)))
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     _ = flex(torch.ones(1, 2)); _ = flex(torch.ones(1, 2))
        >>> [w.category.__name__ for w in caught]  # once, not once per forward
        ['ShapeHintWarning']
        >>> _ = flex.restore()
    """


def hint_fits(shape: Sequence[int], expected: Shape) -> bool:
    """Whether ``shape`` is what ``expected`` describes (``None`` entries match any size).

    Example:
        >>> hint_fits((2, 7), (None, 7)), hint_fits((2, 7), (2, 8)), hint_fits((2, 7), (2, 7, 1))
        (True, False, False)
    """
    return len(shape) == len(expected) and all(e is None or e == s for e, s in zip(expected, shape, strict=True))


class HintCheck:
    """Compares hints with the shapes they describe; tells each mismatch once per label.

    One per wrapper: a label (a hook's ``output_ptr`` key, a parameter's name) is warned
    about the first time its hint does not fit, and never again.

    Example:
        >>> import warnings
        >>> check = HintCheck()
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     for _ in range(3):
        ...         check.check(torch.zeros(4, 10), (None, 20), "fc1", why="one process")
        >>> len(caught), "'fc1'" in str(caught[0].message), "[4, 10]" in str(caught[0].message)
        (1, True, True)
    """

    def __init__(self) -> None:
        self._told: set[str] = set()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, object]:
        return {"_told": set(self._told)}  # a copy (deepcopy, pickle) gets its own lock

    def __setstate__(self, state: dict[str, object]) -> None:
        self._told = set(state["_told"])  # type: ignore[call-overload]
        self._lock = threading.Lock()

    def check(self, tensor: torch.Tensor, expected: Shape | None, label: str, *, why: str) -> None:
        """Warn once for ``label`` when ``expected`` does not describe ``tensor``.

        Args:
            tensor: the activation (or parameter) the hint describes.
            expected: the hint; ``None`` checks nothing.
            label: what the hint belongs to (named in the warning; told once).
            why: why nothing needs the hint here (``"one process"``...), for the message.
        """
        if expected is None or hint_fits(tensor.shape, expected):
            return
        with self._lock:
            if label in self._told:
                return
            self._told.add(label)
        warnings.warn(
            f"torchsurgery.HookFunction: expected_shape {list(expected)} of {label!r} does not match its "
            f"shape {list(tensor.shape)}; nothing needs the hint here ({why}), so it is ignored, as "
            "flex_model ignores it; fix expected_shape (None entries match any size) or drop it. "
            "Told once per hook.",
            ShapeHintWarning,
            stacklevel=3,
        )
