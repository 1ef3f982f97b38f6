"""Convert and load a module's tensors while every reference to them stays valid.

``nn.Module.to()`` keeps parameter objects only when PyTorch's swap flag is set, and
replaces buffers even then; ``load_state_dict(assign=True)`` gives the module new
parameter objects and unties tied weights. Optimizers, hooks and user code holding the
old objects then silently work on dead tensors. Here every parameter and buffer keeps
its Python identity: new data is put into the existing object with
:func:`torch.utils.swap_tensors`, or copied into it in place.

Every operation checks all it can before changing anything, and puts back what it had
changed if something still fails half-way, so a module is never left half converted.

**Undo.** :func:`convert_` and :func:`load_` record an entry in the module's undo log, so
``torchsurgery.restore(model)`` undoes them (newest first, with the other pillars'
surgery) into the same objects:

* a conversion is converted back: each parameter and buffer returns to its device and
  dtype. A lossless conversion (a move, a widening cast) comes back bitwise by itself (a
  NaN stays a NaN, though a cast may change its payload bits); for one that loses
  information (``float32 -> bfloat16``, a move to ``meta``) the original values are kept
  in host memory, and every value not changed since the conversion gets its original
  back exactly, while values changed since (by training) keep the change, cast back.
  Gradients and the optimizer's state go back to their device and dtype too, by a cast
  (after a narrowing conversion, their rounding stays).
* a load is taken back: tensors filled in place get back the values they had (kept in
  host memory as the load overwrote them), tensors that got new memory (``meta`` ones
  materialised, moved, cast or assigned) get back what they held before, ``meta``
  included. Loads into the same module one after another, with no other surgery between
  them, share one entry that keeps the first one's values only.

Keeping values costs host memory as large as what is kept, and for a load in place the
time of copying it there (several times the read itself, as the kernel must find new
pages for it; see docs/benchmarks.md); ``undoable=False`` records nothing and keeps
nothing, as ``module.to()`` and ``load_state_dict`` do, and a load in place is then the
reads alone.

**File-backed tensors.** A ``meta`` tensor (or, with ``assign=True``, any tensor) that
:func:`load_` would give the stored bytes unchanged (CPU, same dtype, aligned in the
file) is not copied: it becomes a view of a private memory map of the safetensors file
(of the ``torch.load(mmap=True)`` map for ``.pt`` files; of the state dict's own tensor
for a state dict). Loading is then nearly free; pages come from the page cache when first
used and are the system's file cache, shared and dropped under memory pressure, not the
process's own memory; writing to such a tensor (training, ``mul_``) copies only the pages
written into private memory; the file never changes. The file must stay where it is and
unchanged while the model lives: deleting or replacing it (a new file renamed over it) is
safe, but rewriting it in place changes the values of pages not yet written, and
truncating it makes the process crash (SIGBUS) when a lost page is used. ``copy=True``
gives every loaded tensor memory of its own instead.

Real tensors are read in bulk, straight into their memory (``os.preadv``, several
tensors per system call, threads for large or sharded checkpoints on machines with 4 or
more cores). Every key, shape and the file's header are checked before the first write.
An undoable load keeps the values about to be overwritten aside first, so a load that
fails for any reason (an I/O error, a file cut short after its header was read,
``KeyboardInterrupt``) leaves every tensor exactly as it was. With ``undoable=False``
nothing is kept: a read failing after the checks (those same causes) leaves some tensors
with the checkpoint's values, and raises a ``RuntimeError`` saying so (an interrupt
stays a ``KeyboardInterrupt``).

**Scaled fp8 checkpoints.** In ComfyUI's "fp8 scaled" layout a float8 ``<prefix>.weight``
stands for ``weight.float() * <prefix>.scale_weight`` (one number per weight;
``scale_input`` and a ``scaled_fp8`` marker may come along, and are not needed). Such a
weight loads as those values in the module's dtype (or ``dtype=``, also with
``assign=True``), except into a weight offloaded with a scaled ``storage_dtype``
(:class:`~torchsurgery.compact.Scaled`), which takes the float8 bytes and the scale as
stored. The scale keys are understood, not unexpected; a scale that cannot be one (another
shape, or for a weight that is not float8) is refused with the other mismatches.
"""


from __future__ import annotations

from torchsurgery._checkpoint import CheckpointError
from torchsurgery.tensors.converting import ConvertRecord, convert_, swap_on_conversion
from torchsurgery.tensors.loading import LoadRecord, LoadResult, load_
from torchsurgery.tensors.skeletons import skeleton

__all__ = ["swap_on_conversion", "convert_", "load_", "LoadResult", "skeleton", "CheckpointError"]

# the undo records, where copies of models pickled with their undo logs look them up
_RECORDS = (ConvertRecord, LoadRecord)
