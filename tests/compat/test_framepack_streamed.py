"""Tests of torchsurgery.compat.framepack with models streamed from their checkpoint files.

The demo's models (``examples/framepack_low_vram.py``, its micro size) are saved as the app's
checkpoints are laid out (sharded safetensors, the app's dtypes). A whole generation job runs
on them twice: loaded as the app loads them (``load_models``: every model whole in host
memory) and loaded with ``torchsurgery.from_pretrained`` (``stream_models``: the only lines a
script changes), each model keeping at most 40% of its checkpoint in host memory. Outputs and
printed lines must be equal, bit for bit; the streamed weights must never be in host memory
outside a forward, and the host tier must stay within its budget.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import sys
import weakref
from pathlib import Path
from typing import Any

import _framepack_reference as reference
import pytest
import torch
from torch import nn

import tardy
import torchsurgery
from torchsurgery import DevicePool
from torchsurgery._undo import records
from torchsurgery.compat import framepack
from torchsurgery.offloading import stored_values
from torchsurgery.offloading.engine import OffloadRecord

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

if "framepack_low_vram" in sys.modules:
    app = sys.modules["framepack_low_vram"]
else:
    _PATH = Path(__file__).parent.parent.parent / "examples" / "framepack_low_vram.py"
    _spec = importlib.util.spec_from_file_location("framepack_low_vram", _PATH)
    assert _spec is not None and _spec.loader is not None
    app = importlib.util.module_from_spec(_spec)
    sys.modules["framepack_low_vram"] = app
    _spec.loader.exec_module(app)

SIZE = "micro"
JOB = {"size": SIZE, "sections": 2, "steps": 1}  # two sections: the transformer moved in, out and in again
SHARE = 0.4  # of each model's checkpoint bytes, kept in host memory at most


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("framepack")
    app.save_models(path, size=SIZE)
    return path


def _handle(model: nn.Module) -> Any:
    """The model's active offload (its base, or a pool's), if any."""
    found = [r.handle for r in records(model) if isinstance(r, OffloadRecord) and r.handle.active]
    return found[0] if found else None


class _Watch:
    """Where each model's weights are kept as its forwards start, and its host tier's peak after them."""

    def __init__(self, models: Any) -> None:
        self.where: dict[str, set[str]] = {}
        self.peak: dict[str, int] = {}
        for name, model in vars(models).items():
            # the VAE runs its encoder and decoder, never its own forward
            for called in (model, *(getattr(model, part, None) for part in ("encoder", "decoder"))):
                if isinstance(called, nn.Module):
                    called.register_forward_pre_hook(lambda m, a, name=name, model=model: self._where(name, model))
                    called.register_forward_hook(lambda m, a, o, name=name, model=model: self._peak(name, model))

    def _where(self, name: str, model: nn.Module) -> None:
        self.where.setdefault(name, set()).update(stored_values(p).device.type for p in model.parameters())

    def _peak(self, name: str, model: nn.Module) -> None:
        handle = _handle(model)
        if handle is not None:
            self.peak[name] = max(self.peak.get(name, 0), handle.stats().peak_host_bytes)


def _job(models: Any, device: torch.device, low_vram: bool, preserved: tuple[float, float], capsys: Any) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The app's job with its installer as in each VRAM mode: outputs and printed lines."""
    if low_vram:
        framepack.DynamicSwapInstaller.install_model(models.transformer, device=device)
    framepack.DynamicSwapInstaller.install_model(models.text_encoder, device=device)
    capsys.readouterr()
    out = app.run(models, framepack, device, preserved_gb=preserved, grad_off=torch.inference_mode, **JOB)
    return out, capsys.readouterr().out.splitlines()


def _clean(models: Any) -> None:
    framepack.unload_complete_models(*vars(models).values())
    for model in vars(models).values():
        framepack.DynamicSwapInstaller.uninstall_model(model)
        torchsurgery.restore(model)


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


