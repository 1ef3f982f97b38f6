"""What ``torch.export`` sees of an offloaded weight, and the offloads it cannot export.

``torch.export.export`` (non-strict, its default) first makes a fake copy of every parameter:
PyTorch's tensor describer asks each tensor for its memory (``untyped_storage()``) to tell
which tensors share memory. An :class:`~torchsurgery.compact.OffloadedTensor` answers that
question with its stored values' memory (what programs that identify memory need:
safetensors, ``save_pretrained``), which is also the memory of the stored tensor it wraps.
The describer makes that stored tensor fake first and would then put its fake (meta) memory
under the wrapper, which reads as another device: export failed there. While the describer
asks, the wrapper answers with its own storage instead (as it does under ``torch.compile``),
and the exported program reads the weight as eager code does: in the compute dtype, from the
stored (narrow or scaled) values.

A group streamed (to an accelerator, or widened on the CPU) is traced as ``torch.compile``
traces it: a copy of each stored weight to where it computes, in the graph, so the exported
program holds the stored weights and brings them in at every call. A group streamed from a
checkpoint file has no values outside its forward: exporting it is refused
(:func:`refuse_file_export`).
"""

from __future__ import annotations

import sys
from types import CodeType

import torch

__all__ = ["described_for_fakes", "refuse_file_export"]

_describer: list[CodeType] = []  # the describer's code object, found at the first question


def _describe_code() -> CodeType:
    if not _describer:
        from torch._subclasses.meta_utils import MetaTensorDescriber

        _describer.append(MetaTensorDescriber.describe_tensor.__code__)
    return _describer[0]


def described_for_fakes(depth: int = 4) -> bool:
    """Whether PyTorch's tensor describer (what makes fake copies for ``torch.export``) is among
    the ``depth`` callers of the function calling this one.

    Example:
        >>> described_for_fakes()
        False
    """
    code = _describe_code()
    frame = sys._getframe(1)
    for _ in range(depth + 1):
        if frame is None:
            return False
        if frame.f_code is code:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def refuse_file_export(group: str) -> None:
    """Refuse, while ``torch.export`` traces, the forward of the group ``group`` streamed from a checkpoint file.

    Its weights are read from the file in each of its forwards (meta outside them): an exported
    program has no place for that. Nothing has changed when it raises: the forward has not begun.

    Raises:
        RuntimeError: under ``torch.export``; the message names the way out.

    Example:
        >>> refuse_file_export("layers.0")  # outside an export: nothing
    """
    if torch.compiler.is_exporting():
        raise RuntimeError(
            f"torchsurgery.offload: torch.export cannot export a model whose group {group or '<root>'!r} streams "
            "from a checkpoint file (offload(storage=path)): its weights are read from the file in each of its "
            "forwards, which an exported program cannot do. Load the weights into memory first (remove the "
            "offload, load the file with torchsurgery.load_ or load_state_dict, and export; an offload kept in "
            "memory, with any storage_dtype, exports)"
        )
