"""How a weight is stored narrower than it computes: the tensor, its product, the native kernel.

:class:`OffloadedTensor` is a weight whose ``dtype`` is the dtype it computes in while its
values are kept in another (bf16, fp16, fp8, a :class:`~torchsurgery.compact.scaled.Scaled` fp8 or int8 format,
or a master copy with a narrow shadow);
:func:`~torchsurgery.compact.narrow.narrow_product` multiplies by such values without
widening the whole weight, through the native kernel for a few rows. The offload pillar
(:mod:`torchsurgery.offloading`) decides *which* weights are stored this way and where they
live; this package decides how they are read.
"""

from torchsurgery.compact.exporting import refuse_file_export
from torchsurgery.compact.foreign import foreign_subclass
from torchsurgery.compact.narrow import Scratch, is_matmul_layer, prepare_kernel
from torchsurgery.compact.scaled import Scaled, dequantize, dequantize_temporary_bytes
from torchsurgery.compact.stored import (
    converted_by,
    load_scaled,
    offloaded_like,
    plain_reader,
    reads_elsewhere_only,
    rehome,
    rescale,
    stored_state,
    stored_values,
)
from torchsurgery.compact.tensor import OffloadedTensor, ReadContext, own_scale

__all__ = [
    # the weight
    "OffloadedTensor",
    "stored_values",
    "reads_elsewhere_only",
    "offloaded_like",
    "stored_state",
    "converted_by",
    "plain_reader",
    "rehome",
    # scaled formats
    "Scaled",
    "dequantize",
    "dequantize_temporary_bytes",
    "own_scale",
    "load_scaled",
    "rescale",
    # other tools
    "foreign_subclass",
    "refuse_file_export",
    # its reads
    "ReadContext",
    "Scratch",
    "prepare_kernel",
    "is_matmul_layer",
]