def _check_streamed(watch: _Watch, folder: Path, models: Any) -> None:
    """No weight in host memory outside forwards; each host tier within its budget."""
    for name, where in watch.where.items():
        assert "cpu" not in where, (name, where)  # meta (in the files), or resident on the device
    for name, peak in watch.peak.items():
        assert peak <= SHARE * app.checkpoint_bytes(folder, name), (name, peak)
    assert set(watch.peak) == set(vars(models))


def test_the_job_streamed_from_files_on_the_cpu_equals_the_app_s_loading(
    folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On the CPU the two VRAM modes differ only by the transformer's installer: the low-VRAM one."""
    cpu, low_vram = torch.device("cpu"), True
    want, want_lines = _job(app.load_models(folder), cpu, low_vram, (6, 8), capsys)
    models = app.stream_models(folder, SHARE)
    watch = _Watch(models)
    got, lines = _job(models, cpu, low_vram, (6, 8), capsys)
    _assert_equal(got, want)
    assert lines == want_lines
    _check_streamed(watch, folder, models)
    assert all(w == {"meta"} for w in watch.where.values())  # on the host: read from the files at use
    _clean(models)
    assert all(p.is_meta for m in vars(models).values() for p in m.parameters())


@pytest.mark.accelerator
@pytest.mark.parametrize("low_vram", [False, True], ids=["roomy", "low-vram"])
def test_the_job_streamed_from_files_on_the_accelerator_equals_the_app_s_loading(
    folder: Path, accelerator: torch.device, low_vram: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    gib = 1 << 30
    gc.collect()
    on_tardy = accelerator.type == tardy.NAME
    with tardy.settings(capacity=8 << 20) if on_tardy else contextlib.nullcontext():
        free = reference.get_cuda_free_memory_gb(accelerator)
        # low VRAM: the transformer (270 kB in bf16) moved in until about 150 kB are taken, and
        # taken back until about 60 kB are
        preserved = (free - 150_000 / gib, free - 60_000 / gib) if low_vram else (0.0, 0.0)
        plain = app.load_models(folder)
        want, want_lines = _job(plain, accelerator, low_vram, preserved, capsys)
        models = app.stream_models(folder, SHARE)
        watch = _Watch(models)
        got, lines = _job(models, accelerator, low_vram, preserved, capsys)
    # unloaded by the app, a streamed model is back on the host: it runs there as the app's does
    ids = torch.arange(12).reshape(1, 12)
    with torch.inference_mode():
        assert torch.equal(models.text_encoder_2(ids).pooler_output, plain.text_encoder_2(ids).pooler_output)
    # uninstalled, the Llama encoder computes on the host again, from its files
    for text in (models.text_encoder, plain.text_encoder):
        framepack.DynamicSwapInstaller.uninstall_model(text)
    assert _handle(models.text_encoder).device.type == "cpu"
    with torch.inference_mode():
        assert torch.equal(models.text_encoder(ids).last_hidden_state, plain.text_encoder(ids).last_hidden_state)
    exact = on_tardy
    if exact:
        _assert_equal(got, want)
    else:  # a GPU's kernels may pick other algorithms for weights that arrive per forward
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-3, atol=1e-3)
    # where the memory left to the transformer is too small for its streamed blocks, the shared pool
    # streams finer groups and says so (once each time the model joins the pool; streamed from files,
    # at other points than loaded whole, its groups needing other room); every other line is the app's
    def app_s(printed: list[str]) -> list[str]:
        return [line for line in printed if not (line.startswith("Streaming ") and "in smaller pieces" in line)]

    assert app_s(lines) == app_s(want_lines)
    _check_streamed(watch, folder, models)
    assert any(accelerator.type in w for w in watch.where.values())  # some groups resident on the device
    _clean(models)
    assert all(p.is_meta for m in vars(models).values() for p in m.parameters())


@pytest.mark.accelerator
def test_a_comfyui_style_pool_of_streamed_models_shares_one_device_and_one_host_budget(
    folder: Path, accelerator: torch.device
) -> None:
    """Every model in one pool, loaded before each use, the least recently used pushed back:
    a device budget below the models' sum, and one host budget of 40% of their checkpoints."""
    want = app.run(app.load_models(folder), app.plain_moves(), accelerator, grad_off=torch.inference_mode, **JOB)
    total = sum(app.checkpoint_bytes(folder, name) for name in app.CHECKPOINTS)
    models = app.stream_models(folder, SHARE)
    largest = max(app.checkpoint_bytes(folder, name) for name in app.CHECKPOINTS)
    pool = DevicePool(accelerator, budget=largest + largest // 2, host_budget=int(SHARE * total))
    for name, model in vars(models).items():
        storage = _handle(model).plan.storage
        torchsurgery.restore(model)  # the skeleton, its weights in the files
        pool.add(model, name=name, storage=storage)
    watch = _Watch(models)
    got = app.run(models, app.pool_moves(pool), accelerator, grad_off=torch.inference_mode, **JOB)
    if accelerator.type == tardy.NAME:
        _assert_equal(got, want)
    else:
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-3, atol=1e-3)
    assert all("cpu" not in w for w in watch.where.values()), watch.where
    stats = pool.stats()
    assert sum(s.pushed_back for s in stats.values()) >= 1  # the budget made room by pushing back
    assert all(peak <= SHARE * total for peak in watch.peak.values())
    pool.close()
    assert all(p.is_meta for m in vars(models).values() for p in m.parameters())


def test_a_streamed_model_moved_and_dropped_is_freed(folder: Path) -> None:
    """The functions keep no strong reference to a streamed model (its base is off while pooled)."""
    model = app.stream_models(folder, SHARE).image_encoder
    framepack.DynamicSwapInstaller.install_model(model, device=framepack.cpu)
    framepack.load_model_as_complete(model, framepack.cpu)
    ref = weakref.ref(model)
    del model
    framepack.unload_complete_models()
    gc.collect()
    assert ref() is None


@pytest.mark.accelerator
def test_a_streamed_model_moved_partly_keeps_its_own_host_budget_and_with_no_room_stays_on_the_host(folder: Path, accelerator: torch.device) -> None:
    """Moved in partly, the model streams the rest from its files within the host budget it was
    loaded with, not the shared pool's (which is the host's available memory)."""
    share = 0.1
    want = app.load_models(folder).image_encoder
    model = app.stream_models(folder, share).image_encoder
    pixels = torch.rand(1, 3, 64, 64, dtype=torch.float16) * 2 - 1
    gc.collect()
    with tardy.settings(capacity=8 << 20) if accelerator.type == tardy.NAME else contextlib.nullcontext():
        free = reference.get_cuda_free_memory_gb(accelerator)
        # no room for even one module: it stays on the host, computing there from its files
        framepack.move_model_to_device_with_memory_preservation(model, accelerator, free - 1_000 / (1 << 30))
        with torch.inference_mode():
            assert torch.equal(model(pixel_values=pixels).last_hidden_state, want(pixel_values=pixels).last_hidden_state)
        framepack.move_model_to_device_with_memory_preservation(model, accelerator, free - 30_000 / (1 << 30))
        with torch.inference_mode():
            for _ in range(2):
                got = model(pixel_values=pixels.to(accelerator)).last_hidden_state
        stats = _handle(model).stats()
        framepack.unload_complete_models(model)
        with torch.inference_mode():
            expected = want.to(accelerator)(pixel_values=pixels.to(accelerator)).last_hidden_state
    assert torch.equal(got.cpu(), expected.cpu()) if accelerator.type == tardy.NAME else torch.allclose(got.cpu(), expected.cpu(), atol=1e-3)
    assert len(stats.streamed_groups) > 0  # partly on the device
    assert stats.peak_host_bytes <= share * app.checkpoint_bytes(folder, "image_encoder")
