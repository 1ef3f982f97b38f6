"""The test device itself: what it promises the other tests (late copies, poison, hazards, memory)."""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import tardy

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _tardy_only(on_tardy: torch.device) -> None:
    """Every test here is about the test device (skipped where the suite runs on a GPU)."""


def pinned(values: list[float]) -> torch.Tensor:
    return torch.tensor(values).pin_memory()


def test_it_is_the_accelerator_torch_reports() -> None:
    assert torch.accelerator.current_accelerator() == torch.device(tardy.NAME)
    assert torch.accelerator.device_count() == 1 and torch.tardy is tardy  # type: ignore[attr-defined]
    x = torch.arange(4.0, device="tardy")
    assert x.device == torch.device("tardy", 0)
    torch.testing.assert_close((x * 2 + 1).cpu(), torch.tensor([1.0, 3.0, 5.0, 7.0]), rtol=0, atol=0)


def test_device_memory_is_reached_only_through_the_device() -> None:
    x = torch.ones(3, device="tardy")
    with pytest.raises(RuntimeError, match=r"found at least two devices, tardy:0 and cpu"):
        torch.add(x, torch.ones(3))
    assert (x + torch.tensor(1.0)).cpu().tolist() == [2.0, 2.0, 2.0]  # a 0-d host tensor joins, as on CUDA


def test_fresh_device_memory_holds_poison() -> None:
    assert torch.empty(4, device="tardy").cpu().isnan().all()


def test_pinned_host_memory_is_pinned_and_plain_memory_is_not() -> None:
    assert torch.empty(8, pin_memory=True).is_pinned()
    assert torch.ones(8).pin_memory().is_pinned()
    assert not torch.ones(8).is_pinned()


def test_a_lazy_copy_runs_only_when_waited_for_and_lands_in_stream_order() -> None:
    side = torch.Stream(device="tardy")
    source = pinned([1.0, 2.0, 3.0])
    with tardy.settings(lazy=True):
        dst = torch.empty(3, device="tardy")
        with side:
            dst.copy_(source, non_blocking=True)
            done = torch.Event(device="tardy")
            done.record(side)
        assert tardy.in_flight() == 2 and not done.query()  # nothing ran: lazy
        source.fill_(7.0)  # pinned memory is read when the copy lands, not when it is issued
        torch.accelerator.current_stream().wait_event(done)
        assert dst.cpu().tolist() == [7.0, 7.0, 7.0]  # the compute stream waited: the copy ran first
        assert done.query() and tardy.in_flight() == 0


def test_a_pageable_source_is_read_at_the_call_and_the_destination_lands_late() -> None:
    side = torch.Stream(device="tardy")
    source = torch.tensor([1.0, 2.0])
    before = tardy.pageable_copies()
    with tardy.settings(lazy=True):
        dst = torch.empty(2, device="tardy")
        with side:
            dst.copy_(source, non_blocking=True)
        source.fill_(9.0)  # too late: the bytes were taken at the call, as CUDA stages them
        assert tardy.pageable_copies() == before + 1 and tardy.in_flight() == 1
        side.synchronize()
        assert dst.cpu().tolist() == [1.0, 2.0]


def test_a_copy_into_pinned_host_memory_lands_when_waited_for_and_into_pageable_memory_at_once() -> None:
    x = torch.tensor([4.0, 5.0], device="tardy")
    with tardy.settings(lazy=True):
        host = torch.zeros(2, pin_memory=True)
        host.copy_(x, non_blocking=True)
        assert host.tolist() == [0.0, 0.0]  # not landed yet
        torch.accelerator.synchronize()
        assert host.tolist() == [4.0, 5.0]
        plain = torch.zeros(2)
        plain.copy_(x, non_blocking=True)
        assert plain.tolist() == [4.0, 5.0]


def test_the_copy_log_says_on_which_stream_each_copy_ran_whether_the_host_waited_and_whether_it_landed() -> None:
    side = torch.Stream(device="tardy")
    compute = torch.accelerator.current_stream().stream_id
    with tardy.settings(lazy=True), tardy.copy_log() as logged:
        dst = torch.empty(3, device="tardy")
        with side:
            dst.copy_(pinned([1.0, 2.0, 3.0]), non_blocking=True)
        blocking = torch.ones(4).to("tardy")  # the host waits for it
        back = torch.zeros(3, pin_memory=True)
        with side:
            back.copy_(dst, non_blocking=True)
        assert [(c.stream, c.asynchronous, c.to_device, c.nbytes, c.landed) for c in logged()] == [
            (side.stream_id, True, True, 12, False),  # lazy: nothing waited for it yet
            (compute, False, True, 16, True),
            (side.stream_id, True, False, 12, False),
        ]
        side.synchronize()
        assert all(c.landed for c in logged())
    with tardy.copy_log() as logged:  # a fresh log, and none outside the block
        assert logged() == []
    blocking.cpu()
    assert logged() == []


