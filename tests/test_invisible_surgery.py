"""Surgery is invisible to the programs that use a model: transformers' ``generate()`` and friends.

Every architecture is built from a small config (random weights) and run as people run it:
``generate()`` greedy and with seeded sampling (its scores compared), a forward with
``output_hidden_states``/``output_attentions``, and what programs read from the model
(``model.dtype``, the first parameter's dtype, ``inspect.signature(model.forward)``, which
``generate()`` reads to decide whether to pass ``logits_to_keep``). The reference is the plain
model: exactly, where the surgery changes no dtype; where it stores weights narrower than they
compute, the same model with the weights rounded to the storage dtype, computed in fp32.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import torchsurgery
from test_patching_class_identity import (  # a pass-through forward, and no forward at all
    Counted,
    Tag,
)
from torchsurgery import DEFAULT_SKIP, DynamicSwapInstaller, FlexModel, HookFunction

transformers = pytest.importorskip("transformers")

IDS = torch.tensor([[5, 9, 3, 7, 12, 2]])
SMALL = {"vocab_size": 64, "attn_implementation": "eager"}


def _decoder(config_cls: Any, model_cls: Any, **extra: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        config = config_cls(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
                            **SMALL, **extra)
        return model_cls(config).eval()

    return make


def _neox() -> nn.Module:
    config = transformers.GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=64, **SMALL)
    return transformers.GPTNeoXForCausalLM(config).eval()


def _t5() -> nn.Module:
    config = transformers.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
                                   **SMALL)
    return transformers.T5ForConditionalGeneration(config).eval()


def _bart() -> nn.Module:
    config = transformers.BartConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                     max_position_embeddings=64, **SMALL)
    return transformers.BartForConditionalGeneration(config).eval()


ARCHITECTURES: dict[str, Callable[[], nn.Module]] = {
    "llama": _decoder(transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": _decoder(transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "mistral": _decoder(transformers.MistralConfig, transformers.MistralForCausalLM),
    "gpt_neox": _neox,
    "t5": _t5,
    "bart": _bart,
}


def _rounded(model: nn.Module, skip: Callable[[nn.Module, str], bool] | None = DEFAULT_SKIP) -> nn.Module:
    """A copy with every weight an offload would store in bf16 rounded to bf16 (fp32 otherwise)."""
    reference = copy.deepcopy(model)
    kept = {id(p) for n, m in reference.named_modules() if skip is not None and skip(m, n) for p in m.parameters(recurse=False)}
    with torch.no_grad():
        for p in reference.parameters():
            if id(p) not in kept:
                p.copy_(p.bfloat16().float())
    return reference


# a surgery: model -> (the model to run, the reference it must equal, undo, whether values are exact)
Surgery = Callable[[nn.Module], tuple[nn.Module, nn.Module, Callable[[], None], bool]]


def _offload(model: nn.Module) -> tuple[nn.Module, nn.Module, Callable[[], None], bool]:
    reference = _rounded(model)
    handle = torchsurgery.offload(model, storage_dtype=torch.bfloat16, dtype=torch.float32)
    return model, reference, lambda: handle.remove() and None, False


def _dynamic_swap(model: nn.Module) -> tuple[nn.Module, nn.Module, Callable[[], None], bool]:
    # a model stored in bf16, computing in fp32 (the installer's dtype)
    model.to(torch.bfloat16)
    reference = copy.deepcopy(model).float()
    DynamicSwapInstaller.install_model(model, dtype=torch.float32)
    # each weight converted, then the layer's own kernel: exactly the fp32 copy of the bf16 model
    return model, reference, lambda: DynamicSwapInstaller.uninstall_model(model), True


def _flex(model: nn.Module) -> tuple[nn.Module, nn.Module, Callable[[], None], bool]:
    reference = copy.deepcopy(model)
    captured: dict[str, Any] = {}
    flex = FlexModel(model, captured)
    layers = [n for n, m in model.named_modules() if n.endswith(".0") and isinstance(m, nn.Module)]
    flex.register_forward_hook(HookFunction(layers[0]))
    return model, reference, flex.restore, True


def _patches(model: nn.Module) -> tuple[nn.Module, nn.Module, Callable[[], None], bool]:
    reference = copy.deepcopy(model)
    modules = list(model.modules())
    for module in modules[1:]:
        torchsurgery.patch(module, Tag)
    torchsurgery.patch(model, Counted)
    return model, reference, lambda: torchsurgery.restore(model) and None, True


SURGERIES: dict[str, Surgery] = {"offload": _offload, "dynamic_swap": _dynamic_swap, "flex": _flex, "patches": _patches}


def _generate(model: nn.Module, sample: bool) -> Any:
    torch.manual_seed(7)
    kwargs: dict[str, Any] = {"do_sample": True, "top_k": 0} if sample else {"do_sample": False}
    return model.generate(IDS, max_new_tokens=6, min_new_tokens=6, pad_token_id=0, output_scores=True,
                          return_dict_in_generate=True, **kwargs)


def _recorded(model: nn.Module) -> dict[str, Any]:
    extra = {"decoder_input_ids": IDS[:, :3]} if model.config.is_encoder_decoder else {}
    out = model(IDS, output_hidden_states=True, output_attentions=True, **extra)
    keys = [k for k in out if "hidden_states" in k or "attentions" in k]
    return {"logits": out.logits, **{k: out[k] for k in keys}}


@pytest.mark.parametrize("surgery", sorted(SURGERIES))
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_generate_and_what_programs_read_are_those_of_the_plain_model(arch: str, surgery: str) -> None:
    model = ARCHITECTURES[arch]()
    signature = inspect.signature(model.forward)
    assert "logits_to_keep" in signature.parameters or model.config.is_encoder_decoder
    with torch.no_grad():
        model, reference, undo, exact = SURGERIES[surgery](model)
        tolerance = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-5}
        # what programs read: as for the plain model computing in fp32
        assert (model.dtype, next(model.parameters()).dtype) == (torch.float32, torch.float32)
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert inspect.signature(model.forward) == signature
        for sample in (False, True):
            got, expected = _generate(model, sample), _generate(reference, sample)
            assert torch.equal(got.sequences, expected.sequences), (sample, got.sequences, expected.sequences)
            torch.testing.assert_close(got.scores, expected.scores, **tolerance)
        got_rec, expected_rec = _recorded(model), _recorded(reference)
        assert all(v is not None and len(v) > 0 for v in got_rec.values())
        torch.testing.assert_close(got_rec, expected_rec, **tolerance)
        undo()
    assert torchsurgery.surgery_log(model) == []


@pytest.mark.parametrize("surgery", ["dynamic_swap", "patches"])
def test_generate_passes_logits_to_keep_through_a_class_swap(surgery: str) -> None:
    # generate() passes logits_to_keep=1 only where inspect.signature(forward) names it: the LM
    # head then runs on the last position alone, as for the plain model
    model = ARCHITECTURES["llama"]()
    seen: list[int] = []
    model.lm_head.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    with torch.no_grad():
        model.generate(IDS, max_new_tokens=2, do_sample=False, pad_token_id=0)
        plain = list(seen)
        model, _, undo, _ = SURGERIES[surgery](model)
        seen.clear()
        model.generate(IDS, max_new_tokens=2, do_sample=False, pad_token_id=0)
        assert seen == plain == [1, 1]
        model(IDS, logits_to_keep=1)  # and passing it by hand is accepted
        undo()


# ---------------------------------------------------------------------------
# diffusers: a pipeline reads unet.dtype to cast its latents


def _tiny_stable_diffusion(tmp_path: Any) -> dict[str, Any]:
    diffusers = pytest.importorskip("diffusers")
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1, **{f"{c}</w>": i + 2 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")}}
    (tmp_path / "vocab.json").write_text(__import__("json").dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = transformers.CLIPTokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"), model_max_length=8)
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, attention_head_dim=4, norm_num_groups=4,
    ).eval()
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(8,), latent_channels=4, norm_num_groups=4, sample_size=16,
    ).eval()
    text_encoder = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64,
        max_position_embeddings=8,
    )).eval()
    scheduler = diffusers.DDIMScheduler(clip_sample=False)
    return {"unet": unet, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer, "scheduler": scheduler,
            "safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}


def test_stable_diffusion_with_an_offloaded_unet_equals_diffusers_layerwise_casting(tmp_path: Any) -> None:
    import diffusers

    parts = _tiny_stable_diffusion(tmp_path)
    unet = parts.pop("unet")
    theirs = copy.deepcopy(unet)
    theirs.enable_layerwise_casting(storage_dtype=torch.bfloat16, compute_dtype=torch.float32)
    # the layers diffusers casts (convolutions and linears outside its skip patterns): ours store those
    cast = {n for n, m in theirs.named_modules()
            if getattr(m, "_diffusers_hook", None) is not None and m._diffusers_hook.get_hook("layerwise_casting")}
    ours = copy.deepcopy(unet)
    handle = torchsurgery.offload(ours, storage_dtype=torch.bfloat16, dtype=torch.float32, skip=lambda m, n: n not in cast)
    assert ours.dtype == theirs.dtype == torch.float32  # the pipeline casts its latents to unet.dtype
    images = {}
    with torch.no_grad():
        for name, model in (("theirs", theirs), ("ours", ours)):
            pipe = diffusers.StableDiffusionPipeline(unet=model, **parts)
            pipe.set_progress_bar_config(disable=True)
            images[name] = pipe("a cat", num_inference_steps=2, height=16, width=16, output_type="pt",
                                generator=torch.Generator().manual_seed(0)).images
    torch.testing.assert_close(images["ours"], images["theirs"], rtol=1e-5, atol=1e-5)
    handle.remove()
    assert all(type(p) is nn.Parameter and p.dtype == torch.float32 for p in ours.parameters())


# ---------------------------------------------------------------------------
# PEFT: LoRA adapters made in the dtype the base layer shows, trained through the offload


def _lora(model: nn.Module) -> nn.Module:
    peft = pytest.importorskip("peft")
    torch.manual_seed(11)  # the same adapters for every run (both matrices random: both get gradients)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    return peft.get_peft_model(model, config)


def _lora_step(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One AdamW step on a language-model loss: the adapters' gradients, then their new values."""
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(trainable.values(), lr=1e-2)
    ids = torch.tensor([[5, 9, 3, 7, 12, 2, 8, 1]])
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad.clone() for n, p in trainable.items()}
    optimizer.step()
    return grads, {n: p.detach().clone() for n, p in trainable.items()}


