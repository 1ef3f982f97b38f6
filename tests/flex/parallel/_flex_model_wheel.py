"""flex_model 0.1.0's own tests and examples, run from the installed wheel on CPU ranks.

The flex-model wheel installs its test suite (``_test``) and examples (``examples``) next
to its package. :func:`run_items` runs a list of them on one rank of a gloo world (the
caller spawns the ranks, as flex_model's own launcher does: every rank calls every test
in turn), against either library:

- ``"flex_model"``: the wheel's own code;
- ``"torchsurgery"``: the same, with ``flex_model``, ``flex_model.core`` and
  ``flex_model.utils`` in ``sys.modules`` replaced by module objects holding
  torchsurgery's ``FlexModel``, ``HookFunction`` and ``DummyModule`` (so ``from
  flex_model.core import FlexModel`` gets ours). Tests that import anything else of
  flex_model's do not run against torchsurgery (:data:`ITEMS` says why).

Adaptations for a CPU, the same for both libraries: ``init_process_group("nccl")`` and
``new_group(backend="nccl")`` use gloo; ``.cuda()`` is the identity and factories asked for
a CUDA device (by name or by index) make CPU tensors; ``torch.cuda.synchronize`` does
nothing; FSDP1 is told its device is the CPU and may broadcast module states from one
(its check that they sit on a GPU is skipped; the broadcast itself works on gloo). Hub
checkpoints become random-weight models of the same architecture: OPT-350m (fp32, 64 wide
but 1024 wide where a test applies a 1024-wide layer to its activations), a 32-layer
Llama-2-7b and a 40-layer, 5120-wide Llama-2-13b (thin attention and MLP, so it fits), and
their tokenizers one character per token. Nothing else of the tests changes.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import importlib.util
import inspect
import logging
import string
import sys
import time
import types
import unittest.mock
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

_SPEC = importlib.util.find_spec("flex_model")
SITE = Path(_SPEC.origin).parent.parent if _SPEC is not None and _SPEC.origin else None
"""The site-packages folder holding the wheel's ``flex_model``, ``_test`` and ``examples``."""

LIBRARIES = ("flex_model", "torchsurgery")


@dataclass(frozen=True)
class Item:
    """One test function or example of the wheel.

    Attributes:
        path: the file, relative to the site-packages folder.
        name: the test function (``""`` for an example: its ``main``).
        worlds: the numbers of ranks it runs at.
        private: why it does not run against torchsurgery (``""``: it uses only the public API).
    """

    path: str
    name: str
    worlds: tuple[int, ...]
    private: str = ""

    @property
    def id(self) -> str:
        return f"{self.path}::{self.name}" if self.name else self.path


_HOOKS = "_test/core/test_hook_function.py"
_WRAPPER = "_test/core/test_wrapper.py"
_GROUPS = "_test/core/test_hook_function_group_manager.py"
_DP = "_test/multi_gpu/core/test_dp_wrappers_vs_single_gpu.py"
_FAIRSCALE = "_test/multi_gpu/core/test_fairscale_mpu_vs_ddp.py"
_MAPPINGS = "_test/multi_gpu/distributed/test_mappings.py"
_SHARED_STATE = "reads the private `HookFunction._shared_state`"
_GROUP_MANAGER = "reads the private `FlexModel._hook_fn_group_manager`"
_MANAGER = "imports the private `flex_model.core.wrapper._HookFunctionGroupManager`"
_STATE = "imports `flex_model.distributed` (its process-group state and collectives: see below)"