def test_reading_what_another_stream_writes_without_an_event_is_a_hazard() -> None:
    side = torch.Stream(device="tardy")
    dst = torch.empty(2, device="tardy")
    with tardy.settings(lazy=True):
        with side:
            dst.copy_(pinned([1.0, 2.0]), non_blocking=True)
        with pytest.raises(RuntimeError, match="hazard: aten::add.* on stream 0 reads .* that stream [1-8] wrote without an event"):
            dst + 1
        torch.accelerator.current_stream().wait_stream(side)
        assert (dst + 1).cpu().tolist() == [2.0, 3.0]


def test_overwriting_what_another_stream_reads_without_an_event_is_a_hazard() -> None:
    side = torch.Stream(device="tardy")
    buffer = torch.ones(2, device="tardy")
    total = buffer.sum()  # read on the default stream
    with side, pytest.raises(RuntimeError, match="hazard: a copy on stream [1-8] writes .* that stream 0 (wrote|read) without an event"):
        buffer.copy_(pinned([3.0, 4.0]), non_blocking=True)
    side.wait_stream(torch.accelerator.current_stream())
    with side:
        buffer.copy_(pinned([3.0, 4.0]), non_blocking=True)
    side.synchronize()
    assert total.item() == 2.0 and buffer.cpu().tolist() == [3.0, 4.0]


def test_freeing_memory_another_stream_still_uses_is_reported() -> None:
    side = torch.Stream(device="tardy")
    with tardy.settings(lazy=True):
        buffer = torch.empty(4, device="tardy")  # allocated on the default stream
        with side:
            buffer.copy_(pinned([1.0, 2.0, 3.0, 4.0]), non_blocking=True)
        del buffer  # the default stream may reuse it while the copy has not run
        with pytest.raises(RuntimeError, match="was freed while its use on stream [1-8] was not ordered"):
            torch.accelerator.synchronize()  # the next call into the device reports it
    ok = torch.empty(4, device="tardy")
    with side:
        ok.copy_(pinned([1.0, 2.0, 3.0, 4.0]), non_blocking=True)
    ok.record_stream(side)  # as on CUDA: the allocator orders its reuse after the side stream
    del ok
    torch.accelerator.synchronize()
    assert tardy.hazards() == []


def test_work_on_one_stream_runs_in_order_whatever_the_delays() -> None:
    side = torch.Stream(device="tardy")
    with tardy.settings(delay=(0.0, 0.002), seed=3):
        dst = torch.empty(4, device="tardy")
        with side:
            for value in range(10):
                dst.copy_(torch.full((4,), float(value)).pin_memory(), non_blocking=True)
            start, end = torch.Event(device="tardy", enable_timing=True), torch.Event(device="tardy", enable_timing=True)
            start.record(side)
            doubled = dst * 2  # compute on the side stream follows its copies without an event
            end.record(side)
        torch.accelerator.current_stream().wait_stream(side)
        assert doubled.cpu().tolist() == [18.0] * 4 and start.elapsed_time(end) >= 0


def test_memory_statistics_and_out_of_memory_within_the_capacity() -> None:
    torch.accelerator.synchronize()
    with tardy.settings(capacity=torch.accelerator.memory_allocated() + (1 << 20)):
        base = torch.accelerator.memory_allocated()
        torch.accelerator.reset_peak_memory_stats()
        half = torch.empty(1 << 19, dtype=torch.uint8, device="tardy")
        assert torch.accelerator.memory_allocated() == base + (1 << 19)
        free, total = torch.accelerator.get_memory_info()
        assert total - free == base + (1 << 19)
        with pytest.raises(torch.OutOfMemoryError, match=r"tardy: out of memory: tried to allocate 1048576 bytes"):
            torch.empty(1 << 20, dtype=torch.uint8, device="tardy")
        assert torch.accelerator.memory_stats()["num_ooms"] >= 1
        del half
        assert torch.accelerator.memory_allocated() == base
        assert torch.accelerator.max_memory_allocated() == base + (1 << 19)
        torch.empty(1 << 20, dtype=torch.uint8, device="tardy")  # fits again


