"""DynamicSwapInstaller on transformers models: bit for bit the plain model with converted weights.

The seed's contract: a weight is converted (``Tensor.to(**kwargs)``), then the layer's own
kernel runs. So an installed model computes exactly what the plain model computes after
its weights went through the same conversion: ``generate()`` scores, hidden states and
gradients compared with ``torch.equal``, not within a tolerance. Each architecture is built
from a tiny config (random weights, no download).

What is stored and what is computed:

* ``bf16_to_fp32`` (FramePack's case): weights stored in bf16, installed with
  ``dtype=torch.float32``; the reference is an fp32 copy of the bf16 weights (their values
  exactly);
* ``fp32_to_bf16``: weights stored in fp32, installed with ``dtype=torch.bfloat16``; the
  reference is a copy converted with ``.to(torch.bfloat16)``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from torchsurgery import DynamicSwapInstaller

transformers = pytest.importorskip("transformers")

VOCAB = 100
IDS = torch.tensor([[5, 9, 3, 7, 12, 2, 41, 77]])
COMMON: dict[str, Any] = {"vocab_size": VOCAB, "attn_implementation": "eager"}


def _decoder(config_cls: Any, model_cls: Any, **extra: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        config = config_cls(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=64, **COMMON, **extra)
        return model_cls(config)

    return make


def _neox() -> nn.Module:
    config = transformers.GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=64, **COMMON)
    return transformers.GPTNeoXForCausalLM(config)


def _t5() -> nn.Module:
    config = transformers.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
                                   **COMMON)
    return transformers.T5ForConditionalGeneration(config)


def _bart() -> nn.Module:
    config = transformers.BartConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                     max_position_embeddings=64, **COMMON)
    return transformers.BartForConditionalGeneration(config)


# default weight tying of each family kept (Gemma, T5 and BART tie their embeddings)
ARCHITECTURES: dict[str, Callable[[], nn.Module]] = {
    "llama": _decoder(transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": _decoder(transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "mistral": _decoder(transformers.MistralConfig, transformers.MistralForCausalLM),
    "gemma": _decoder(transformers.GemmaConfig, transformers.GemmaForCausalLM, head_dim=8),
    "gpt_neox": _neox,
    "t5": _t5,
    "bart": _bart,
}

# (stored, computed)
CONVERSIONS = {"bf16_to_fp32": (torch.bfloat16, torch.float32), "fp32_to_bf16": (torch.float32, torch.bfloat16)}


def _installed_and_reference(arch: str, conversion: str) -> tuple[nn.Module, nn.Module, torch.dtype]:
    """The model stored in one dtype and installed to compute in another; the plain model converted so."""
    stored, computed = CONVERSIONS[conversion]
    model = ARCHITECTURES[arch]().eval().to(stored)
    reference = copy.deepcopy(model).to(computed)  # Module.to converts floating tensors only, as the installer does
    DynamicSwapInstaller.install_model(model, device="cpu", dtype=computed)
    return model, reference, computed


def _generate(model: nn.Module) -> Any:
    return model.generate(IDS, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0,
                          output_scores=True, return_dict_in_generate=True)


def _forward(model: nn.Module, **kwargs: Any) -> Any:
    extra = {"decoder_input_ids": IDS[:, :3]} if model.config.is_encoder_decoder else {}
    return model(IDS, **extra, **kwargs)


def _differing(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"{int((a != b).sum())} of {a.numel()} values differ"


def _hidden_states(out: Any) -> list[torch.Tensor]:
    return [h for key in out if "hidden_states" in key for h in out[key]]


@pytest.mark.parametrize("conversion", sorted(CONVERSIONS))
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_generate_scores_and_hidden_states_are_bitwise_those_of_the_converted_model(arch: str, conversion: str) -> None:
    model, reference, computed = _installed_and_reference(arch, conversion)
    assert model.dtype == computed and next(model.parameters()).dtype == computed
    with torch.no_grad():
        got, want = _generate(model), _generate(reference)
        assert torch.equal(got.sequences, want.sequences)
        assert len(got.scores) == len(want.scores) == 4
        for step, (a, b) in enumerate(zip(got.scores, want.scores, strict=True)):
            assert a.dtype == b.dtype and torch.equal(a, b), f"step {step}: {_differing(a, b)}"
        got_out, want_out = _forward(model, output_hidden_states=True), _forward(reference, output_hidden_states=True)
    assert torch.equal(got_out.logits, want_out.logits)
    got_hidden, want_hidden = _hidden_states(got_out), _hidden_states(want_out)
    assert len(got_hidden) == len(want_hidden) > 2
    for i, (a, b) in enumerate(zip(got_hidden, want_hidden, strict=True)):
        assert a.dtype == b.dtype == computed and torch.equal(a, b), f"hidden state {i}: {_differing(a, b)}"
    DynamicSwapInstaller.uninstall_model(model)
    assert {p.dtype for p in model.parameters()} == {CONVERSIONS[conversion][0]}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_training_gets_the_converted_model_s_gradients_and_updates_the_stored_weights(arch: str) -> None:
    model, reference, _ = _installed_and_reference(arch, "bf16_to_fp32")
    # in eval mode, so that no dropout draws differ: gradients flow all the same
    labels = IDS[:, :3] if model.config.is_encoder_decoder else IDS
    losses = []
    for m in (model, reference):
        loss = _forward(m, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    ours, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        assert p.grad is not None and theirs[name].grad is not None, name
        assert torch.equal(p.grad, theirs[name].grad), f"{name}: {_differing(p.grad, theirs[name].grad)}"
    for m in (model, reference):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    DynamicSwapInstaller.uninstall_model(model)
    # the step computed in fp32 and stored back in bf16: the reference's result rounded to bf16
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, theirs[name].to(torch.bfloat16)), name