ITEMS: tuple[Item, ...] = (
    *(Item(_HOOKS, f"test_{kind}_hooks", (1,)) for kind in ("forward", "full_backward", "tensor", "forward_pre", "full_backward_pre")),
    Item(_WRAPPER, "test_register_forward_hook", (1,), _SHARED_STATE),
    Item(_WRAPPER, "test_register_trainable_module", (1,), _SHARED_STATE),
    Item(_WRAPPER, "test_trainable_module_gradient", (1,)),
    Item(_WRAPPER, "test_destroy", (1,)),
    Item(_WRAPPER, "test_save_ctx", (1,)),
    Item(_WRAPPER, "test_FlexModel_group_all", (1,), _GROUP_MANAGER),
    Item(_WRAPPER, "test_FlexModel_group_creation", (1,), _GROUP_MANAGER),
    *(
        Item(_GROUPS, f"test_HookFunctionGroupManager_{name}", (1,), _MANAGER)
        for name in (
            "create", "update_by_list", "update_by_hook_fn", "update_by_string",
            "remove_by_list", "remove_by_hook_fn", "remove_by_string", "bisect",
        )
    ),
    Item("_test/traverse/test_nodes.py", "test_BaseModelOutputWithPastNode", (1,), "imports the private `flex_model.traverse.nodes`"),
    Item("_test/traverse/test_ops.py", "test_flatten_and_unflatten", (1,), "imports the private `flex_model.traverse.ops`"),
    Item("_test/distributed/test_initialize.py", "test_GPUDeviceMesh", (1,), "imports the private `flex_model.distributed.distributed_state._BaseGPUDeviceMesh`"),
    *(Item(_DP, f"test_{kind}_wrapped", (1, 2, 4)) for kind in ("forward_hooks", "full_backward_hooks", "forward_pre_hooks", "full_backward_pre_hooks")),
    # tensor-parallel size 2: two ranks at least
    Item(_FAIRSCALE, "test_fairscale", (2, 4)),
    *(Item(_FAIRSCALE, f"test_{kind}_fairscale", (2, 4)) for kind in ("forward_hooks", "full_backward_hooks", "forward_pre_hooks", "full_backward_pre_hooks")),
    Item("_test/multi_gpu/distributed/test_initialize.py", "test_initialize_distributed_state", (1, 2, 4), _STATE),
    Item("_test/multi_gpu/distributed/test_initialize.py", "test_initialize_multiple_models", (1, 2, 4), _STATE),
    # _NUM_GPUS = 2: exactly two ranks
    *(
        Item(_MAPPINGS, f"test_{name}", (2,), _STATE)
        for name in (
            "broadcast_tensor_parallel", "broadcast_data_parallel", "all_gather_tensor_parallel",
            "all_gather_data_parallel", "scatter_tensor_parallel", "scatter_data_parallel",
            "batch_isend_irecv_pipeline_parallel", "gather_pipeline_parallel_base", "gather_pipeline_parallel_dtypes",
        )
    ),
    Item("examples/single_gpu_example.py", "", (1,)),
    Item("examples/fsdp_example.py", "", (1, 2, 4)),
)
"""Every test function and example of the wheel that can run here."""

NOT_RUNNABLE = {
    "examples/megatron_example.py": "imports Meta's `llama` package (not on PyPI) and loads a Llama-2-13b checkpoint in its format",
}
"""What of the wheel runs with neither library, and why."""


def items(library: str, world: int) -> list[Item]:
    """The items that run against ``library`` on ``world`` ranks."""
    return [i for i in ITEMS if world in i.worlds and (library == "flex_model" or not i.private)]


# ------------------------------------------------------------------- the shim


def _setup_logger(level: str) -> None:
    logging.basicConfig(level=level.upper())


def _shim_modules() -> dict[str, types.ModuleType]:
    import torchsurgery

    package = types.ModuleType("flex_model")
    package.__path__ = []  # a package, so submodule imports resolve through sys.modules
    core = types.ModuleType("flex_model.core")
    core.FlexModel = torchsurgery.FlexModel  # type: ignore[attr-defined]
    core.HookFunction = torchsurgery.HookFunction  # type: ignore[attr-defined]
    core.DummyModule = torchsurgery.DummyModule  # type: ignore[attr-defined]
    utils = types.ModuleType("flex_model.utils")
    utils.setup_logger = _setup_logger  # type: ignore[attr-defined]
    package.core, package.utils = core, utils  # type: ignore[attr-defined]
    return {"flex_model": package, "flex_model.core": core, "flex_model.utils": utils}


@contextlib.contextmanager
def _library(library: str) -> Iterator[None]:
    # the wheel's modules bind FlexModel when imported: import them afresh for each item
    def forget() -> None:
        for name in [n for n in sys.modules if n.split(".")[0] in ("_test", "examples", "flex_model")]:
            del sys.modules[name]

    forget()
    # not patch.dict: it would also drop every module the item imported (torch's among them)
    sys.modules.update(_shim_modules() if library == "torchsurgery" else {})
    try:
        yield
    finally:
        forget()