def test_autograd_and_convolutions_run_through_the_cpu_fallback() -> None:
    conv = torch.nn.Conv2d(2, 3, 3, padding=1)
    x = torch.randn(1, 2, 5, 5)
    conv(x).square().sum().backward()
    expected = conv.weight.grad.clone()  # type: ignore[union-attr]
    conv.zero_grad()
    conv.to("tardy")
    conv(x.to("tardy")).square().sum().backward()
    torch.testing.assert_close(conv.weight.grad.cpu(), expected, rtol=0, atol=0)  # type: ignore[union-attr]


_NORMS = {
    "group_norm": (lambda: torch.nn.GroupNorm(2, 8), (2, 8, 5, 5)),
    "layer_norm": (lambda: torch.nn.LayerNorm(8), (2, 5, 8)),
}


def _norm_run(module: torch.nn.Module, x: torch.Tensor, device: str) -> list[torch.Tensor]:
    """The output, then the input's, weight's and bias's gradients, of ``module`` on ``device``."""
    module.zero_grad()
    module.to(device)
    xi = x.detach().to(device).requires_grad_(True)
    y = module(xi)
    y.square().sum().backward()
    return [t.detach().cpu() for t in (y, xi.grad, module.weight.grad, module.bias.grad)]


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("norm", list(_NORMS))
def test_norms_run_the_cpus_kernels_whatever_the_layout(norm: str, layout: str) -> None:
    # PyTorch gives every backend but the CPU and CUDA a composite group and layer norm, which
    # computes otherwise and refuses a channels-last input (a diffusers UNet's group norms
    # failed so on tardy): tardy runs the CPU's own kernels, bit for bit. Group norm's backward
    # of a channels-last input alone differs in its last bits: PyTorch's derivative makes its
    # tensors contiguous on every device but the CPU (CUDA too), so another CPU kernel runs
    make, shape = _NORMS[norm]
    module = make()
    x = torch.randn(*shape)
    if layout == "channels_last":
        x = x.permute(0, *range(2, x.dim()), 1).contiguous().permute(0, x.dim() - 1, *range(1, x.dim() - 1))
    got = _norm_run(module, x, "tardy")
    want = _norm_run(module, x, "cpu")
    exact = {"rtol": 0.0, "atol": 0.0}
    torch.testing.assert_close(got[0], want[0], **exact)
    for a, b in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(a, b, **({} if (norm, layout) == ("group_norm", "channels_last") else exact))


def test_a_late_copy_inside_inference_mode_lands_and_bumps_no_version_when_it_lands() -> None:
    side = torch.Stream(device="tardy")
    source = torch.randn(4, 3)
    with torch.inference_mode():
        y = torch.empty(4, 3, device="tardy")  # an inference tensor, as in HF generate()
        with side:
            y.copy_(source, non_blocking=True)  # lands on a worker thread, outside inference mode
            done = torch.Event(device="tardy")
            done.record(side)
        torch.accelerator.current_stream().wait_event(done)
        assert torch.equal((y + 0).cpu(), source)
    normal, reference = torch.zeros(3, device="tardy"), torch.zeros(3)
    with tardy.settings(lazy=True):
        normal.copy_(pinned([1.0, 2.0, 3.0]), non_blocking=True)
        reference.copy_(torch.tensor([1.0, 2.0, 3.0]))
        assert normal._version == reference._version == 1  # bumped at the call, as on the CPU
        with torch.inference_mode():
            torch.accelerator.synchronize()  # the copy runs now, on this thread, in inference mode
    assert normal._version == 1 and normal.cpu().tolist() == [1.0, 2.0, 3.0]


_OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "t": lambda x: x.t(),  # every nn.Linear forward
    "view": lambda x: x.view(-1),
    "narrow": lambda x: x.narrow(0, 1, 2),
    "select": lambda x: x[1],
    "split": lambda x: x.split(2)[1],
    "expand": lambda x: x[:1].expand(3, 4),
    "detach": lambda x: x.detach(),
    "as_strided": lambda x: x.as_strided((2, 2), (1, 2), 1),
    "view_as_real": lambda x: torch.view_as_real(x.to(torch.complex64)),
    "add": lambda x: x + 1,
    "mm": lambda x: x @ x.t(),
    "contiguous": lambda x: x.t().contiguous(),
    "sum": lambda x: x.sum(),
}


