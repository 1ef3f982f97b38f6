"""Offloading a model straight from its checkpoint folder: :func:`from_pretrained`.

The folder's config builds the model as a :func:`~torchsurgery.skeleton` (parameters
``meta``, never given memory; buffers computed in ``__init__`` as the library's own
loading computes them: rotary tables, position ids), and :func:`~torchsurgery.offload`
streams its weights from the folder's safetensors shards. transformers models
(``PreTrainedModel`` subclasses) and diffusers models (``ModelMixin`` subclasses) are
recognised by their base classes, without importing either library here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from torchsurgery.compact import Scaled
from torchsurgery.errors import ArgumentTypeError, ArgumentValueError
from torchsurgery.offloading.engine import offload
from torchsurgery.tensors import skeleton

__all__ = ["from_pretrained"]

_WHAT = "torchsurgery.from_pretrained"
# the files save_pretrained writes, in the order their libraries look for them
_CHECKPOINT_NAMES = (
    "model.safetensors.index.json",
    "model.safetensors",
    "diffusion_pytorch_model.safetensors.index.json",
    "diffusion_pytorch_model.safetensors",
)
_PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json", "diffusion_pytorch_model.bin")

M = TypeVar("M", bound=nn.Module)


def _library(cls: Any) -> str:
    """``"transformers"`` or ``"diffusers"``: the library whose model base class ``cls`` derives from."""
    if isinstance(cls, type) and issubclass(cls, nn.Module):
        for base in cls.__mro__:
            root = base.__module__.partition(".")[0]
            if (root, base.__name__) in (("transformers", "PreTrainedModel"), ("diffusers", "ModelMixin")):
                return root
    raise ArgumentTypeError(
        _WHAT, "cls", cls,
        f"must be a transformers PreTrainedModel or a diffusers ModelMixin subclass, got {cls!r}",
        "pass the model class itself, e.g. transformers.LlamaForCausalLM or diffusers.UNet2DConditionModel",
    )


def _checkpoint_in(folder: Path) -> Path:
    """The safetensors checkpoint ``save_pretrained`` wrote in ``folder`` (its index where sharded).

    Raises:
        FileNotFoundError: ``folder`` is no directory, or holds no safetensors checkpoint.
    """
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{_WHAT}: {str(folder)!r} is not a directory; give the local folder save_pretrained wrote "
            "(a hub name: download it first, e.g. with huggingface_hub.snapshot_download)"
        )
    for name in _CHECKPOINT_NAMES:
        if (folder / name).is_file():
            return folder / name
    pickled = [name for name in _PICKLED if (folder / name).is_file()]
    fix = (
        f"it holds only {pickled}: weights are streamed by offset from safetensors files; load the model once "
        "with its library and save_pretrained(folder, safe_serialization=True)"
        if pickled else f"expected one of {list(_CHECKPOINT_NAMES)}"
    )
    raise FileNotFoundError(f"{_WHAT}: {str(folder)!r} holds no safetensors checkpoint; {fix}")


def _build(cls: Any, library: str, folder: Path, dtype: torch.dtype | None, kwargs: dict[str, Any]) -> nn.Module:
    """The model ``cls`` of ``folder``'s config, built as a skeleton (its parameters ``meta``)."""
    if library == "transformers":
        config_class = getattr(cls, "config_class", None)
        if config_class is None:
            import transformers  # only where a transformers model is given

            config_class = transformers.AutoConfig
        config, unused = config_class.from_pretrained(folder, return_unused_kwargs=True, **kwargs)
        _refuse_unused(unused, folder)
        with skeleton():  # the library's default: the config's dtype (the checkpoint's)
            model = cls._from_config(config, **({} if dtype is None else {"dtype": dtype}))
        generation = folder / "generation_config.json"
        if generation.is_file() and getattr(model, "generation_config", None) is not None:
            model.generation_config = type(model.generation_config).from_pretrained(folder)
    else:
        config = cls.load_config(folder)
        with skeleton():  # the library's default: float32, the file's values cast as they stream
            model, unused = cls.from_config(config, return_unused_kwargs=True, **kwargs)
        _refuse_unused(unused, folder)
    return model.eval()