@pytest.mark.parametrize("lora_first", [True, False], ids=["lora_then_offload", "offload_then_lora"])
def test_peft_lora_trains_through_an_offload_with_an_fp32_master_as_in_fp32(lora_first: bool) -> None:
    base = ARCHITECTURES["llama"]()
    reference = _lora(copy.deepcopy(base))
    expected_grads, expected_values = _lora_step(reference)
    model = copy.deepcopy(base)
    kwargs: dict[str, Any] = {"storage_dtype": torch.bfloat16, "dtype": torch.float32, "master_dtype": torch.float32}
    if lora_first:
        model = _lora(model)
        handle = torchsurgery.offload(model, **kwargs)
    else:
        handle = torchsurgery.offload(model, **kwargs)
        model = _lora(model)
    adapters = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert adapters and all(p.dtype == torch.float32 for p in adapters.values())  # made in the dtype PEFT sees
    grads, values = _lora_step(model)
    assert grads.keys() == expected_grads.keys()
    # frozen base layers included, every forward that records gradients reads the fp32 masters
    torch.testing.assert_close(grads, expected_grads, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(values, expected_values, rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # without gradients the bf16 shadows serve, refreshed after the step
        inference = model(input_ids=IDS).logits
    shadowed = {n for n, p in model.named_parameters() if isinstance(p, torchsurgery.OffloadedTensor)}
    handle.remove()
    with torch.no_grad():
        rounded = _rounded(model, lambda m, n: not any(f"{n}.{k}" in shadowed for k in m._parameters))
        torch.testing.assert_close(inference, rounded(input_ids=IDS).logits, rtol=1e-5, atol=1e-5)