@pytest.mark.parametrize("op", list(_OPS))
@pytest.mark.parametrize("base_in_inference", [False, True], ids=["normal_base", "inference_base"])
@pytest.mark.parametrize("op_in_inference", [False, True], ids=["op_outside", "op_inside"])
def test_views_and_fresh_results_are_inference_tensors_where_the_cpu_makes_them(
    op: str, base_in_inference: bool, op_in_inference: bool
) -> None:
    results = {}
    for device in ("cpu", "tardy"):
        with torch.inference_mode(base_in_inference):
            base = torch.arange(12.0, device=device).view(3, 4)
        with torch.inference_mode(op_in_inference):
            results[device] = _OPS[op](base)
    got, expected = results["tardy"], results["cpu"]
    assert torch.is_inference(got) == torch.is_inference(expected)
    torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=0)
    # a normal result's version: views share their base's counter (see docs/hardware.md for the
    # results of inference tensors outside the mode)
    if not torch.is_inference(expected) and not base_in_inference:
        assert got._version == expected._version


def test_a_view_taken_in_inference_mode_shares_its_base_version_counter_as_on_the_cpu() -> None:
    versions = {}
    for device in ("cpu", "tardy"):
        weight = torch.zeros(3, 4, device=device)
        with torch.inference_mode():
            view = weight.t()
            view.add_(1.0)
            weight.mul_(2.0)
        weight.add_(1.0)
        versions[device] = (weight._version, view._version, torch.is_inference(view), weight.sum().item())
    assert versions["tardy"] == versions["cpu"] == (3, 3, False, 36.0)


def _tiny_gpt2() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    return transformers.GPT2LMHeadModel(config).eval()


def _tiny_llama() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=64, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config).eval()


def _tiny_unet() -> torch.nn.Module:
    diffusers = pytest.importorskip("diffusers")
    return diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, norm_num_groups=8, attention_head_dim=4,
    ).eval()


def _with_buffers() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).eval()


@pytest.mark.parametrize("build", [_tiny_gpt2, _tiny_llama, _tiny_unet, _with_buffers], ids=lambda f: f.__name__[1:])
@pytest.mark.parametrize("in_inference", [False, True], ids=["outside", "inside_inference_mode"])
def test_deepcopy_of_a_model_on_the_device_is_the_cpu_deepcopy(build: Callable[[], torch.nn.Module], in_inference: bool) -> None:
    model = build()
    with torch.inference_mode(in_inference):
        expected = copy.deepcopy(model).state_dict()
    model.to("tardy")
    with torch.inference_mode(in_inference):
        got = copy.deepcopy(model).state_dict()
    kept = model.state_dict()
    assert list(got) == list(expected)
    for name, tensor in got.items():
        assert tensor.device == kept[name].device and tensor.data_ptr() != kept[name].data_ptr(), name
        assert torch.is_inference(tensor) == torch.is_inference(expected[name]), name
        assert torch.equal(tensor.cpu(), expected[name]), name


def test_save_and_load_round_trip_a_device_tensor() -> None:
    x = torch.randn(3, 5, device="tardy")[:, 1:4]
    buffer = io.BytesIO()
    torch.save({"x": x}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)["x"]
    assert loaded.device == x.device and loaded.stride() == x.stride()
    assert torch.equal(loaded.cpu(), x.cpu())


def test_generate_under_inference_mode_gives_the_cpu_tokens() -> None:
    model = _tiny_gpt2()
    ids = torch.randint(0, 64, (2, 5))
    options: dict[str, object] = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), **options)  # type: ignore[operator]
    model.to("tardy")
    with torch.inference_mode():
        got = model.generate(ids.to("tardy"), attention_mask=torch.ones_like(ids).to("tardy"), **options)  # type: ignore[operator]
    assert got.device.type == "tardy" and got.shape == (2, 13)
    assert torch.equal(got.cpu(), expected)


def test_the_suite_stops_loudly_when_the_device_cannot_be_built(tmp_path: Path) -> None:
    env = {**os.environ, "CXX": "/bin/false", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_format.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert "the test accelerator could not be built" in done.stdout + done.stderr
