"""The undo-log entry of a FlexModel wrapper, and its clean-up when the wrapper is dropped.

A wrapper pushes one :class:`FlexRecord` onto the model's undo log. Undoing it (through
``flex.restore()``, ``torchsurgery.restore(model)``, or the wrapper being collected)
removes every hook the wrapper put on the model and closes its routing.
"""

from __future__ import annotations

import weakref

from torch import nn

from torchsurgery import _undo
from torchsurgery.flex.compiled import invalidate_compiled
from torchsurgery.flex.hook_function import Binding
from torchsurgery.flex.routing import Routing

__all__ = ["FlexRecord", "remove_bindings", "finalize"]


def remove_bindings(bindings: list[Binding]) -> None:
    """Take every binding's torch hook off and forget the bindings."""
    for binding in bindings:
        binding.remove()
    bindings.clear()


class FlexRecord(_undo.Record):
    """The undo-log entry of a FlexModel wrapper on the model it wraps.

    Example:
        >>> from torchsurgery.flex.routing import LocalRouting
        >>> model = nn.Linear(1, 1)
        >>> record = FlexRecord([], LocalRouting())
        >>> _undo.push(model, record)
        >>> record.describe(), record in _undo.records(model)
        ('FlexModel wrapper (0 hooks)', True)
        >>> record.undo(model); record in _undo.records(model)
        False
    """

    kind = "flex"

    def __init__(self, bindings: list[Binding], routing: Routing) -> None:
        super().__init__()
        self.bindings = bindings
        self.routing = routing

    def describe(self) -> str:
        return f"FlexModel wrapper ({len(self.bindings)} hooks)"

    def undo(self, module: nn.Module) -> None:
        remove_bindings(self.bindings)
        self.routing.close()
        _undo.remove(module, self)
        invalidate_compiled(module)


def finalize(module_ref: weakref.ReferenceType[nn.Module], record: FlexRecord) -> None:
    """What a collected wrapper leaves: the record undone (or, model gone, its hooks removed)."""
    module = module_ref()
    if module is not None:
        record.undo(module)
    else:
        remove_bindings(record.bindings)
        record.routing.close()
