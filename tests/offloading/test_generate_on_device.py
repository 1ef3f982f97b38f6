"""Whole programs on a model offloaded to the accelerator: ``generate()`` and a diffusers pipeline.

An offloaded model reads as a model on the device it computes on (``model.device``,
``next(model.parameters()).device``), so the programs that move their inputs to it run
unchanged. Each program runs under ``torch.inference_mode()`` with a budget below the
model's size (streamed groups), and is compared with the same program on the plain model
moved to the same device: tokens and scores with ``torch.equal`` (the same kernels run on
the same device, only the weights' way there differs).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import torchsurgery
from torchsurgery.offloading import OffloadHandle

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.accelerator

VOCAB = 96
PAD = 0


def _decoder(config_cls: Any, model_cls: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        config = config_cls(
            hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
        )
        return model_cls(config)

    return make


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=4, n_embd=32, n_head=4, n_positions=64, vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
    )
    return transformers.GPT2LMHeadModel(config)


ARCHITECTURES: dict[str, Callable[[], nn.Module]] = {
    "gpt2": _gpt2,
    "llama": _decoder(transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": _decoder(transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
}


def _size(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _streaming_budget(model: nn.Module, device: torch.device) -> int:
    """The least budget an offload accepts: the ring's slots and a run's casts, nothing resident."""
    with pytest.raises(torchsurgery.BudgetError) as refused:
        torchsurgery.plan_offload(model, device, budget=1)
    assert refused.value.needed < _size(model), "the model must be larger than what streaming holds"
    return refused.value.needed


def _pair(arch: str, device: torch.device) -> tuple[nn.Module, nn.Module, OffloadHandle]:
    """The plain model on ``device`` and a copy offloaded there under less than its size."""
    torch.manual_seed(0)
    plain = ARCHITECTURES[arch]().eval()
    model = copy.deepcopy(plain)
    plain.to(device)
    handle = torchsurgery.offload(model, device, budget=_streaming_budget(model, device))
    assert handle.stats().streamed_groups, "the budget should leave groups streaming"
    return plain, model, handle


@pytest.fixture(params=sorted(ARCHITECTURES))
def pair(request: pytest.FixtureRequest, accelerator: torch.device) -> Any:
    plain, model, handle = _pair(request.param, accelerator)
    yield plain, model
    handle.remove()


def _prompts(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of different lengths, left-padded as a tokenizer pads them for generation."""
    ids = torch.tensor([[PAD, PAD, 5, 9, 3, 7], [11, 4, 8, 23, 17, 6]])
    mask = (ids != PAD).long()
    return ids.to(device), mask.to(device)


def _same_output(a: Any, b: Any) -> None:
    """The same tokens, and scores within float32's rounding.

    Not bit for bit: the first step's logits come from ``lm_head`` on the last position of
    the prefill (a strided input), where the CPU's matmul sums in an order that depends on
    where the weight's memory lies: the plain layer with a clone of its own weight differs
    from itself by one unit in the last place there (checked in
    ``test_a_clone_of_the_plain_weight_differs_as_much``); every other step is exact.
    """
    assert a.sequences.device == b.sequences.device
    assert torch.equal(a.sequences, b.sequences)
    assert len(a.scores) == len(b.scores)
    for x, y in zip(a.scores, b.scores, strict=True):
        torch.testing.assert_close(x, y)


def test_the_offloaded_model_reads_as_a_model_on_the_device(pair: Any, accelerator: torch.device) -> None:
    plain, model = pair
    assert model.device == plain.device
    assert next(model.parameters()).device == next(plain.parameters()).device
    assert {p.device for p in model.parameters()} == {p.device for p in plain.parameters()}
    assert model.dtype == plain.dtype


