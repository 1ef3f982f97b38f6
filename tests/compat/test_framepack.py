"""Tests of torchsurgery.compat.framepack: the video app's low-VRAM pattern, end to end.

The pipeline (text encoding with Llama and CLIP encoders, denoising steps of the
Hunyuan-video transformer, VAE encode and decode, the models moved in and out as the
app does) is the one of ``examples/framepack_low_vram.py``; each run is compared with
the same pipeline done with plain ``.to()`` moves.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import _framepack_reference as reference
import pytest
import torch
from torch import nn

import tardy
import torchsurgery
from torchsurgery import DevicePool
from torchsurgery.compat import framepack
from torchsurgery.offloading import DEFAULT_SKIP, stored_values

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

_PATH = Path(__file__).parent.parent.parent / "examples" / "framepack_low_vram.py"
_spec = importlib.util.spec_from_file_location("framepack_low_vram", _PATH)
assert _spec is not None and _spec.loader is not None
app = importlib.util.module_from_spec(_spec)
sys.modules["framepack_low_vram"] = app
_spec.loader.exec_module(app)


@pytest.fixture(scope="module")
def models() -> Any:
    return app.build_models()


@pytest.fixture(scope="module")
def expected(models: Any) -> dict[str, torch.Tensor]:
    return app.run(copy.deepcopy(models), app.plain_moves(), torch.device("cpu"))


def _rounded(model: nn.Module, keep: Any = None, buffers: bool = True) -> None:
    """Round floating weights (and buffers) to bf16 values, in place, except those ``keep`` selects."""
    kept = {id(t) for name, m in model.named_modules() if keep and keep(m, name) for t in m.parameters(recurse=False)}
    with torch.no_grad():
        for t in [*model.parameters(), *(model.buffers() if buffers else ())]:
            if t.is_floating_point() and id(t) not in kept:
                t.copy_(t.to(torch.bfloat16).float())


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], **tol: float) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], msg=lambda m, k=key: f"{k}: {m}", **tol)  # type: ignore[misc]


def _clean(models: Any) -> None:
    framepack.unload_complete_models(*vars(models).values())  # as the app does before each job
    for model in vars(models).values():
        torchsurgery.restore(model)
        framepack.DynamicSwapInstaller.uninstall_model(model)


def test_the_app_pattern_on_the_cpu_gives_exactly_the_plain_pipeline_s_outputs(models: Any, expected: dict[str, torch.Tensor]) -> None:
    ours = copy.deepcopy(models)
    app.install_like_the_app(ours, framepack.cpu)
    got = app.run(ours, framepack, framepack.cpu)
    _assert_close(got, expected, rtol=0, atol=0)
    _clean(ours)
    assert all(torchsurgery.surgery_log(m) == [] for m in vars(ours).values())
    assert all(not torchsurgery.is_patched(m) for model in vars(ours).values() for m in model.modules())


def test_bf16_stored_models_computed_in_fp32_match_rounded_weights(models: Any) -> None:
    reference = copy.deepcopy(models)
    _rounded(reference.transformer)
    _rounded(reference.text_encoder)
    want = app.run(reference, app.plain_moves(), torch.device("cpu"))
    ours = copy.deepcopy(models)
    ours.transformer.to(torch.bfloat16)
    ours.text_encoder.to(torch.bfloat16)
    app.install_like_the_app(ours, framepack.gpu, compute_dtype=torch.float32)
    weight = ours.transformer.proj_out._parameters["weight"]
    assert (weight.dtype, weight.stored.dtype) == (torch.float32, torch.bfloat16)  # stored narrow, reads as computed
    got = app.run(ours, framepack, framepack.gpu)
    # each weight converted, then the layer's own kernel: on the CPU bit for bit the rounded model
    exact = framepack.gpu.type == "cpu"
    _assert_close(got, want, **({"rtol": 0, "atol": 0} if exact else {"rtol": 1e-4, "atol": 1e-5}))
    _clean(ours)


def test_a_budgeted_pool_streams_the_transformer_and_pushes_models_back(models: Any) -> None:
    """The pool moving real bytes to the accelerator: bf16 storage, a budget that forces partial loads."""
    reference = copy.deepcopy(models)
    _rounded(reference.transformer, DEFAULT_SKIP, buffers=False)  # the engine stores weights only
    want = app.run(reference, app.plain_moves(), torch.device("cpu"))

    # resident groups are converted from the weights as given, streamed ones pass through
    # bf16: with weights that are bf16 values already, every plan computes the same
    ours = copy.deepcopy(reference)
    sizes = {name: sum(p.numel() * 4 for p in m.parameters()) for name, m in vars(ours).items()}
    pool = DevicePool(framepack.gpu, budget=sizes["transformer"] * 2 // 3)
    pool.add(ours.transformer, name="transformer", storage_dtype=torch.bfloat16, dtype=torch.float32)
    pool.add(ours.text_encoder_2, name="clip")
    pool.add(ours.vae, name="vae", groups="leaves")
    app.install_like_the_app(ours, framepack.gpu)  # the Llama encoder only
    framepack.DynamicSwapInstaller.uninstall_model(ours.transformer)
    got = app.run(ours, framepack, framepack.gpu)
    _assert_close(got, want, rtol=1e-4, atol=1e-5)
    stats = pool.stats()
    assert framepack.gpu.type == "cpu" or all(s.offload is None or s.offload.bytes_moved > 0 for s in stats.values())
    assert stats["transformer"].loads == 2 and stats["transformer"].pushed_back >= 1
    assert stats["vae"].loads == 3 and stats["clip"].loads == 1
    assert all(s.state == "host" for s in stats.values())  # the app unloads everything at the end
    pool.close()
    _clean(ours)


def test_cpu_semantics_of_the_memory_functions() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    weights = {n: (id(p), p.dtype) for n, p in model.named_parameters()}
    assert framepack.get_cuda_free_memory_gb(framepack.cpu) > 0
    framepack.move_model_to_device_with_memory_preservation(model, framepack.cpu, preserved_memory_gb=10**6)
    framepack.offload_model_from_device_for_memory_preservation(model, framepack.cpu, preserved_memory_gb=10**6)
    assert [e.kind for e in torchsurgery.surgery_log(model)] == ["pool", "offload"]  # loaded, never pushed back
    framepack.load_model_as_complete(nn.Linear(2, 2), framepack.cpu)  # pushes back nothing it need not
    framepack.unload_complete_models(model)
    assert {n: (id(p), p.dtype) for n, p in model.named_parameters()} == weights
    assert torchsurgery.surgery_log(model) == [] and not model._forward_pre_hooks  # out of the shared pool


def test_the_functions_keep_nothing_the_app_dropped() -> None:
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    framepack.load_model_as_complete(model, framepack.gpu)
    framepack.unload_complete_models()
    # pushed back to the host: no pool entry, hook or undo record left behind
    assert torchsurgery.surgery_log(model) == [] and not model._forward_pre_hooks
    assert DevicePool.holding(model) is None
    for load in (framepack.load_model_as_complete, framepack.move_model_to_device_with_memory_preservation):
        dropped = nn.Linear(4, 4)
        load(dropped, framepack.gpu)
        ref = weakref.ref(dropped)
        del dropped
        gc.collect()
        assert ref() is None  # a model the app dropped is freed, also while loaded
    framepack.unload_complete_models()


def test_bad_arguments_get_the_librarys_typed_errors() -> None:
    from torchsurgery.errors import ArgumentTypeError, ArgumentValueError

    model = nn.Linear(2, 2)
    with pytest.raises(ArgumentTypeError, match="load_model_as_complete: model must be an nn.Module, got NoneType"):
        framepack.load_model_as_complete(None, framepack.gpu)  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="unload_complete_models: extra_models must be an nn.Module"):
        framepack.unload_complete_models(None)  # type: ignore[arg-type]
    with pytest.raises(ArgumentValueError, match="fake_diffusers_current_device: device 'meta' holds no values"):
        framepack.fake_diffusers_current_device(model, "meta")
    with pytest.raises(ArgumentValueError, match="get_cuda_free_memory_gb: device 'junk' is not a device"):
        framepack.get_cuda_free_memory_gb("junk")
    with pytest.raises(ArgumentValueError, match="move_model_to_device_with_memory_preservation: device"):
        framepack.move_model_to_device_with_memory_preservation(model, "nowhere")
    assert torchsurgery.surgery_log(model) == [] and model.weight.device.type == "cpu"


@pytest.mark.accelerator
def test_the_app_pattern_on_the_accelerator(models: Any, accelerator: torch.device) -> None:
    # the oracle is the plain pipeline on the same device: a GPU's kernels (cuDNN, TF32
    # convolutions) differ from the CPU's by ~1e-3, and the pattern must not change them
    expected = app.run(copy.deepcopy(models), app.plain_moves(), accelerator)
    ours = copy.deepcopy(models)
    app.install_like_the_app(ours, accelerator)
    got = app.run(ours, framepack, accelerator)
    # the test device computes as the CPU does, bit for bit; on a GPU the same kernels may pick
    # other algorithms for weights that arrive per forward (cuBLAS and cuDNN heuristics read
    # alignment and free workspace), which moves the last bits only
    exact = accelerator.type == tardy.NAME
    _assert_close(got, expected, **({"rtol": 0, "atol": 0} if exact else {"rtol": 1e-4, "atol": 1e-5}))
    _clean(ours)
    assert all(p.device.type == "cpu" for m in vars(ours).values() for p in m.parameters())



# ---------------------------------------------------------------------- against the app's own memory module


def _app_pattern(
    memory: Any, device: torch.device, low_vram: bool, preserved_gb: tuple[float, float], where: list[set[str]]
) -> tuple[dict[str, torch.Tensor], Any]:
    """The app's pattern in its dtypes (a bf16 transformer with the fp32 output switch, fp16 VAE
    and text encoders) with ``memory``'s functions. In low-VRAM mode the transformer and the Llama
    encoder get ``memory``'s installer first, as the app does; with room for everything, the
    transformer is loaded whole (only the Llama encoder, which the pattern never moves, gets the
    installer)."""
    models = app.build_models(app_dtypes=True)
    if low_vram:
        memory.DynamicSwapInstaller.install_model(models.transformer, device=device)
    memory.DynamicSwapInstaller.install_model(models.text_encoder, device=device)

    def record(module: nn.Module, args: Any) -> None:  # where the weights are kept as a forward starts
        # where each weight's values are kept (a weight kept on the host reads as the device it computes on)
        where.append({stored_values(p).device.type for p in module.parameters()})

    models.transformer.register_forward_pre_hook(record)
    # under torch.inference_mode(), as the app samples
    return app.run(models, memory, device, preserved_gb=preserved_gb, grad_off=torch.inference_mode), models


@pytest.mark.accelerator
@pytest.mark.parametrize("low_vram", [False, True], ids=["roomy", "low-vram"])
def test_the_app_pattern_in_its_dtypes_equals_the_app_s_own_memory_module(
    accelerator: torch.device, low_vram: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    import tardy

    gib = 1 << 30
    capacity = 8 << 20
    # low VRAM: the transformer (270 kB in bf16) is moved in until about 150 kB are taken, and
    # taken back until about 60 kB are, as the app keeps 6 and then 8 GiB free on a GPU
    # tardy's capacity stands for a GPU's memory; a real GPU's own is measured as it is
    gc.collect()  # device memory earlier tests left in cycles: freed now, not half-way through the app
    with tardy.settings(capacity=capacity) if accelerator.type == tardy.NAME else contextlib.nullcontext():
        free = reference.get_cuda_free_memory_gb(accelerator)  # what earlier tests left taken aside
        preserved = (free - 150_000 / gib, free - 60_000 / gib) if low_vram else (0.0, 0.0)
        theirs_where: list[set[str]] = []
        ours_where: list[set[str]] = []
        want, theirs = _app_pattern(reference, accelerator, low_vram, preserved, theirs_where)
        expected_lines = capsys.readouterr().out.splitlines()
        got, ours = _app_pattern(framepack, accelerator, low_vram, preserved, ours_where)
        lines = capsys.readouterr().out.splitlines()
    assert lines == expected_lines
    assert sum(line.startswith("Moving ") for line in lines) == 2
    # low VRAM: the transformer is partly on the device, in the app at each forward; here from
    # the forward after the first of a load on (the engine picks the groups it keeps resident from
    # the first forward's measurements; streamed weights are kept on the host); with room, wholly
    if low_vram:
        assert theirs_where == [{"cpu", accelerator.type}] * 6
        assert {"cpu", accelerator.type} in ours_where
    else:
        assert theirs_where == ours_where == [{accelerator.type}] * 6
    for key in want:  # the same kernels on the same weights: bit for bit
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    assert got["latents0"].dtype == torch.float32 and got["pixels0"].dtype == torch.float16
    # the transformer's fp32 output switch converted its output projection, inside forward
    assert ours.transformer.proj_out.weight.dtype == theirs.transformer.proj_out.weight.dtype == torch.float32
    _clean(ours)
    assert ours.transformer.proj_out.weight.dtype == torch.float32  # the conversion is the app's: it stays
    assert all(p.device.type == "cpu" for m in vars(ours).values() for p in m.parameters())


# ---------------------------------------------------------------------- the memory to preserve


def _free(device: torch.device) -> int:
    """Bytes free on ``device`` as the app measures them (its own ``get_cuda_free_memory_gb``)."""
    return round(reference.get_cuda_free_memory_gb(device) * (1 << 30))


@pytest.mark.accelerator
def test_the_memory_functions_leave_the_preserved_memory_free_as_the_app_s_do(accelerator: torch.device) -> None:
    """Each move and offload with an amount to preserve leaves that much free, also after the
    forwards that follow (they choose the resident groups, which the function's plan must hold);
    the app's own functions, on the same model and amounts, go to the line module by module."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)) for _ in range(8)])
    block = sum(p.nbytes for p in model[0].parameters())  # a group; streaming holds two (prefetch 1)
    x = torch.randn(3, 64).to(accelerator)
    with torch.no_grad():
        expected = copy.deepcopy(model).to(accelerator)(x)
    # bytes the model may take at each step, in groups: the ring's two and two and a half more,
    # then one and three quarters more (an offload), then one and most of another (a move after
    # it): between whole groups, so that counting the bytes granted before as what the model
    # holds (it holds less: whole groups) would keep one group too many
    steps = [("move", 4.5), ("offload", 3.75), ("move", 3.9)]
    on_tardy = accelerator.type == tardy.NAME
    left: dict[str, list[int]] = {}
    with tardy.settings(capacity=8 << 20) if on_tardy else contextlib.nullcontext():
        for memory in (reference, framepack):
            ours = copy.deepcopy(model)
            if memory is reference:  # as the app runs its low-VRAM models: weights read onto the device
                reference.DynamicSwapInstaller.install_model(ours, device=accelerator)
            functions = {"move": memory.move_model_to_device_with_memory_preservation,
                         "offload": memory.offload_model_from_device_for_memory_preservation}
            free = _free(accelerator)
            left[memory.__name__] = []
            for function, blocks in steps:
                preserved = free - int(blocks * block)
                functions[function](ours, accelerator, preserved_memory_gb=preserved / (1 << 30))
                # streamed on the test device through a link far slower than the groups' compute:
                # every transfer stalls, so the first forward after each plan keeps as many
                # groups resident as the plan allows
                slow = on_tardy and memory is framepack
                with torch.no_grad(), tardy.settings(delay=(0.01, 0.012)) if slow else contextlib.nullcontext():
                    for _ in range(2):
                        torch.testing.assert_close(ours(x), expected, rtol=0, atol=0)
                torch.accelerator.synchronize()
                left[memory.__name__].append(_free(accelerator) - preserved)
            if memory is framepack:
                framepack.unload_complete_models(ours)
            else:
                ours.to("cpu")
                reference.DynamicSwapInstaller.uninstall_model(ours)
            torch.accelerator.empty_cache()
    app, got = left[reference.__name__], left[framepack.__name__]
    # the app's move takes modules until no more than the amount is free, its offload gives them
    # back until at least that much is
    assert app[0] <= 0 and app[1] >= 0 and app[2] <= 0, app
    # ours keeps the amount free at every step, taking no more than the app (on the test device,
    # where every group stalls, less than a group's room is left unused; a group whose measured
    # copy happened not to stall, on a loaded machine, may be left streaming: less than two)
    assert all(0 <= g < (2 * block if on_tardy else 1 << 62) for g in got), (got, block)
    assert got[0] >= app[0] and got[2] >= app[2], (got, app)
    assert torchsurgery.surgery_log(ours) == [] and all(p.device.type == "cpu" for p in ours.parameters())


# ---------------------------------------------------------------------- memory too small for the model's blocks


def _streaming_need(model: nn.Module, device: torch.device, groups: str, prefetch: int) -> int:
    """Device bytes ``model`` needs at the least streamed in ``groups``, as the offload counts them."""
    from torchsurgery._device import AcceleratorDevice
    from torchsurgery.offloading.plan import sizes

    return sizes(model, "test", dtype=None, storage_dtype=None, groups=groups, skip=DEFAULT_SKIP,
                 device=AcceleratorDevice(device), prefetch=prefetch)[2]


def _taking(memory: Any, device: torch.device, take: int, fixed: list[float]) -> Any:
    """``memory``'s functions with the amounts to preserve fixed at the first move of the first run
    (kept in ``fixed`` for the runs that follow, which print the same lines): ``take`` bytes left to
    the transformer then, and half as many when it is taken back for the VAE."""

    def preserved(index: int) -> float:
        if not fixed:
            free = reference.get_cuda_free_memory_gb(device)
            fixed.extend([free - take / (1 << 30), free - take / 2 / (1 << 30)])
        return fixed[index]

    def move(model: nn.Module, target: Any, preserved_memory_gb: float = 0) -> None:
        memory.move_model_to_device_with_memory_preservation(model, target, preserved_memory_gb=preserved(0))

    def offload(model: nn.Module, target: Any, preserved_memory_gb: float = 0) -> None:
        memory.offload_model_from_device_for_memory_preservation(model, target, preserved_memory_gb=preserved(1))

    return types.SimpleNamespace(
        **{n: getattr(memory, n) for n in ("load_model_as_complete", "unload_complete_models", "fake_diffusers_current_device")},
        move_model_to_device_with_memory_preservation=move, offload_model_from_device_for_memory_preservation=offload,
    )


@pytest.mark.accelerator
@pytest.mark.parametrize("room", ["blocks", "modules"])
def test_too_little_memory_for_the_transformer_s_blocks_runs_as_the_app_s_own_module(
    accelerator: torch.device, room: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bf16 transformer partly on the device, its forward converting its output projection to
    fp32: with room for its blocks streamed only before that conversion ("blocks"), and with room
    for less than its blocks streamed, only for single modules ("modules"), the job runs to the end
    as with the app's own module, bit for bit, printing the app's lines and, where the blocks had no
    room, one line saying what it streams instead."""
    from torchsurgery._device import AcceleratorDevice

    model = app.build_models(app_dtypes=True).transformer
    blocks = _streaming_need(model, accelerator, "blocks", 1)
    modules = _streaming_need(model, accelerator, "leaves", 0)  # one module at a time
    granule = AcceleratorDevice(accelerator).allocation_granule
    # what a cast of the output projection to fp32 at each run would add (its check counted that)
    cast = sum(-(-p.numel() * 4 // granule) * granule for p in model.proj_out.parameters())
    take = (blocks if room == "blocks" else modules) + cast // 2
    assert modules + cast < blocks  # "modules": less than the blocks' room
    gc.collect()
    with tardy.settings(capacity=8 << 20) if accelerator.type == tardy.NAME else contextlib.nullcontext():
        runs, fixed = [], []
        # ours first: the amounts are fixed at its move, for the room it is given to be ``take``
        # (the app's installer-less move of the Llama encoder's embedding takes 8 KiB more before it)
        for memory in (framepack, reference):
            models = app.build_models(app_dtypes=True)
            for model in (models.transformer, models.text_encoder):
                memory.DynamicSwapInstaller.install_model(model, device=accelerator)
            got = app.run(models, _taking(memory, accelerator, take, fixed), accelerator, sections=1, steps=1, grad_off=torch.inference_mode)
            runs.append((got, capsys.readouterr().out.splitlines(), models))
            if memory is framepack:
                _clean(models)
            else:  # the app leaves its transformer partly on the device: the next run starts as this one did
                for model in vars(models).values():
                    model.to("cpu")
                    reference.DynamicSwapInstaller.uninstall_model(model)
            del models
            gc.collect()
            capsys.readouterr()  # what the clean-up printed
    (got, lines, ours), (want, expected_lines, _) = runs
    said = [line for line in lines if line.startswith("Streaming ")]
    assert [line for line in lines if not line.startswith("Streaming ")] == expected_lines
    assert len(said) == (room == "modules"), said
    if said:
        assert said[0].startswith("Streaming DynamicSwap_FramePackTransformer in smaller pieces: its groups need ")
        assert "streaming single modules" in said[0]
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    assert ours.transformer.proj_out.weight.dtype == torch.float32
    assert all(p.device.type == "cpu" for m in vars(ours).values() for p in m.parameters())
