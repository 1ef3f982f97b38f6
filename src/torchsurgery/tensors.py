"""Convert and load a module's tensors while every reference to them stays valid.

``nn.Module.to()`` keeps parameter objects only when PyTorch's swap flag is set, and
replaces buffers even then; ``load_state_dict(assign=True)`` gives the module new
parameter objects and unties tied weights. Optimizers, hooks and user code holding the
old objects then silently work on dead tensors. Here every parameter and buffer keeps
its Python identity: new data is put into the existing object with
:func:`torch.utils.swap_tensors`, or copied into it in place.

Every operation checks all it can before changing anything, and puts back what it had
changed if something still fails half-way, so a module is never left half converted.
"""

from __future__ import annotations

import contextlib
import difflib
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple, TypeVar

import torch
from torch import nn

from torchsurgery import _undo
from torchsurgery._checkpoint import CheckpointError, Entry, Source, Stash, open_source
from torchsurgery._swap import swap_blocker as _swap_blocker
from torchsurgery._swap import wrap_like as _wrap_like
from torchsurgery._validate import check_device, check_dtype

__all__ = ["swap_on_conversion", "convert_", "load_", "LoadResult", "skeleton", "CheckpointError"]

M = TypeVar("M", bound=nn.Module)

_flag_lock = threading.Lock()
_flag_depth = 0
_flag_saved = False


@contextlib.contextmanager
def swap_on_conversion() -> Iterator[None]:
    """Make ``module.to()``/``.half()``/``load_state_dict`` use ``swap_tensors`` inside the block.

    Sets ``torch.__future__.set_swap_module_params_on_conversion(True)`` and restores the
    previous value on exit, also on an exception; nested and concurrent blocks keep the
    flag on until the last one exits.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> layer = nn.Linear(2, 2)
        >>> weight = layer.weight
        >>> with torchsurgery.swap_on_conversion():
        ...     _ = layer.half()
        >>> layer.weight is weight, layer.weight.dtype
        (True, torch.float16)
    """
    global _flag_depth, _flag_saved
    with _flag_lock:
        if _flag_depth == 0:
            _flag_saved = torch.__future__.get_swap_module_params_on_conversion()
            torch.__future__.set_swap_module_params_on_conversion(True)
        _flag_depth += 1
    try:
        yield
    finally:
        with _flag_lock:
            _flag_depth -= 1
            if _flag_depth == 0:
                torch.__future__.set_swap_module_params_on_conversion(_flag_saved)


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """Each distinct parameter and buffer once, as (first qualified name, tensor, is_param)."""
    seen: set[int] = set()
    found: list[tuple[str, torch.Tensor, bool]] = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            found.append((name, p, True))
    for name, b in module.named_buffers(remove_duplicate=False):
        if id(b) not in seen:
            seen.add(id(b))
            found.append((name, b, False))
    return found


@contextlib.contextmanager
def _own_weakrefs_released(module: nn.Module) -> Iterator[None]:
    """Drop the weak references RNN modules keep to their own weights while we swap them.

    ``nn.RNNBase`` keeps ``_flat_weight_refs`` (weakrefs to its parameters), which
    ``swap_tensors`` refuses; PyTorch's own ``_apply`` clears and rebuilds them likewise.
    """
    rnns = [m for m in module.modules() if isinstance(m, nn.RNNBase)]
    for rnn in rnns:
        rnn._flat_weight_refs = []
    try:
        yield
    finally:
        for rnn in rnns:
            rnn._init_flat_weights()


def _converted(t: torch.Tensor, device: torch.device | None, dtype: torch.dtype | None, non_blocking: bool) -> torch.Tensor:
    target_dtype = dtype if dtype is not None and (t.is_floating_point() or t.is_complex()) else t.dtype
    if t.is_meta and device is not None and device.type != "meta":
        # nothing to copy out of a meta tensor: allocate, as Module.to_empty does
        return torch.empty_like(t, device=device, dtype=target_dtype)
    return t.detach().to(device=device or t.device, dtype=target_dtype, non_blocking=non_blocking)