# ------------------------------------------------------------ CPU adaptations


def _cpu_device(value: Any) -> Any:
    if isinstance(value, str) and value.split(":")[0] == "cuda":
        return torch.device("cpu")
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    return value


class _CpuFactories(TorchFunctionMode):
    """``torch.randn(..., device="cuda")``, ``nn.Linear(..., device="cuda")``,
    ``.to("cuda")``, ``.to(0)`` and ``device=0`` make or keep CPU tensors."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if isinstance(kwargs.get("device"), int):
            kwargs["device"] = torch.device("cpu")  # an index names a CUDA device
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], int):
            args = (args[0], torch.device("cpu"), *args[2:])
        args = tuple(_cpu_device(a) for a in args)
        kwargs = {k: _cpu_device(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _gloo_init(real: Callable[..., None]) -> Callable[..., None]:
    def init_process_group(backend: str | None = None, *args: Any, **kwargs: Any) -> None:
        # the spawned ranks start their world first; a one-rank test may start (and end) its own
        if not dist.is_initialized():
            real("gloo", store=dist.HashStore(), rank=0, world_size=1)

    return init_process_group


def _gloo_group(real: Callable[..., Any]) -> Callable[..., Any]:
    def new_group(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("backend") == "nccl":
            kwargs["backend"] = "gloo"
        return real(*args, **kwargs)

    return new_group


def _cpu_fsdp(real: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: Any, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("device_id") is not None:
            kwargs["device_id"] = torch.device("cpu")
        real(self, module, *args, **kwargs)

    return __init__


@contextlib.contextmanager
def _on_cpu() -> Iterator[None]:
    from torch.distributed.fsdp import FullyShardedDataParallel, _init_utils

    with contextlib.ExitStack() as stack:
        patch = stack.enter_context
        patch(unittest.mock.patch.object(dist, "init_process_group", _gloo_init(dist.init_process_group)))
        patch(unittest.mock.patch.object(dist, "new_group", _gloo_group(dist.new_group)))
        patch(unittest.mock.patch.object(torch.Tensor, "cuda", lambda self, *a, **k: self))
        patch(unittest.mock.patch.object(nn.Module, "cuda", lambda self, *a, **k: self))
        patch(unittest.mock.patch.object(torch.cuda, "current_device", lambda: 0))
        patch(unittest.mock.patch.object(torch.cuda, "set_device", lambda device: None))
        patch(unittest.mock.patch.object(torch.cuda, "synchronize", lambda device=None: None))
        patch(unittest.mock.patch.object(FullyShardedDataParallel, "__init__", _cpu_fsdp(FullyShardedDataParallel.__init__)))
        patch(unittest.mock.patch.object(_init_utils, "_check_module_states_for_sync_module_states", lambda states: None))
        patch(_stand_ins())
        patch(_CpuFactories())
        yield


# ---------------------------------------------- models and tokenizers they load


def opt_350m(hidden: int = 64) -> nn.Module:
    """A random-weight OPT with OPT-350m's layer count (the tests hook layers 9, 17 and 18)."""
    import transformers

    torch.manual_seed(0)  # two calls give the same weights, as two loads of a checkpoint do
    config = transformers.OPTConfig(
        vocab_size=16000, hidden_size=hidden, word_embed_proj_dim=hidden, ffn_dim=32,
        num_hidden_layers=24, num_attention_heads=4, max_position_embeddings=128,
    )
    return transformers.OPTForCausalLM(config).eval()  # from_pretrained returns eval mode


def llama_2_7b() -> nn.Module:
    """A random-weight Llama with Llama-2-7b's 32 layers, narrow."""
    return _llama(layers=32, hidden=32, heads=4, head_dim=8, intermediate=64, dtype=torch.float32)