def test_greedy_generation_equals_the_plain_model_on_the_device(pair: Any, accelerator: torch.device) -> None:
    plain, model = pair
    ids, mask = _prompts(accelerator)
    kwargs: dict[str, Any] = {"max_new_tokens": 8, "do_sample": False, "output_scores": True, "return_dict_in_generate": True}
    with torch.inference_mode():
        want = plain.generate(ids, attention_mask=mask, **kwargs)
        got = model.generate(ids, attention_mask=mask, **kwargs)
        # prompts on the host: what the plain model on the device gives them
        want_host = plain.generate(ids.cpu(), attention_mask=mask.cpu(), **kwargs)
        got_host = model.generate(ids.cpu(), attention_mask=mask.cpu(), **kwargs)
    _same_output(got, want)
    _same_output(got_host, want_host)


def test_seeded_sampling_equals_the_plain_model_on_the_device(pair: Any, accelerator: torch.device) -> None:
    plain, model = pair
    ids, mask = _prompts(accelerator)
    kwargs: dict[str, Any] = {
        "max_new_tokens": 8, "do_sample": True, "top_k": 20, "temperature": 0.8,
        "output_scores": True, "return_dict_in_generate": True,
    }
    outs = []
    with torch.inference_mode():
        for m in (plain, model):
            torch.manual_seed(7)
            outs.append(m.generate(ids, attention_mask=mask, **kwargs))
    _same_output(outs[1], outs[0])


def test_static_cache_generation_equals_the_plain_model_on_the_device(pair: Any, accelerator: torch.device) -> None:
    plain, model = pair
    ids, mask = _prompts(accelerator)
    kwargs: dict[str, Any] = {
        "max_new_tokens": 6, "do_sample": False, "cache_implementation": "static",
        "output_scores": True, "return_dict_in_generate": True,
    }
    with torch.inference_mode():
        want = plain.generate(ids, attention_mask=mask, **kwargs)
        got = model.generate(ids, attention_mask=mask, **kwargs)
    _same_output(got, want)


def test_a_clone_of_the_plain_weight_differs_as_much(accelerator: torch.device) -> None:
    # why _same_output allows rounding: the plain head, the same values in other memory
    plain, model, handle = _pair("llama", accelerator)
    handle.remove()
    ids, mask = _prompts(accelerator)
    with torch.inference_mode():
        last = plain.model(ids, attention_mask=mask).last_hidden_state[:, -1:, :]
        cloned = torch.nn.functional.linear(last, plain.lm_head.weight.clone())
        torch.testing.assert_close(cloned, plain.lm_head(last))


def test_hidden_states_and_logits_come_back_on_the_device(pair: Any, accelerator: torch.device) -> None:
    plain, model = pair
    ids, mask = _prompts(accelerator)
    with torch.inference_mode():
        want = plain(ids, attention_mask=mask, output_hidden_states=True)
        got = model(ids, attention_mask=mask, output_hidden_states=True)
    assert got.logits.device == want.logits.device
    assert torch.equal(got.logits, want.logits)
    for x, y in zip(got.hidden_states, want.hidden_states, strict=True):
        assert torch.equal(x, y)


def test_remove_gives_back_the_model_on_the_host(accelerator: torch.device) -> None:
    plain, model, handle = _pair("llama", accelerator)
    params = list(model.parameters())
    with torch.inference_mode():
        model.generate(_prompts(accelerator)[0], max_new_tokens=2, do_sample=False)
    handle.remove()
    assert [p for p in model.parameters()] == params  # the same objects
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert all(type(p) is nn.Parameter for p in model.parameters())
    for mine, theirs in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(mine, theirs.cpu())