def convert_(
    module: M,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    non_blocking: bool = False,
) -> M:
    """Move and/or cast ``module``'s parameters and buffers in place, keeping every object.

    Each parameter and buffer keeps its ``id`` (buffers too, unlike ``module.to()``),
    tied parameters stay one object, ``.grad`` is converted with its parameter, and with
    ``optimizer`` its state tensors (Adam's ``exp_avg``...) follow, so training goes on.
    Only floating point and complex tensors change dtype, as with ``module.to(dtype)``.
    ``meta`` tensors moved to a real device are allocated uninitialised, as
    ``module.to_empty(device=...)`` does (fill them with :func:`load_`).

    All or nothing: every swap is checked before the first one (weak references,
    extra holders such as a pending backward, slot mismatches), and if a conversion
    still fails half-way, the tensors already converted are swapped back.

    Args:
        module: the module to convert.
        device: the target device; ``None`` keeps each tensor's device.
        dtype: the target floating point dtype; ``None`` keeps each dtype.
        optimizer: an optimizer over (some of) the module's parameters.
        non_blocking: passed to ``Tensor.to``.

    Returns:
        ``module`` itself.

    Raises:
        TypeError: an argument is of the wrong kind.
        ValueError: ``device`` or ``dtype`` is not usable.
        RuntimeError: a tensor cannot be swapped; the message names it, the cause and the fix.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> bn = nn.BatchNorm1d(3)
        >>> mean = bn.running_mean
        >>> _ = torchsurgery.convert_(bn, dtype=torch.float64)
        >>> bn.running_mean is mean, bn.running_mean.dtype
        (True, torch.float64)
    """
    what = "torchsurgery.convert_"
    _undo.check_not_compiling("convert_")
    _undo.check_module(module, what)
    target_device = check_device(device, what)
    target_dtype = check_dtype(dtype, what, complex_ok=True)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{what}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")

    with _own_weakrefs_released(module):
        _convert(module, target_device, target_dtype, non_blocking, what)
    if optimizer is not None:
        _convert_optimizer_state(optimizer, target_device, target_dtype, non_blocking)
    return module


def _convert(
    module: nn.Module, target_device: torch.device | None, target_dtype: torch.dtype | None, non_blocking: bool, what: str
) -> None:
    plan: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    for name, t, _is_param in _named_tensors(module):
        if (target_device is None or t.device == target_device) and (
            target_dtype is None or t.dtype == target_dtype or not (t.is_floating_point() or t.is_complex())
        ):
            continue
        problem = _swap_blocker(name, t, None, what)
        if problem:
            raise RuntimeError(problem)
        plan.append((name, t, _wrap_like(t, _converted(t, target_device, target_dtype, non_blocking))))
    for name, t, new in plan:
        problem = _swap_blocker(name, t, new, what)
        if problem:
            raise RuntimeError(problem)

    done: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    try:
        for name, t, new in plan:
            grad = t.grad
            if grad is not None:
                t.grad = None  # the grad slot counts as a holder for swap_tensors
            try:
                torch.utils.swap_tensors(t, new)
            except Exception as exc:
                if grad is not None:
                    t.grad = grad
                raise RuntimeError(f"{what}: swapping {name!r} failed: {exc}") from exc
            done.append((t, new, grad))
            if grad is not None:
                t.grad = _converted(grad, target_device, target_dtype, non_blocking)
    except BaseException:
        for t, old, grad in reversed(done):
            t.grad = None
            torch.utils.swap_tensors(t, old)
            t.grad = grad
        raise


def _convert_optimizer_state(
    optimizer: torch.optim.Optimizer, device: torch.device | None, dtype: torch.dtype | None, non_blocking: bool
) -> None:
    for param, state in optimizer.state.items():
        if not isinstance(param, torch.Tensor):
            continue
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or key == "step":
                continue  # the step counter keeps its dtype and device, as in Optimizer.load_state_dict
            cast = param.dtype if (value.is_floating_point() or value.is_complex()) and dtype is not None else None
            state[key] = value.to(device=device or param.device, dtype=cast, non_blocking=non_blocking)


