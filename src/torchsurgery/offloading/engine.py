"""The ``offload`` engine: weights live in storage and come in group by group.

Weights are kept in *storage* (host memory, optionally in a compact ``storage_dtype``, or
a checkpoint file) and brought to ``device``/``dtype`` just before their group runs, then
released. Within a ``budget``, groups whose transfers cannot be hidden behind compute
stay resident instead, held in the storage dtype too. With a storage dtype narrower than
the compute dtype it is "layerwise casting" and halves the weights' memory.

Mechanics, chosen so that nothing about the model's identity changes:

* storage and residency conversions swap data into the existing parameter objects
  (``torch.utils.swap_tensors``), so optimizers and user references stay valid;
* a streamed group's weights are packed into one flat host buffer that the parameters
  are views into, and its root module gets a patch whose forward brings the group in
  through a ring of device buffers (:mod:`torchsurgery.offloading.streams`) and puts the
  stored parameters back in a ``finally``, also on ``KeyboardInterrupt``;
* a weight stored in another dtype than it computes in becomes an
  :class:`~torchsurgery.compact.tensor.OffloadedTensor` (the same object): it reads as
  the compute dtype to every program, and on a CPU ``nn.Linear`` (and transformers
  ``Conv1D``) products read its narrow values directly, whatever the layer's ``forward``
  (patched or not) is.

:func:`offload` asks :func:`~torchsurgery.offloading.plan.plan_offload` for a plan (groups,
residency, dtypes, checkpoint keys; nothing changes yet), then the :class:`OffloadHandle`
installs it (:mod:`~torchsurgery.offloading.install`), attaches the behaviour that keeps it
working (:mod:`~torchsurgery.offloading.attach`), and later makes groups resident by their
measured costs (:mod:`~torchsurgery.offloading.measured_residency`) or takes dtype
conversions through it (:mod:`~torchsurgery.offloading.conversion`). Everything is recorded
in the model's undo log (:mod:`~torchsurgery.offloading.originals`); :meth:`OffloadHandle.remove`
(or ``torchsurgery.restore``) puts every tensor back on its device in its dtype, with its
identity (values are those of the storage dtype when that was narrower, resident or
streamed alike; with a ``master_dtype``, the master values: the original ones).
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from torchsurgery import _undo
from torchsurgery._device import OffloadDevice
from torchsurgery.compact import ReadContext, Scaled, Scratch
from torchsurgery.offloading.attach import Attachments
from torchsurgery.offloading.checkpoint_values import CheckpointValues
from torchsurgery.offloading.conversion import (
    check_convertible,
    convert_values,
    dtype_changes,
    grown_budget,
    warn_if_unscaled,
)
from torchsurgery.offloading.file_reader import FileReader, read_buffers
from torchsurgery.offloading.forward_lock import ForwardLock
from torchsurgery.offloading.host_tier import HostAccount, retier
from torchsurgery.offloading.install import Installer
from torchsurgery.offloading.measured_residency import MeasuredResidency
from torchsurgery.offloading.originals import Originals
from torchsurgery.offloading.pending import hand_over
from torchsurgery.offloading.plan import DEFAULT_SKIP, OffloadPlan, plan_converted
from torchsurgery.offloading.stats import OffloadStats
from torchsurgery.offloading.streams import StartForward, Streaming

__all__ = ["offload", "OffloadHandle", "OffloadStats", "DEFAULT_SKIP", "OffloadRecord", "offload_converted"]

_WHAT = "torchsurgery.offload"


class OffloadRecord(_undo.Record):
    """The undo-log entry of an offloaded model."""

    kind = "offload"

    def __init__(self, handle: OffloadHandle) -> None:
        super().__init__()
        self.handle = handle

    def describe(self) -> str:
        s = self.handle.stats()
        tiers = [g.tier for g in self.handle.plan.groups] if self.handle.plan.storage is not None else []
        part = f", {tiers.count('split')} in part" if "split" in tiers else ""
        read = f"; from the file: {tiers.count('host')} kept in host memory{part}, {tiers.count('disk')} read every forward" if tiers else ""
        return f"offload to {self.handle.device} ({len(s.streamed_groups)} streamed, {len(s.resident_groups)} resident groups{read})"

    def undo(self, module: nn.Module) -> None:
        self.handle.remove()


def _gone() -> None:
    """The model of a handle that no longer refers to one."""
    return None


class OffloadHandle:
    """An offloaded model: its plan, its statistics, and the exact undo.

    Made by :func:`offload`, which installs :attr:`plan` through it. Also a context
    manager: the offload is removed when the block exits.

    Attributes:
        device: where it computes.
        plan: the :class:`~torchsurgery.offloading.plan.OffloadPlan` that was installed
            (groups made resident after the first forward show in :meth:`stats`).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> model = nn.Sequential(nn.Linear(4, 4))
        >>> weight = model[0].weight
        >>> handle = torchsurgery.offload(model, storage_dtype=torch.float16, dtype=torch.float32)
        >>> handle.active, weight.dtype, weight.stored.dtype, handle.plan.params[0].residency.value
        (True, torch.float32, torch.float16, 'narrow')
        >>> handle.remove() is model, model[0].weight is weight, weight.dtype
        (True, True, torch.float32)
    """

    def __init__(self, model: nn.Module, plan: OffloadPlan, options: dict[str, Any] | None = None) -> None:
        self._model: nn.Module | None = model  # held while the offload is active
        self._model_ref: Callable[[], nn.Module | None] = weakref.ref(model)
        self.plan = plan
        # what offload() was given, and the dtypes the user converted parameters to since
        # (by id): a conversion plans the offload again with both
        self._options: dict[str, Any] = dict(options or {})
        self.converted: dict[int, torch.dtype] = {}
        self.device = plan.device
        self._stats = OffloadStats()
        self._streaming = Streaming(plan.offload_device, self._stats, plan.prefetch)
        self._attached = Attachments()
        self._originals = Originals()  # every tensor the offload changed, in order
        self._file: CheckpointValues | None = None
        self._reads = ReadContext(self._stats, Scratch())
        self._hold: _undo.Hold | None = None
        self._record: OffloadRecord | None = None

    @property
    def model(self) -> nn.Module | None:
        """The offloaded model. A removed handle does not keep it alive: after :meth:`remove`,
        the model while something else refers to it, else ``None``."""
        return self._model if self._model is not None else self._model_ref()

    @property
    def _live(self) -> nn.Module:
        """The model, while the handle holds it (installing, active, removing)."""
        assert self._model is not None, "the handle is removed"
        return self._model

    def __getstate__(self) -> dict[str, Any]:
        # copied with its model (the undo log holds it): weak references do not pickle
        return {k: v for k, v in self.__dict__.items() if k != "_model_ref"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._model_ref = weakref.ref(self._model) if self._model is not None else _gone

    def stats(self) -> OffloadStats:
        """A snapshot of the statistics (waits for the timing events of the groups that ran)."""
        stats = self._streaming.snapshot(self._reads.scratch.nbytes())
        slow = self._file.hint(str(self.plan.storage)) if self._file is not None else ""
        stats.hint = "; ".join(h for h in (stats.hint, slow) if h)
        return stats

    @property
    def active(self) -> bool:
        """Whether the offload is still in place."""
        return self._record is not None

    def __enter__(self) -> OffloadHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.active:
            self.remove()

    def _install(self) -> None:
        """Install :attr:`plan` on the model; on any failure, undo what was done and raise."""
        named = dict(self._live.named_modules())
        try:
            if self.plan.storage is not None:
                self._file = CheckpointValues.open(self.plan.storage, self.plan.params)
                self._file.check_holds(self.plan, named)
            parts = (self._originals, self._streaming, self._attached, self._reads, self._file)
            Installer(self.plan, named, *parts).install()
            if self._file is not None:
                self._read_ahead()
        except BaseException:
            self._record = OffloadRecord(self)
            _undo.push(self._live, self._record)
            self.remove()
            raise
        finally:
            self._originals.installed()
        model, plan = self._live, self.plan
        measured = MeasuredResidency(plan, named, self._streaming, self._attached.streamers, self._originals, self._reads)
        after_first = measured if plan.measured_budget is not None else None
        self._attached.hook_forwards(model, self._streaming, after_first)
        self._hold = _undo.hold([p.lookup_in(named) for p in plan.params], "an active offload")
        self._attached.guard_conversions(named, weakref.WeakMethod(self._convert_subtree), self._streaming.lock)
        self._record = OffloadRecord(self)
        _undo.push(model, self._record)

    def _read_ahead(self) -> None:
        """Read the groups streamed from the checkpoint ahead of use; keep the host tier's
        (:mod:`~torchsurgery.offloading.file_reader`) within the host budget (a pool's account, shared)."""
        plan, streaming = self.plan, self._streaming
        shared = self._options.get("host_budget")
        account = shared if isinstance(shared, HostAccount) else HostAccount(plan.host_budget)
        host = {g.name: g.host_bytes for g in plan.groups if g.host_bytes}
        packed = [p for p in streaming.packed.values() if p.from_file]
        # a buffer more than the ring's slots: one group computes, one lands, one is read
        streaming.reader = FileReader(packed, host, account, plan.offload_device, streaming.order, self._stats,
                                      read_buffers(plan.prefetch, plan.offload_device.host_compute), functools.partial(retier, plan.groups))
        if streaming.ring is not None:
            streaming.ring.reader = streaming.reader

    def _convert_subtree(self, module: nn.Module, name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> bool:
        """``module.to(dtype)``, ``.half()``... while offloaded, taken as the plain module takes it
        (:mod:`~torchsurgery.offloading.conversion`); ``False`` once the offload is removed.

        Raises:
            RuntimeError: a move to another device; a model streamed from a checkpoint file;
                a conversion while a streamed group runs (inside its forward). Nothing changed.
        """
        if not self.active:
            return False
        label = f"{name or '<root>'} ({type(module).__name__})"
        changes = dtype_changes(module, fn, self.device, label)
        if not changes:
            return True
        check_convertible(label, self.plan, self._attached.streamers)
        params = {id(p) for p in module.parameters()}
        converted = {**self.converted, **{k: d for k, (_, _, d) in changes.items() if k in params}}
        model, seam = self._live, self.plan.offload_device
        options = grown_budget(model, self.plan, self._options, converted)
        # the converted model must be offloadable again within the budget: checked before
        # anything changes (a refusal leaves the model as it was, offloaded)
        plan_converted(model, seam, converted, offloaded_ok=True, **options)
        warn_if_unscaled(self.plan, dict(model.named_modules()), changes)
        # the lock (held by this thread: see Conversion) is kept, and forwards starting meanwhile wait for it,
        # and so do conversions of other threads (see Reinstalling)
        lock, guard = self._streaming.lock, model.register_forward_pre_hook(StartForward(self._streaming), prepend=True)
        before = (self.plan, self._options, self.converted)
        try:
            # the stand-ins first: a .to() of another thread never finds the plain method between the two
            Attachments.hold_conversions(model, lock)
            self.remove()
            undo = convert_values(module, changes, fn)
            try:
                self._reinstall(model, plan_converted(model, seam, converted, **options), options, converted, lock)
            except BaseException:
                # (the failed installation removed itself): the model as it was, offloaded as it was
                undo()
                self._reinstall(model, *before, lock)
                raise
        finally:
            Attachments.end_hold(model)
            guard.remove()
        return True

    def _reinstall(
        self, model: nn.Module, plan: OffloadPlan, options: dict[str, Any], converted: dict[int, torch.dtype], lock: ForwardLock
    ) -> None:
        """Install ``plan`` on ``model`` again on this handle (references to it stay valid), keeping ``lock``."""
        OffloadHandle.__init__(self, model, plan, options)
        self._streaming.lock = lock
        self.converted = converted
        self._install()

    def remove(self) -> nn.Module:
        """Undo the offload: hooks and patches off, every tensor back where it was.

        Each parameter is the same object again, on its device in its dtype. Its values are
        those it was stored with: rounded to ``storage_dtype`` where that is narrower
        (resident or streamed alike), the master values with a ``master_dtype``.

        All or nothing: every value to put back is read (from the checkpoint file, for
        weights streamed from one) and converted first; if that fails (a file cut short,
        out of memory), the model, its hooks and its log are exactly as before and the error
        says why. It does not wait for the graphs of forwards that recorded gradients
        (``y = model(x)`` in grad mode, ``y`` kept): each keeps the offloaded weights it
        holds until it is freed, and its backward, run before or after, gives each weight
        its gradient as the plain model's does (:mod:`~torchsurgery.offloading.pending`).
        The handle then holds neither the model (see :attr:`model`) nor device memory.

        Returns:
            The model.

        Raises:
            RuntimeError: another thread is running the model; nothing changed. Or the
                handle was removed already and its model freed since.
            torchsurgery.CheckpointError: the checkpoint file can no longer give back a
                weight it holds; nothing changed.
        """
        if self._record is None:
            model = self.model
            if model is None:
                raise RuntimeError(f"{_WHAT}.remove: this offload was removed and its model freed since; nothing to remove")
            return model
        model = self._live
        _undo.check_idle(model, f"{_WHAT}.remove")
        # copies still in flight write into the ring's buffers and read the host buffers: the ring
        # goes once they have landed, before either is released (a removal that then fails leaves
        # the next forward to make a new ring)
        self._streaming.drop_ring()
        restored = self._originals.restored_values(self._file)
        self._attached.detach()
        for tensor, replacement in restored:  # graphs that hold a weight give their gradients to it from now on
            hand_over(tensor, replacement)
        # surgery applied after the offload (an installation over a loaded model) gives back
        # these values when it is undone, not the device copies it saw
        _undo.rebase_saved(model, self._record, [tensor for tensor, _ in restored])
        self._originals.clear()
        if self._file is not None:
            self._file.close()
            self._file = None
        self._reads.scratch.clear()
        self._streaming.close()
        if self._hold is not None:
            _undo.release(self._hold)
            self._hold = None
        self._attached.release_conversions(model)
        _undo.remove(model, self._record)
        self._record = None
        self._model = None  # a removed handle does not keep the model alive
        return model


def offload(
    model: nn.Module, device: str | torch.device | OffloadDevice = "cpu", *, dtype: torch.dtype | None = None,
    storage_dtype: torch.dtype | Scaled | None = None, budget: int | str | None = None, prefetch: int = 1,
    pin_memory: bool | None = None, groups: str | Sequence[str] = "blocks",
    skip: Callable[[nn.Module, str], bool] | None = DEFAULT_SKIP, master_dtype: torch.dtype | None = None,
    storage: str | os.PathLike[str] | None = None, host_budget: int | HostAccount | None = None,
) -> OffloadHandle:
    """Keep ``model``'s weights in storage and bring each group in just before it runs.

    Args:
        model: the model (changed in place; nothing is copied).
        device: where the computation runs: ``"cpu"``, a device of the accelerator this PyTorch
            reports (``"cuda"``, ``"xpu"``, ``"mps"``, ...) or an ``OffloadDevice``.
        dtype: the compute dtype of floating weights (default: their current dtype).
        storage_dtype: the dtype weights are stored in, resident or streamed, whatever the budget (``bfloat16``,
            ``float16``, ``float8_e4m3fn``, ``float8_e5m2``, ``float32``, ``float64``; ``skip`` keeps theirs), or a
            scaled format, :class:`~torchsurgery.compact.Scaled` (fp8 or int8 values with an fp32 scale per output
            channel or per tensor) for weights of two or more dimensions: biases keep the compute dtype.
        budget: device bytes the weights may take as stored, next to the ``prefetch + 1`` largest
            streamed groups in flight. A model that fits is kept whole. Otherwise the groups that
            stream through the ring are measured on the first forward and those whose transfers
            cannot be hidden behind compute are kept resident (:func:`~torchsurgery.offloading.residency.plan_residency`);
            groups served by the CPU narrow-weight path are filled in execution order. ``None``: nothing
            resident on a CPU; on an accelerator, what is free minus a margin. ``"least"``: every group streamed.
        prefetch: how many groups ahead to bring in (in the first forward's order).
        pin_memory: pin host storage (default: on an accelerator that can).
        groups: ``"blocks"``, ``"leaves"`` or a list of qualified module names.
        skip: ``(module, name) -> bool``; selected modules keep their own dtype.
        master_dtype: for training: the parameters stay in this dtype (what the optimizer updates and gradients
            land in) and a ``storage_dtype`` copy, refreshed whenever a parameter changes, serves forwards
            without gradients. It must hold the values exactly (``remove()`` gives them back).
        storage: a safetensors checkpoint (file, sharded ``*.index.json`` or folder) holding the weights by ``state_dict``
            name: streamed groups are read from it (models larger than RAM; inference only), parameters ``meta``, a
            skeleton too; kept in the file's dtypes or a narrower ``storage_dtype``, converted as read (docs/offload.md).
        host_budget: with ``storage``: host bytes of weights kept in memory, the rest read every forward (``stats()``:
            ``storage_bytes_read``, ``peak_host_bytes``), besides the read buffers, which come first. ``None``: what is
            available less a margin, and finer groups where the buffers do not fit there (one warning; docs/offload.md).

    Returns:
        An :class:`OffloadHandle` (``plan``, ``stats()``, ``remove()``, context manager).
        :func:`~torchsurgery.plan_offload` with the same arguments shows the plan.

    Raises:
        TypeError, ValueError, RuntimeError: as :func:`~torchsurgery.plan_offload`, before anything changes.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
        >>> x = torch.randn(2, 8)
        >>> expected = model(x).detach()
        >>> with torchsurgery.offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32) as handle:
        ...     torch.allclose(model(x), expected, atol=0.05), model[0].weight.dtype, model[0].weight.stored.dtype
        (True, torch.float32, torch.bfloat16)
    """
    options = {"dtype": dtype, "storage_dtype": storage_dtype, "budget": budget, "prefetch": prefetch, "pin_memory": pin_memory,
               "groups": groups, "skip": skip, "master_dtype": master_dtype, "storage": storage, "host_budget": host_budget}
    return offload_converted(model, device, None, options)


def offload_converted(
    model: nn.Module, device: str | torch.device | OffloadDevice, converted: dict[int, torch.dtype] | None,
    options: dict[str, Any],
) -> OffloadHandle:
    """:func:`offload` with ``options`` (its keywords), the parameters in ``converted`` computing in
    the dtypes the user converted them to (by ``id``; see :meth:`OffloadHandle._convert_subtree`)."""
    plan = plan_converted(model, device, converted, **options)
    handle = OffloadHandle(model, plan, options)
    handle.converted = dict(converted or {})
    handle._install()
    return handle