def test_a_diffusers_pipeline_with_an_offloaded_unet_equals_the_plain_pipeline(accelerator: torch.device) -> None:
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=8, add_attention=False,  # attention's strided output meets group_norm: see docs/hardware.md (tardy)
    ).eval()
    offloaded = copy.deepcopy(unet)
    plain = diffusers.DDPMPipeline(unet=unet, scheduler=diffusers.DDPMScheduler(num_train_timesteps=50)).to(accelerator)
    handle = torchsurgery.offload(offloaded, accelerator, budget=_streaming_budget(offloaded, accelerator))
    assert handle.stats().streamed_groups
    ours = diffusers.DDPMPipeline(unet=offloaded, scheduler=diffusers.DDPMScheduler(num_train_timesteps=50))
    assert ours.device == plain.device  # the pipeline reads its execution device from the UNet
    images = []
    with torch.inference_mode():
        for pipe in (plain, ours):
            generator = torch.Generator().manual_seed(3)
            images.append(pipe(batch_size=2, num_inference_steps=4, generator=generator, output_type="pt").images)
    assert torch.equal(images[0], images[1])
    handle.remove()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_model_under_the_installer_reads_as_the_device_and_generates_as_the_plain_model(
    arch: str, accelerator: torch.device
) -> None:
    torch.manual_seed(0)
    model = ARCHITECTURES[arch]().eval()
    plain = copy.deepcopy(model).to(accelerator)
    params = list(model.parameters())
    torchsurgery.DynamicSwapInstaller.install_model(model, device=accelerator)
    assert model.device == plain.device and next(model.parameters()).device == accelerator
    assert all(p.stored.device.type == "cpu" for p in model.parameters())  # kept on the host
    ids, mask = _prompts(accelerator)
    kwargs: dict[str, Any] = {"max_new_tokens": 6, "do_sample": False, "output_scores": True, "return_dict_in_generate": True}
    with torch.inference_mode():
        _same_output(model.generate(ids, attention_mask=mask, **kwargs), plain.generate(ids, attention_mask=mask, **kwargs))
    torchsurgery.DynamicSwapInstaller.uninstall_model(model)
    assert list(model.parameters()) == params and all(type(p) is nn.Parameter for p in params)
    assert {p.device.type for p in params} == {"cpu"}


def test_an_offload_over_the_installer_s_model_streams_its_host_values_and_gives_them_back(accelerator: torch.device) -> None:
    # FramePack's low-VRAM pattern: the installer first, then a partial load by the pool's offload
    torch.manual_seed(0)
    model = ARCHITECTURES["llama"]().eval()
    plain = copy.deepcopy(model).to(accelerator)
    torchsurgery.DynamicSwapInstaller.install_model(model, device=accelerator)
    installed = {name: (type(p), p.stored) for name, p in model.named_parameters()}
    handle = torchsurgery.offload(model, accelerator, budget=_streaming_budget(model, accelerator))
    streamed = [p for p in handle.plan.params if p.residency.value == "streamed"]
    assert streamed, "the installer's weights are packed and streamed as their host values"
    assert model.device == accelerator
    ids, mask = _prompts(accelerator)
    kwargs: dict[str, Any] = {"max_new_tokens": 4, "do_sample": False, "output_scores": True, "return_dict_in_generate": True}
    with torch.inference_mode():
        _same_output(model.generate(ids, attention_mask=mask, **kwargs), plain.generate(ids, attention_mask=mask, **kwargs))
    handle.remove()
    for name, p in model.named_parameters():  # reading as the device again, values on the host
        kind, stored = installed[name]
        assert type(p) is kind and p.device == accelerator and p.stored.device.type == "cpu"
        assert torch.equal(p.stored, stored)
    torchsurgery.DynamicSwapInstaller.uninstall_model(model)


def test_two_threads_serving_two_requests_on_one_streamed_model(accelerator: torch.device) -> None:
    plain, model, handle = _pair("llama", accelerator)
    ids, mask = _prompts(accelerator)
    requests = [(ids[:1], mask[:1]), (ids[1:], mask[1:])]
    kwargs: dict[str, Any] = {"max_new_tokens": 6, "do_sample": False}
    with torch.inference_mode():
        want = [plain.generate(i, attention_mask=m, **kwargs) for i, m in requests]
    got: list[Any] = [None, None]
    errors: list[BaseException] = []

    def serve(k: int) -> None:
        try:
            with torch.inference_mode():
                for _ in range(2):
                    got[k] = model.generate(requests[k][0], attention_mask=requests[k][1], **kwargs)
        except BaseException as exc:  # reported below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=serve, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread is stuck"
    assert not errors, errors
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    handle.remove()