class LoadResult(NamedTuple):
    """What :func:`load_` could not match.

    Attributes:
        missing_keys: module keys absent from the checkpoint (tied names count as present
            when any name of the tie is).
        unexpected_keys: checkpoint keys the module does not have.

    Example:
        >>> from torch import nn
        >>> import torchsurgery
        >>> torchsurgery.load_(nn.Linear(2, 2), {"weight": nn.Linear(2, 2).weight}, strict=False)
        LoadResult(missing_keys=['bias'], unexpected_keys=[])
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


def _suggest(key: str, names: list[str]) -> str:
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _kind(dtype: torch.dtype) -> str:
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "float"
    return "bool" if dtype == torch.bool else "int"


def _load_errors(
    missing: list[str], unexpected: list[str], mismatched: list[str], strict: bool, ckpt_keys: list[str], module_keys: list[str]
) -> str | None:
    lines = []
    if strict:
        lines += [f"  missing: {k!r}{_suggest(k, unexpected or ckpt_keys)}" for k in missing]
        lines += [f"  unexpected: {k!r}{_suggest(k, missing or module_keys)}" for k in unexpected]
    lines += [f"  {m}" for m in mismatched]
    if not lines:
        return None
    return "torchsurgery.load_: the checkpoint does not fit the module; nothing was loaded:\n" + "\n".join(lines)


def load_(
    module: nn.Module,
    source: Any,
    *,
    strict: bool = True,
    assign: bool = False,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    copy: bool = False,
) -> LoadResult:
    """Load a checkpoint into ``module`` in place, keeping every object.

    Parameters and buffers keep their ``id`` (optimizers built before loading keep
    working); real tensors receive the values in place (``data_ptr`` unchanged unless
    the device or dtype changes); ``meta`` tensors (from :func:`skeleton`) are
    materialised on ``device``. Tied weights stay tied whether the checkpoint names one
    or both of their names. Tensor subclasses are honoured through
    ``Tensor.module_load``: with ``assign=False`` the module's subclass decides, with
    ``assign=True`` the checkpoint's tensor (and class) is taken.

    **File-backed tensors.** A ``meta`` tensor (or, with ``assign=True``, any tensor)
    that would get the stored bytes unchanged (CPU, same dtype, aligned in the file)
    is not copied: it becomes a view of a private memory map of the safetensors file
    (of the ``torch.load(mmap=True)`` map for ``.pt`` files; of the state dict's own
    tensor for a state dict). Loading is then nearly free; pages come from the page
    cache when first used and are the system's file cache, shared and dropped under
    memory pressure, not the process's own memory; writing to such a tensor (training,
    ``mul_``) copies only the pages written into private memory; the file never changes. The file must stay where it is and
    unchanged while the model lives: deleting or replacing it (a new file renamed over
    it) is safe, but rewriting it in place changes the values of pages not yet
    written, and truncating it makes the process crash (SIGBUS) when a lost page is
    used. ``copy=True`` gives every loaded tensor memory of its own instead.

    Real tensors are read in bulk (``os.preadv``, several tensors per system call,
    threads for large or sharded checkpoints on machines with 4 or more cores). Every key, shape and the file's
    header are checked before the first write, and the values about to be overwritten
    are kept aside, so a load that fails for any reason (an I/O error, a file cut
    short after its header was read, ``KeyboardInterrupt``) leaves every tensor
    exactly as it was.

    Args:
        module: the module to load into.
        source: a state dict, a ``.safetensors`` file, a sharded ``*.index.json``, a
            ``.pt``/``.pth``/``.bin`` file (read with ``torch.load(weights_only=True)``),
            or a directory holding one of those under its usual name.
        strict: raise when keys are missing or unexpected (shape mismatches always raise).
        assign: take the checkpoint's tensors instead of copying into the module's.
        device: where ``meta`` tensors are materialised, and where all tensors go when given.
        dtype: cast floating point tensors to this dtype.
        copy: give new tensors memory of their own rather than file-backed views.

    Returns:
        A :class:`LoadResult` with the missing and unexpected keys.

    Raises:
        RuntimeError: keys or shapes do not fit (all are listed at once, with near names).
        CheckpointError: the file is truncated, corrupt, crafted or unsafe.
        FileNotFoundError: the file does not exist.
        TypeError: an argument is of the wrong kind.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> src, dst = nn.Linear(2, 2), nn.Linear(2, 2)
        >>> weight = dst.weight
        >>> torchsurgery.load_(dst, src.state_dict())
        LoadResult(missing_keys=[], unexpected_keys=[])
        >>> dst.weight is weight and torch.equal(dst.weight, src.weight)
        True
    """
    what = "torchsurgery.load_"
    _undo.check_not_compiling("load_")
    _undo.check_module(module, what)
    target_device = check_device(device, what)
    target_dtype = check_dtype(dtype, what, complex_ok=True)
    if not isinstance(copy, bool):
        raise TypeError(f"{what}: copy must be True or False, got {copy!r}")
    reader = open_source(source, what)
    try:
        with _own_weakrefs_released(module):
            return _load(module, reader, strict, assign, target_device, target_dtype, copy, what)
    finally:
        reader.close()


class _Fresh(NamedTuple):
    """A tensor that gets new memory (then swapped in): what it becomes and from which key."""

    name: str
    tensor: torch.Tensor
    key: str
    device: torch.device
    dtype: torch.dtype


_STAGE_BYTES = 256 * 1024 * 1024  # tensors converted after reading are read this many bytes at a time


def _in_chunks(items: list[Any], sizes: list[int]) -> Iterator[list[Any]]:
    """``items`` in runs of about ``_STAGE_BYTES`` (one item may exceed it alone)."""
    run: list[Any] = []
    total = 0
    for item, size in zip(items, sizes, strict=True):
        if run and total + size > _STAGE_BYTES:
            yield run
            run, total = [], 0
        run.append(item)
        total += size
    if run:
        yield run


def _load(
    module: nn.Module,
    reader: Source,
    strict: bool,
    assign: bool,
    device: torch.device | None,
    dtype: torch.dtype | None,
    copy: bool,
    what: str,
) -> LoadResult:
    stored: dict[str, Entry] = reader.entries()
    state = module.state_dict(keep_vars=True)
    # group the module's keys by tensor, so tied weights are one entry with several names
    groups: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for key, t in state.items():
        groups.setdefault(id(t), (t, []))[1].append(key)
    missing, mismatched = [], []
    plan: list[tuple[str, torch.Tensor, str]] = []  # (qualified name, tensor, checkpoint key)
    for t, names in groups.values():
        present = [n for n in names if n in stored]
        if not present:
            missing.extend(names)
            continue
        key = present[0]
        if stored[key].shape != tuple(t.shape):
            mismatched.append(
                f"shape of {key!r}: checkpoint {list(stored[key].shape)}, module {list(t.shape)}"
            )
            continue
        if _kind(stored[key].dtype) != _kind(t.dtype):
            # float <-> float casts are fine; integers or booleans into floats (or back) are not
            mismatched.append(f"dtype of {key!r}: checkpoint {stored[key].dtype}, module {t.dtype}")
            continue
        plan.append((names[0], t, key))
    claimed = {n for _, names in groups.values() for n in names}
    unexpected = sorted(k for k in stored if k not in claimed)
    message = _load_errors(missing, unexpected, mismatched, strict, sorted(stored), sorted(state))
    if message:
        raise RuntimeError(message)
    for name, t, _ in plan:
        problem = _swap_blocker(name, t, None, what)
        if problem:
            raise RuntimeError(problem)

    in_place: list[tuple[torch.Tensor, str]] = []
    fresh: list[_Fresh] = []
    for name, t, key in plan:
        floating = t.is_floating_point() or t.is_complex()
        target_device = device or (torch.device("cpu") if t.is_meta else t.device)
        target_dtype = dtype if dtype is not None and floating else t.dtype
        plain = type(t) in (torch.Tensor, nn.Parameter)
        if plain and not assign and not t.is_meta and t.device == target_device and t.dtype == target_dtype:
            in_place.append((t, key))
        else:
            # assign=True without a dtype keeps the checkpoint's dtype
            kept = stored[key].dtype if assign and dtype is None else target_dtype
            fresh.append(_Fresh(name, t, key, target_device, kept))

    # first everything that can fail and changes nothing in the module: the new values
    # read or mapped, and the values about to be overwritten kept aside
    values = _new_values(reader, fresh, stored, assign, copy)
    stash: Stash | None = None
    swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        stash = Stash([t for t, _ in in_place])
        for run in _in_chunks(in_place, [stored[key].dtype.itemsize * t.numel() for t, key in in_place]):
            reader.read_many([(key, t.detach()) for t, key in run])
        for item, value in zip(fresh, values, strict=True):
            new = _replacement(item.tensor, value, assign)
            problem = _swap_blocker(item.name, item.tensor, new, what)
            if problem:
                raise RuntimeError(problem)
            torch.utils.swap_tensors(item.tensor, new)
            swapped.append((item.tensor, new))
    except BaseException:
        if stash is not None:
            stash.restore()
        for t, old in reversed(swapped):
            torch.utils.swap_tensors(t, old)
        raise
    finally:
        if stash is not None:
            stash.close()
    return LoadResult(sorted(missing), unexpected)


def _new_values(reader: Source, fresh: list[_Fresh], stored: dict[str, Entry], assign: bool, copy: bool) -> list[torch.Tensor]:
    """The content of each tensor in ``fresh``: mapped where it can be, else read and converted."""
    values: dict[int, torch.Tensor] = {}
    to_read: list[int] = []
    for i, item in enumerate(fresh):
        # only tensors that get new memory anyway may take the checkpoint's own
        mappable = not copy and (item.tensor.is_meta or assign) and stored[item.key].dtype == item.dtype
        value = reader.mapped(item.key) if mappable else None
        if value is not None and value.device == item.device and value.dtype == item.dtype:
            values[i] = value
        else:
            to_read.append(i)
    sizes = [stored[fresh[i].key].dtype.itemsize * fresh[i].tensor.numel() for i in to_read]
    for run in _in_chunks(to_read, sizes):
        # a run at a time, so that converting (a cast, a move to a GPU) needs only a run's
        # worth of extra memory
        taken = reader.take([fresh[i].key for i in run], copy=copy)
        for i, value in zip(run, taken, strict=True):
            values[i] = value.to(device=fresh[i].device, dtype=fresh[i].dtype)
    return [values[i] for i in range(len(fresh))]


def _replacement(t: torch.Tensor, value: torch.Tensor, assign: bool) -> torch.Tensor:
    """The object swapped into ``t`` to give it ``value``."""
    if type(t) in (torch.Tensor, nn.Parameter) and not assign:
        # a meta tensor to materialise, or a move/cast: the loaded value becomes the content
        return _wrap_like(t, value)
    # tensor subclasses decide through module_load (assign=True: the checkpoint's tensor)
    with torch.no_grad():
        loaded = t.module_load(value, assign=assign)
    return _wrap_like(t, loaded) if isinstance(t, nn.Parameter) else loaded


@contextlib.contextmanager
def skeleton(device: str | torch.device = "meta", include_buffers: bool = False) -> Iterator[None]:
    """Build models inside the block without allocating their parameters.

    Like ``with torch.device("meta")``, but buffers stay real by default: models often
    compute rotary tables or position ids in ``__init__``, and those are not in their
    checkpoints. Fill the model afterwards with :func:`load_`. Everything is put back on
    exit, also on an exception. The redirection applies to every thread while active.

    Args:
        device: where parameters are put (``"meta"``: nowhere).
        include_buffers: put buffers there too.

    Yields:
        Nothing.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import torchsurgery
        >>> with torchsurgery.skeleton():
        ...     bn = nn.BatchNorm1d(4)
        >>> bn.weight.device.type, bn.running_mean.device.type
        ('meta', 'cpu')
    """
    target = check_device(device, "torchsurgery.skeleton") or torch.device("meta")
    original_param = nn.Module.register_parameter
    original_buffer = nn.Module.register_buffer

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original_param(self, name, param)
        if param is not None and param.device != target:
            self._parameters[name] = _wrap_like(param, param.detach().to(target))  # type: ignore[assignment]

    def register_buffer(self: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        if tensor is not None and tensor.device != target:
            tensor = tensor.to(target)
        original_buffer(self, name, tensor, persistent=persistent)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    if include_buffers:
        nn.Module.register_buffer = register_buffer  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original_param  # type: ignore[method-assign]
        nn.Module.register_buffer = original_buffer  # type: ignore[method-assign]