def _refuse_unused(unused: dict[str, Any], folder: Path) -> None:
    unused = {k: v for k, v in unused.items() if not k.startswith("_")}  # diffusers' own: class and version
    if unused:
        raise ArgumentValueError(
            _WHAT, "kwargs", unused,
            f"names no setting of the config in {str(folder)!r}: {sorted(unused)}",
            "pass only config attributes to override (e.g. num_hidden_layers=2)",
        )


def _offload_options(
    dtype: torch.dtype | None, storage_dtype: torch.dtype | Scaled | None, budget: int | None, host_budget: int | None,
) -> dict[str, Any]:
    """The keywords for :func:`~torchsurgery.offload`; ``host_budget`` only where given (and taken)."""
    options: dict[str, Any] = {"dtype": dtype, "storage_dtype": storage_dtype, "budget": budget}
    if host_budget is not None:
        options["host_budget"] = host_budget
    return options


def from_pretrained(
    cls: type[M], path: str | os.PathLike[str], *, subfolder: str | None = None,
    device: str | torch.device | None = None, dtype: torch.dtype | None = None,
    storage_dtype: torch.dtype | Scaled | None = None, budget: int | None = None, host_budget: int | None = None,
    **kwargs: Any,
) -> M:
    """Build ``cls`` from the folder ``save_pretrained`` wrote and stream its weights from the folder's files.

    The config builds the model as a :func:`~torchsurgery.skeleton` (its parameters never get
    memory; buffers the checkpoint leaves out, such as rotary tables, computed by ``__init__``
    as the library's own loading does), in eval mode; :func:`~torchsurgery.offload` then reads
    each group from the folder's safetensors shards as it runs (tied weights, bf16, fp8 and
    ComfyUI's scaled fp8 files as stored, or converted to a ``storage_dtype`` as read). Host memory peaks
    a few streamed groups above the buffers. ``torchsurgery.restore(model)`` gives back the skeleton.

    Args:
        cls: a transformers ``PreTrainedModel`` subclass (its ``config_class`` or ``AutoConfig``
            reads the config) or a diffusers ``ModelMixin`` subclass (``cls.load_config``).
        path: the folder ``save_pretrained`` wrote (a local directory).
        subfolder: the model's folder inside ``path`` (diffusers pipelines: ``"unet"``).
        device: where the model computes (default: the CPU).
        dtype: the compute dtype of floating weights (default: transformers' the config's
            dtype, diffusers' float32, as their own loading gives).
        storage_dtype: the format weights are kept in (a narrow dtype or ``Scaled``), converted as they are
            read; outputs equal the in-memory ``offload`` with the same ``storage_dtype`` and ``dtype``.
        budget: device bytes the weights may take, for :func:`~torchsurgery.offload`.
        host_budget: host bytes of weights, for :func:`~torchsurgery.offload` where it takes one.
        **kwargs: config attributes to override (``num_hidden_layers=2``).

    Returns:
        The model, offloaded, in eval mode.

    Raises:
        TypeError: ``cls`` is not a transformers or diffusers model class, or a bad ``storage_dtype``.
        FileNotFoundError: no such folder, or no safetensors checkpoint in it.
        ValueError: a keyword that is no config attribute; what :func:`~torchsurgery.offload`
            refuses (a checkpoint lacking weights, a budget below the largest group).
        torchsurgery.CheckpointError: a truncated, corrupt or crafted checkpoint.

    Example:
        >>> import tempfile, torch, transformers, torchsurgery
        >>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...                                   num_hidden_layers=2, num_attention_heads=2)
        >>> folder = tempfile.mkdtemp()
        >>> transformers.LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="20KB")
        >>> model = torchsurgery.from_pretrained(transformers.LlamaForCausalLM, folder)
        >>> with torch.no_grad():
        ...     model(torch.tensor([[1, 2, 3]])).logits.shape
        torch.Size([1, 3, 64])
        >>> all(p.is_meta for p in model.parameters())  # read from the files as it runs
        True
        >>> torchsurgery.restore(model) is model
        True
    """
    library, folder = _library(cls), Path(path) / subfolder if subfolder else Path(path)
    storage, options = _checkpoint_in(folder), _offload_options(dtype, storage_dtype, budget, host_budget)
    model = _build(cls, library, folder, dtype, kwargs)
    offload(model, "cpu" if device is None else device, storage=storage, **options)
    return model  # type: ignore[return-value]
