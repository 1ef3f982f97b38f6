"""``OffloadedTensor``: a weight that reads as the dtype it computes in, whatever it is stored in.

An offloaded weight stored narrower than it computes (bf16 or fp8 values of an fp32
model) must still *look* like the fp32 weight: programs read ``weight.dtype`` to cast
their activations (T5's feed-forward, about a hundred diffusers pipelines through
``unet.dtype``), PEFT creates adapters in the dtype it sees, transformers' ``model.dtype``
is the first floating parameter's. So the parameter object itself becomes an
:class:`OffloadedTensor` (through ``torch.utils.swap_tensors``, so its ``id``, the
optimizers holding it and tied references stay valid): a wrapper tensor whose
``dtype`` is the compute dtype and whose values live in :attr:`OffloadedTensor.stored`.

What happens to it:

* ``F.linear`` / ``torch.addmm`` without gradients (a decoding step, a prefill) read the
  narrow values directly (:func:`~torchsurgery.compact.narrow.narrow_product`: the native
  kernel for a few rows, a reused widening buffer beyond), so nothing weight-sized is
  allocated per call and the module's own ``forward`` runs, patched or not;
* every other operation sees the widened values (``stored.to(dtype)``), so any layer,
  any patch and any user code computes as with the plain weight; gradients come in the
  compute dtype, as for the plain weight;
* in-place writes (optimizer steps, ``load_state_dict``, ``weight[3] = 0``, also through a
  view or ``.data``) land in the stored values, rounded to the storage dtype;
* under ``torch.compile`` it is a traceable wrapper subclass (``__tensor_flatten__``):
  the graph reads the stored values and widens them, nothing of the engine runs per call.

With a master copy (``offload(master_dtype=...)``) :attr:`~OffloadedTensor.stored` holds
the master values and a narrow shadow, refreshed whenever the master changes (its version
counter), serves forwards without gradients; every forward that records gradients reads
the master.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _python_dispatch
from torch.utils._mode_utils import no_dispatch
from torch.utils._pytree import tree_map, tree_map_only

from torchsurgery.compact.narrow import Scratch, narrow_product, narrow_product_op
from torchsurgery.compact.scaled import scale_laid_out_as, scaled_product
from torchsurgery.compact.scaled_op import scaled_product_op
from torchsurgery.compact.shadows import Shadow, TracedShadow, ViewedShadow
from torchsurgery.compact.tensor_api import METHODS
from torchsurgery.compact.values import (
    COUNTER,
    READS,
    SCALE,
    SHADOW,
    STORED,
    store,
    wide,
    written_in_place,
)

__all__ = ["OffloadedTensor", "ReadContext", "own_scale"]

_ONE_BYTE_FLOATS = {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}


class ReadCounts(Protocol):
    """Where narrow reads are counted (an offload's statistics)."""

    bytes_moved: int
    transfers: int
    resident_bytes: int
    peak_device_bytes: int


@dataclass(eq=False)
class ReadContext:
    """What narrow reads of one offload share: the statistics they count into, the widening buffers."""

    stats: ReadCounts
    scratch: Scratch

    def count(self, weight: torch.Tensor, compute: torch.dtype, scale: torch.Tensor | None = None) -> None:
        """One read of ``weight`` (narrow; a scaled one with its ``scale``, broadcast as a weight keeps it)
        for a product in ``compute`` (eager forwards only)."""
        stats = self.stats
        stats.bytes_moved += weight.numel() * weight.element_size() + (0 if scale is None else _distinct_nbytes(scale))
        stats.transfers += 1
        wide = stats.resident_bytes + weight.numel() * compute.itemsize
        if wide > stats.peak_device_bytes:
            stats.peak_device_bytes = wide


def _distinct_nbytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s distinct elements: those along the dimensions it is not broadcast along
    (a per-channel scale expanded to its weight's shape: one per channel), read from its strides
    alone (a forward counts every scaled read: no view is made for it, as :func:`own_scale` makes)."""
    n = t.element_size()
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if stride:
            n *= size
    return n


class OffloadedTensor(torch.Tensor):
    """A tensor whose ``dtype`` is what it computes in while its values are stored as :attr:`stored`.

    Made by :func:`~torchsurgery.offload` (and by
    :class:`~torchsurgery.DynamicSwapInstaller` given a ``dtype``) for the weights it stores
    in another dtype; not constructed by users. ``isinstance(weight, nn.Parameter)`` holds
    for parameters; ``state_dict()`` holds :attr:`stored` (see the offload docs).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> from torchsurgery.compact import OffloadedTensor
        >>> layer = nn.Linear(4, 4)
        >>> handle = torchsurgery.offload(layer, storage_dtype=torch.bfloat16, dtype=torch.float32, groups=[""])
        >>> weight = layer.weight
        >>> isinstance(weight, OffloadedTensor), weight.dtype, weight.stored.dtype
        (True, torch.float32, torch.bfloat16)
        >>> (weight * 1).dtype, isinstance(weight, nn.Parameter)
        (torch.float32, True)
        >>> _ = handle.remove()
        >>> type(layer.weight) is nn.Parameter
        True
    """

    @staticmethod
    def __new__(
        cls,
        stored: torch.Tensor,
        dtype: torch.dtype | None = None,
        *,
        requires_grad: bool = False,
        reads: ReadContext | None = None,
        shadow: Shadow | TracedShadow | ViewedShadow | None = None,
        counter: torch.Tensor | None = None,
        offset: int | torch.SymInt = 0,
        device: torch.device | None = None,
        scale: torch.Tensor | None = None,
    ) -> OffloadedTensor:
        if dtype is None:
            # type(weight)(data, requires_grad=...): how accelerate (cpu_offload, dispatch_model) and
            # other libraries rebuild a parameter they take over, before they change anything
            raise TypeError(
                "torchsurgery: a weight of torchsurgery's offload cannot be rebuilt as type(weight)(data, ...), "
                "as accelerate's cpu_offload and dispatch_model rebuild the parameters they take over: the "
                "weight belongs to that offload, which is left as it was. Remove it first (handle.remove() or "
                "torchsurgery.restore(model)), then hand the model to the other tool, or let torchsurgery alone "
                "offload it; hooks accelerate attached before this point come off with "
                "accelerate.hooks.remove_hook_from_module(model, recurse=True)"
            )
        if not _skipped_by_the_compiler:
            _skip_in_compiled_frames()
        self: OffloadedTensor = torch.Tensor._make_wrapper_subclass(
            cls,
            stored.shape,
            strides=stored.stride(),
            storage_offset=offset,  # where a view starts in the weight's own frame, as for a plain tensor
            dtype=dtype,
            device=stored.device if device is None else device,  # where it computes: the values come there
            layout=stored.layout,
            requires_grad=requires_grad,
        )
        d = self.__dict__
        d[STORED] = stored  # a plain tensor needing no gradient (made so by the callers)
        d[READS] = reads
        d[SHADOW] = shadow
        # views and aliases made in __torch_dispatch__ (below autograd) get version counters of
        # their own: they count writes in the one of the tensor they came from
        d[COUNTER] = d[STORED] if counter is None else counter
        d[SCALE] = None if scale is None else scale.expand(stored.shape)
        return self

    @property
    def stored(self) -> torch.Tensor:
        """The values as kept: in the storage dtype, or the master values (a plain tensor)."""
        stored: torch.Tensor = self.__dict__[STORED]
        return stored

    def _narrow(self) -> torch.Tensor:
        """What a read without gradients uses: the shadow of the master values, or the stored ones."""
        d = self.__dict__
        shadow: Shadow | TracedShadow | ViewedShadow | None = d[SHADOW]
        return d[STORED] if shadow is None else shadow.current()

    @property
    def _shadow_values(self) -> torch.Tensor:
        # the narrow copy of a master weight as the compiler flattens it (refreshed first)
        shadow: Shadow | TracedShadow | ViewedShadow = self.__dict__[SHADOW]
        return shadow.current()

    def _frame(self) -> int:
        """How far the stored values' storage offset is from this tensor's (packed weights start inside a buffer)."""
        return self.__dict__[STORED].storage_offset() - self.storage_offset()

    def _rewrap(
        self,
        stored: torch.Tensor,
        *,
        shadow: Shadow | TracedShadow | ViewedShadow | None = None,
        scale: torch.Tensor | None = None,
    ) -> OffloadedTensor:
        """Another view or alias of the same values (and of the scale, for a scaled weight), reading the same way."""
        d = self.__dict__
        offset = stored.storage_offset() - self._frame()
        # a view of a normal tensor is a normal tensor, also made in inference mode (autograd
        # then gives it its base's version counter, which an inference tensor cannot take)
        with torch.inference_mode(self.is_inference()) if torch.is_inference_mode_enabled() else contextlib.nullcontext():
            return OffloadedTensor(
                stored, self.dtype, reads=d[READS], shadow=shadow, counter=d[COUNTER], offset=offset, device=self.device,
                scale=scale,
            )

    def _rehome(self, stored: torch.Tensor) -> None:
        """Keep the values in ``stored`` from now on (the same values, in new memory).

        Writes count in the new values' version counter and a master's narrow copy follows
        them: what is kept by version (a ring slot, the narrow copy) sees every later write.
        """
        d = self.__dict__
        d[STORED] = d[COUNTER] = stored.detach()
        shadow = d[SHADOW]
        if isinstance(shadow, Shadow):
            shadow.follow(d[STORED])

    def _rehome_scale(self, scale: torch.Tensor) -> None:
        """Keep a scaled weight's scale in ``scale`` from now on (the same values, in new memory,
        in the shape :func:`own_scale` gives)."""
        d = self.__dict__
        d[SCALE] = scale.detach().expand(d[STORED].shape)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        values = wide(self)
        kind = "OffloadedParameter" if isinstance(self, nn.Parameter) else "OffloadedTensor"
        return f"{kind}(stored as {self.stored.dtype}):\n{values!r}"

    # -------------------------------------------------------------- compile, copies

    # Every field that changes what the tensor computes is declared here, so that a compiled
    # graph reads what eager code reads: the stored values, the narrow copy of a master weight
    # (its no-grad products read it), the dtype it reads as and where it starts in its frame.
    def __tensor_flatten__(self) -> tuple[list[str], tuple[torch.dtype, int | torch.SymInt, torch.device]]:
        inner = [STORED] if self.__dict__[SHADOW] is None else [STORED, "_shadow_values"]
        if self.__dict__[SCALE] is not None:
            inner.append(SCALE)
        return inner, (self.dtype, self.storage_offset(), self.device)

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor],
        ctx: tuple[torch.dtype, int | torch.SymInt, torch.device],
        outer_size: Any,
        outer_stride: Any,
    ) -> OffloadedTensor:
        shadow = inner.get("_shadow_values")
        return OffloadedTensor(
            inner[STORED], ctx[0], shadow=None if shadow is None else TracedShadow(shadow), offset=ctx[1], device=ctx[2],
            scale=inner.get(SCALE),
        )

    def _stable_hash_for_caching(self) -> str:
        # the compiler's cache key for this input: what it reads as and how it is stored
        stored, shadow = self.stored, self.__dict__[SHADOW]
        narrow = "" if shadow is None else f":{shadow.copy.dtype}"
        where = "" if self.device == stored.device else f"@{self.device}"
        narrow += "" if self.__dict__[SCALE] is None else ":scaled"
        return f"OffloadedTensor:{self.dtype}{where}:{stored.dtype}{narrow}:{tuple(stored.shape)}:{stored.stride()}"

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # pickle and torch.save: the stored values (torch keeps the memory they share with
        # other tensors), the reads context, the shadow's dtype, the user's attributes
        d = self.__dict__
        shadow: Shadow | None = d[SHADOW]
        extras = {k: v for k, v in d.items() if k not in (STORED, READS, SHADOW, COUNTER, SCALE)}
        shadow_dtype = shadow.copy.dtype if shadow is not None else None
        stored: torch.Tensor = d[STORED]
        # torch's pickle cannot load fp8 values back (its legacy loader wants a typed storage):
        # their bytes go as uint8, the same memory, and are viewed as fp8 again
        as_bytes = stored.dtype in _ONE_BYTE_FLOATS
        values = stored.view(torch.uint8) if as_bytes else stored
        device = None if self.device == stored.device else self.device
        args = (values, self.dtype, self.requires_grad, d[READS], shadow_dtype, extras, self.storage_offset(),
                stored.dtype if as_bytes else None, device, d[SCALE])
        return (_rebuild, args)

    def __deepcopy__(self, memo: dict[int, Any]) -> OffloadedTensor:
        if id(self) in memo:
            return memo[id(self)]
        d = self.__dict__
        new = OffloadedTensor(
            copy.deepcopy(d[STORED], memo),
            self.dtype,
            requires_grad=self.requires_grad,
            reads=copy.deepcopy(d[READS], memo),
            shadow=copy.deepcopy(d[SHADOW], memo),
            offset=self.storage_offset(),
            device=self.device,
            scale=copy.deepcopy(d[SCALE], memo),
        )
        new.__dict__.update(
            copy.deepcopy({k: v for k, v in d.items() if k not in (STORED, READS, SHADOW, COUNTER, SCALE)}, memo)
        )
        memo[id(self)] = new
        return new

    # -------------------------------------------------------------- operations

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():  # the handlers' reads of the weight's fields, too
            if torch.compiler.is_compiling():
                # the compiler describes the wrapper itself (its own storage) and traces every
                # op, products included, down to __torch_dispatch__: nothing of this runs per call
                return func(*args, **kwargs)
            method = METHODS.get(func)
            if method is not None:
                return method(*args, **kwargs)
            product = _PRODUCTS.get(func)
            if product is not None:
                out = product(*args, **kwargs)
                if out is not None:
                    return out
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(func, args, kwargs)
        if func.is_view and func not in _REINTERPRETS:
            return _view(func, args, kwargs)
        if func._schema.is_mutable:
            return _write(func, args, kwargs)
        return _widened(func, args, kwargs)


_skip_lock = threading.Lock()
_skipped_by_the_compiler = False


def _skip_in_compiled_frames() -> None:
    """Have the compiler run the weight's entry points as Python, once per process.

    Compiled code inlines the weight's ``__torch_function__`` into its graph. Called from
    eager code that a compiled function runs (a hook between two graphs), it would otherwise
    become a frame of its own (and so would the handlers it calls), compiled again for every
    function it handles: it runs as Python there, with every frame it calls. The same for
    ``__torch_dispatch__``, which the dispatcher calls from C++ under eager code. Done when
    the first weight is made (no frame of theirs runs before) rather than at import:
    ``torch._dynamo`` takes longer to import than torch itself, and a process that never
    makes a weight of ours needs none of it.
    """
    global _skipped_by_the_compiler
    with _skip_lock:
        if _skipped_by_the_compiler:
            return
        from torch._dynamo import eval_frame
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        for entry in ("__torch_function__", "__torch_dispatch__"):
            code = vars(OffloadedTensor)[entry].__func__.__code__
            eval_frame.set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
        _skipped_by_the_compiler = True


def _rebuild(
    stored: torch.Tensor,
    dtype: torch.dtype,
    requires_grad: bool,
    reads: ReadContext | None,
    shadow_dtype: torch.dtype | None,
    extras: dict[str, Any],
    offset: int | torch.SymInt = 0,
    byte_dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    scale: torch.Tensor | None = None,
) -> OffloadedTensor:
    """An OffloadedTensor from what :meth:`OffloadedTensor.__reduce_ex__` kept (``_is_param`` among the extras)."""
    if byte_dtype is not None:
        stored = stored.view(byte_dtype)
    t = OffloadedTensor(stored, dtype, requires_grad=requires_grad, reads=reads, offset=offset, device=device, scale=scale)
    if shadow_dtype is not None:
        t.__dict__[SHADOW] = Shadow(t.stored, shadow_dtype)
    t.__dict__.update(extras)
    return t


def _widened(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func`` on plain tensors: every OffloadedTensor among its arguments read as its values."""
    return func(*tree_map_only(OffloadedTensor, wide, args), **tree_map_only(OffloadedTensor, wide, kwargs))


def _needs_graph(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _narrow_operand(t: torch.Tensor | None) -> torch.Tensor | None:
    if isinstance(t, OffloadedTensor):
        return wide(t) if t.__dict__[SCALE] is not None else t._narrow()
    return t


def _whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor in its dtype for autograd: through one ``_to_copy`` where it needs a
    gradient (no view of it stays in the graph, so the offload can be removed while outputs
    live), else its values without a graph."""
    if not isinstance(t, OffloadedTensor):
        return t
    if torch.is_grad_enabled() and t.requires_grad:
        return torch.ops.aten._to_copy.default(t, dtype=t.dtype)
    return wide(t)


def _product(x: Any, weight: Any, bias: Any, transposed: bool) -> torch.Tensor | None:
    """``x @ W.T + b`` (``x @ W + b`` when ``transposed``) for an OffloadedTensor ``W``, or None: dispatch.

    Only for a plain input outside autocast, ``torch.func`` transforms and dispatch modes:
    those must see the plain ``linear`` first (autocast casts it, vmap batches it, ``make_fx``
    records it), as they do on a plain weight, and while ``torch.compile`` traces, inputs are
    the compiler's own tensors. In
    each case the product goes on through ``__torch_dispatch__`` (below autocast, vmap and
    autograd), where the matmul it becomes calls the narrow product operator; nothing here
    (statistics, scratch buffers) runs in compiled code.
    """
    if not (type(x) is torch.Tensor and isinstance(weight, OffloadedTensor)) or _transformed():
        return None
    d = weight.__dict__
    stored: torch.Tensor = d[STORED]
    if stored.dim() != 2 or x.dim() < 1:
        return None
    reads: ReadContext | None = d[READS]
    shadow: Shadow | None = d[SHADOW]
    # autograd (and, with a master copy, every forward that records gradients) reads the
    # stored values whole, and so do inputs the plain layer would refuse (it refuses them
    # the same way); without gradients the narrow ones are read in place
    dtype = weight.dtype
    fits = (
        x.dtype == dtype and x.device == stored.device
        and (bias is None or bias.dtype == dtype)
        and x.numel() > 0 and stored.numel() > 0  # empty products: as the plain layer computes them
    )
    grad = torch.is_grad_enabled()
    whole = not fits or (grad and (shadow is not None or _needs_graph(x, weight, bias)))
    values = stored if whole or shadow is None else shadow.current()
    if reads is not None:
        reads.count(values, dtype, d[SCALE])
    if whole:
        w, b = _whole(weight), None if bias is None else _whole(bias)
        if transposed:
            return torch.addmm(b, x, w) if b is not None else x @ w
        return F.linear(x, w, b)
    scratch = reads.scratch if reads is not None else None
    scale = d[SCALE]
    if scale is not None and not transposed and values.device.type == "cpu":  # the scale applied to the sums
        def sums(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
            return narrow_product(x, w, b, False, scratch, scale=s)

        return scaled_product(x, values, scale, _narrow_operand(bias), sums)
    if scale is not None:  # an [in, out] weight (Conv1D), whose scale runs along the sums; or on an
        # accelerator: dequantised as a streamed weight is widened into its ring slot, so that both compute alike
        values = wide(weight)
    return narrow_product(x, values, _narrow_operand(bias), transposed, scratch)


def _transformed() -> bool:
    """Whether autocast, a ``torch.func`` transform (vmap, grad) or a dispatch mode (``make_fx``,
    ``FlopCounterMode``) is active: it acts on products first, or must see them."""
    return (
        torch._C._is_any_autocast_enabled()
        or torch._C._are_functorch_transforms_active()
        or _python_dispatch._get_current_dispatch_mode() is not None
    )


def _linear(input: Any, weight: Any, bias: Any = None) -> torch.Tensor | None:
    return _product(input, weight, bias, transposed=False)


def _addmm(bias: Any, mat1: Any, mat2: Any, *, beta: float = 1, alpha: float = 1, out: Any = None) -> torch.Tensor | None:
    # transformers' Conv1D: torch.addmm(bias, x, weight) with the weight stored [in, out]
    if beta != 1 or alpha != 1 or out is not None or not isinstance(mat1, torch.Tensor) or mat1.dim() != 2:
        return None
    return _product(mat1, mat2, bias, transposed=True)


_PRODUCTS: dict[Callable[..., Any], Callable[..., torch.Tensor | None]] = {F.linear: _linear, torch.addmm: _addmm}


# ------------------------------------------------------------------ dispatch

_aten = torch.ops.aten
# views that reinterpret bytes: no view of the stored values can stand for them
_REINTERPRETS = {_aten.view.dtype, _aten.view_as_real.default, _aten.view_as_complex.default}


def _alias(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> OffloadedTensor:
    # detach (state_dict, .data, nn.Parameter) and alias: the same values, read the same way
    t: OffloadedTensor = args[0]
    d = t.__dict__
    return t._rewrap(t.stored, shadow=d[SHADOW], scale=d[SCALE])  # the very tensor: its version counter too


def _in_stored_frame(t: OffloadedTensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """as_strided's arguments for the stored values: its storage offset counts from the tensor's frame."""
    if len(args) >= 3 and args[2] is not None:
        return (*args[:2], args[2] + t._frame(), *args[3:]), kwargs
    if kwargs.get("storage_offset") is not None:
        return args, {**kwargs, "storage_offset": kwargs["storage_offset"] + t._frame()}
    return args, kwargs


def _view(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # a view of the stored values, so writes through it land in them (weight[3] = 0)
    t: OffloadedTensor = args[0]
    rest = tree_map_only(OffloadedTensor, wide, args[1:])
    kwargs = tree_map_only(OffloadedTensor, wide, kwargs)
    scale = t.__dict__[SCALE]
    if scale is not None:  # the same view of the values and of their scale
        if func is _aten.as_strided.default:  # the values' strides are not the scale's: no view of both
            return _widened(func, args, kwargs)
        values = func(t.stored, *rest, **kwargs)
        try:
            scales = func(scale, *rest, **kwargs)
        except RuntimeError:  # a view the values take but the broadcast scale cannot (w.view(-1) per channel)
            scales = func(scale.contiguous(), *rest, **kwargs)  # a scale per value: the same numbers
        if isinstance(values, torch.Tensor):
            return t._rewrap(values, scale=scales)
        return [t._rewrap(v, scale=s) for v, s in zip(values, scales, strict=True)]  # split, unbind
    in_stored = _in_stored_frame(t, rest, kwargs) if func is _aten.as_strided.default else (rest, kwargs)
    out = func(t.stored, *in_stored[0], **in_stored[1])
    shadow = t.__dict__[SHADOW]
    if shadow is None or torch.is_grad_enabled():  # a product with grad reads the master, as eager does
        return tree_map_only(torch.Tensor, t._rewrap, out)
    # without gradients the same view of the narrow copy serves products (a compiled F.linear
    # multiplies by weight.t())
    viewed = ViewedShadow(shadow, func, rest, kwargs)
    return tree_map_only(torch.Tensor, lambda v: t._rewrap(v, shadow=viewed), out)


_RESIZES = {_aten.resize_.default, _aten.resize_as_.default}


def _reshape_in_place(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> OffloadedTensor:
    # t_, squeeze_, as_strided_, resize_...: the stored values seen through a tensor of t's own
    # take the new shape (aliases sharing t's stored tensor, w and w.data, keep theirs, as
    # plain tensors do), and the wrapper takes it too (its metadata only, nothing dispatched)
    t: OffloadedTensor = args[0]
    rest = tree_map_only(OffloadedTensor, wide, args[1:])
    in_stored = _in_stored_frame(t, rest, kwargs) if func is _aten.as_strided_.default else (rest, kwargs)
    scale = t.__dict__[SCALE]
    if scale is not None:  # the scale takes the same shape: where strides or the storage are given, in the values' layout
        laid_out = func in _RESIZES or func is _aten.as_strided_.default
        scale = scale_laid_out_as(scale, t.stored) if laid_out else _aten.alias.default(scale)
    reshaped = _aten.alias.default(t.stored)
    func(reshaped, *in_stored[0], **in_stored[1])
    t.__dict__[STORED] = reshaped  # writes still counted in t's counter
    if scale is not None:
        func(scale, *in_stored[0], **in_stored[1])
        t.__dict__[SCALE] = scale
    with no_dispatch():
        func(t, *args[1:], **kwargs)
    written_in_place(t)
    return t


def _copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    dst, src = args[0], args[1]
    src_values = src.stored if isinstance(src, OffloadedTensor) else src  # its values exactly, not widened
    if isinstance(src, OffloadedTensor) and src.__dict__[SCALE] is not None:
        src_values = wide(src)  # q alone is not the values
    if isinstance(dst, OffloadedTensor) and dst.__dict__[SCALE] is not None:
        store(dst, src_values)
        written_in_place(dst)
        return dst
    if isinstance(dst, OffloadedTensor):
        dst.stored.copy_(src_values, **kwargs)  # rounded to the storage dtype, no widened copy
        written_in_place(dst)
        return dst
    return dst.copy_(src_values, **kwargs)


def _as_read(t: OffloadedTensor, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` of a conversion or factory, with the dtype and device ``t`` reads as where they give none."""
    if kwargs.get("dtype") is None:
        kwargs = {**kwargs, "dtype": t.dtype}
    if kwargs.get("device") is None:
        kwargs = {**kwargs, "device": t.device}
    return kwargs


def _to_copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    t: OffloadedTensor = args[0]
    return func(t.stored if t.__dict__[SCALE] is None else wide(t), **_as_read(t, kwargs))


def _decomposed(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # Tensor.to reaches here whole in inference mode (no autograd layer decomposes it first): as
    # PyTorch computes it, the tensor itself where nothing changes, else a _to_copy (above)
    return func.decompose(*args, **kwargs)


def _like(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    # empty_like & co. read only the shape: no widened copy
    t: OffloadedTensor = args[0]
    return func(t.stored, *args[1:], **_as_read(t, kwargs))


def _written(schema: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[int]:
    """ids of the OffloadedTensors a mutable op writes (its ``Tensor(a!)`` arguments)."""
    ids: set[int] = set()
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, OffloadedTensor):
                ids.add(id(t))
    return ids


def _write(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # in-place ops and out= (optimizer steps, edits): computed in the compute dtype, the
    # result stored back (rounded to the storage dtype); the op returns the tensors it wrote
    if func in _RESIZES or torch.Tag.inplace_view in func.tags:
        return _reshape_in_place(func, args, kwargs)
    written = _written(func._schema, args, kwargs)
    targets: dict[int, tuple[OffloadedTensor, torch.Tensor]] = {}

    def unwrap(t: OffloadedTensor) -> torch.Tensor:
        if id(t) not in written:
            return wide(t)
        # already in the compute dtype where it computes: written directly; else a widened
        # copy (on the device it reads as), stored back after
        plain = wide(t)
        targets[id(plain)] = (t, plain)
        return plain

    out = func(*tree_map_only(OffloadedTensor, unwrap, args), **tree_map_only(OffloadedTensor, unwrap, kwargs))
    for t, plain in targets.values():
        if plain is not t.stored:
            store(t, plain)
        written_in_place(t)
    return tree_map(lambda o: targets[id(o)][0] if isinstance(o, torch.Tensor) and id(o) in targets else o, out)


def _matmul(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # what F.linear becomes in a graph torch.compile traces (mm or addmm by a transposed view
    # of the weight): the narrow product as one operator, which reads the narrow values at run
    # time, instead of a widened copy of the weight made in the graph at every call (measured in
    # docs/benchmarks.md, "Compiled": several times slower than eager that way)
    # (below autograd, as all of __torch_dispatch__: a graph that records gradients keeps mm's
    # own backward, which multiplies by the weight through here again)
    bias, x, w = (None, *args) if func is _aten.mm.default else args
    if (
        isinstance(w, OffloadedTensor) and not isinstance(x, OffloadedTensor)
        and all(v in (None, 1) for v in (kwargs.get("beta"), kwargs.get("alpha")))
    ):
        values = w._narrow()
        # a product that records gradients multiplies by the widened values, as eager does; so
        # does one a backward pass computes (grad @ W): eager's backward multiplies by the widened
        # copy its forward saved, with the CPU's matmul, whose order of sums the kernel's is not
        if (
            not torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1
            and values.dtype != x.dtype and values.device == x.device
            and values.dim() == 2 and x.dim() == 2
        ):
            narrow_bias = _narrow_operand(bias)  # as eager reads it: a master bias through its narrow copy
            if w.__dict__[SCALE] is not None:
                scaled = _scaled_matmul(x, w, narrow_bias)
                return scaled if scaled is not None else _widened(func, args, kwargs)
            if values.t().is_contiguous():  # W.T of an [out, in] weight: nn.Linear
                return narrow_product_op(x, values.t(), narrow_bias, False)
            if values.is_contiguous():  # an [in, out] weight (Conv1D)
                return narrow_product_op(x, values, narrow_bias, True)
    return _widened(func, args, kwargs)


def _scaled_matmul(x: torch.Tensor, w: OffloadedTensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """A compiled product by a scaled weight as its eager forward takes it on the host (an
    ``nn.Linear``'s ``W.T``, one scale per output): the sums of ``q``, scaled; else None (dequantised)."""
    values, scale = w.stored, w.__dict__[SCALE]
    if values.device.type != "cpu" or not values.t().is_contiguous() or scale.t().stride(1) != 0:
        return None
    return scaled_product_op(x, values.t(), scale.t()[:, 0].contiguous(), bias)


_HANDLERS: dict[Any, Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]] = {
    _aten.detach.default: _alias,
    _aten.alias.default: _alias,
    _aten.copy_.default: _copy,
    _aten._to_copy.default: _to_copy,
    **dict.fromkeys([_aten.to.dtype, _aten.to.device, _aten.to.dtype_layout, _aten.to.other], _decomposed),
    _aten.mm.default: _matmul,
    _aten.addmm.default: _matmul,
    **dict.fromkeys(
        [_aten.empty_like.default, _aten.zeros_like.default, _aten.ones_like.default, _aten.full_like.default,
         _aten.rand_like.default, _aten.randn_like.default],
        _like,
    ),
}


# ------------------------------------------------------------------ a scaled weight's scale


def own_scale(tensor: torch.Tensor) -> torch.Tensor | None:
    """A scaled weight's scale with one element per distinct value (per tensor ``[1, 1]``, per channel
    ``[out, 1]``), a view of it: writing it rescales the weight. ``None`` for every other tensor.

    Example:
        >>> import torch
        >>> from torchsurgery.compact.tensor import own_scale
        >>> own_scale(torch.ones(2)) is None
        True
    """
    if not isinstance(tensor, OffloadedTensor) or tensor.__dict__[SCALE] is None:
        return None
    scale: torch.Tensor = tensor.__dict__[SCALE]
    # one element along each dimension it is broadcast along (stride 0); a dimension of one
    # element takes stride 1, so that the view reads as plain memory (its bytes can be kept)
    shape = [1 if stride == 0 else size for size, stride in zip(scale.shape, scale.stride(), strict=True)]
    strides = [1 if size == 1 else stride for size, stride in zip(shape, scale.stride(), strict=True)]
    return scale.as_strided(shape, strides, scale.storage_offset())