def llama_2_13b(dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A random-weight Llama with Llama-2-13b's 40 layers and width 5120: one 8-wide
    attention head and an 8-wide MLP per layer keep it near 12M parameters."""
    return _llama(layers=40, hidden=5120, heads=1, head_dim=8, intermediate=8, dtype=dtype)


def _llama(*, layers: int, hidden: int, heads: int, head_dim: int, intermediate: int, dtype: torch.dtype) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(_VOCAB), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim, max_position_embeddings=512,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


_VOCAB = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(string.printable)}}


def tokenizer() -> Any:
    """One token per character (ids below 104), with pad, bos, eos and unk tokens."""
    import transformers
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(_VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def _checkpoint(path: Any) -> Callable[[], Any]:
    name = str(path)
    for key, make in (("opt-350m", opt_350m), ("Llama-2-7b", llama_2_7b), ("Llama-2-13b", llama_2_13b)):
        if key in name:
            return make
    raise FileNotFoundError(f"no stand-in for the checkpoint {name!r}")


@contextlib.contextmanager
def _stand_ins() -> Iterator[None]:
    import transformers

    def model(cls: Any, path: Any, *args: Any, **kwargs: Any) -> Any:
        return _checkpoint(path)()

    def tok(cls: Any, path: Any, *args: Any, **kwargs: Any) -> Any:
        _checkpoint(path)  # refuses an unknown path as from_pretrained would
        return tokenizer()

    classes = [(transformers.AutoModelForCausalLM, model), (transformers.LlamaForCausalLM, model),
               (transformers.AutoTokenizer, tok), (transformers.LlamaTokenizerFast, tok)]
    with contextlib.ExitStack() as stack:
        for cls, make in classes:
            stack.enter_context(unittest.mock.patch.object(cls, "from_pretrained", classmethod(make)))
        yield


def _fixtures(test: str) -> dict[str, Any]:
    """The wheel's conftest fixtures, as their stand-ins."""
    # its trainable-module test applies a 1024-wide Linear (OPT-350m's width) to a layer's output
    hidden = 1024 if test == "test_trainable_module_gradient" else 64
    return {
        "make_opt_350m": lambda: opt_350m(hidden),
        "opt_tokenizer": tokenizer(),
        "opt_350m_module_names": [n for n, _ in opt_350m().named_modules()],
    }


# ------------------------------------------------------------------ the runner


def _load_example(path: str) -> types.ModuleType:
    assert SITE is not None
    spec = importlib.util.spec_from_file_location(f"flex_model_{Path(path).stem}", SITE / path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(item: Item, printed: list[Any]) -> None:
    if not item.name:
        example = _load_example(item.path)
        with unittest.mock.patch.object(sys, "argv", [item.path]):
            args = example.parse_args()
        with unittest.mock.patch.object(builtins, "print", lambda *a, **k: printed.append(a[0] if len(a) == 1 else a)):
            example.main(args)
        return
    module = importlib.import_module(item.path.removesuffix(".py").replace("/", "."))
    fn = getattr(module, item.name)
    given = _fixtures(item.name)
    fn(**{name: given[name] for name in inspect.signature(fn).parameters})


def _run_one(library: str, item: Item) -> dict[str, Any]:
    printed: list[Any] = []
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with _library(library), _on_cpu():
                _run(item, printed)
            outcome = "passed"
        except Exception as exc:  # noqa: BLE001 - the outcome is the result
            outcome = f"{type(exc).__name__}: {exc}".strip()
    hints = [str(w.message) for w in caught if w.category.__name__ == "ShapeHintWarning"]
    return {"outcome": outcome, "seconds": time.perf_counter() - start, "printed": printed, "hints": hints}


def run_items(rank: int, world: int, plan: list[tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """Run each ``(library, item id)`` of ``plan`` in turn on this rank (for ``_spawn.spawn``).

    Returns, per library and item id: ``outcome`` (``"passed"``, or the exception's type
    and message), ``seconds``, what an example ``printed`` (rank 0's activations) and the
    messages of the ``ShapeHintWarning`` s it raised (``hints``).
    """
    logging.disable(logging.INFO)  # both libraries log every hook at INFO and below
    by_id = {i.id: i for i in ITEMS}
    results: dict[str, dict[str, Any]] = {library: {} for library, _ in plan}
    for library, item_id in plan:
        results[library][item_id] = _run_one(library, by_id[item_id])
        if world == 1 and not dist.is_initialized():  # a one-rank test ended the world: start the next
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return results
