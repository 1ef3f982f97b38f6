"""``torchsurgery.from_pretrained``: a model built from its folder's config and streamed from the folder's files.

The reference is the model the library's own ``from_pretrained`` loads from the same folder.
Its parameters are views of the file's memory map, at addresses a kernel may take another
path for (a conv's last bit differs); they are copied into memory of their own first, as
the offload's ring holds them, so that outputs compare bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import diffusers
import pytest
import torch
import transformers
from safetensors.torch import save_file
from torch import nn

import torchsurgery
from torchsurgery import _undo

LLAMA = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2)
UNET = dict(sample_size=8, in_channels=3, out_channels=3, block_out_channels=(8, 16), layers_per_block=1,
            norm_num_groups=4, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"), attention_head_dim=8)
TOKENS = torch.tensor([[1, 5, 9, 33, 2, 63, 17]])


def _own_memory(model: nn.Module) -> nn.Module:
    """``model`` with each parameter in memory of its own (not a view of a file's map)."""
    for p in model.parameters():
        p.data = p.data.clone()
    return model.eval()


def _handle(model: nn.Module) -> Any:
    (record,) = [r for r in _undo.records(model) if r.kind == "offload"]
    return record.handle


def _save_llama(folder: Path, tied: bool) -> Path:
    """A bf16 Llama saved by ``save_pretrained`` in shards of about 20 KB, with its generation config."""
    config = transformers.LlamaConfig(**LLAMA, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config.repetition_penalty = 1.5  # read from the folder's generation_config.json
    model.save_pretrained(folder, max_shard_size="20KB")
    assert len(list(folder.glob("model-*.safetensors"))) > 3 and (folder / "model.safetensors.index.json").is_file()
    return folder


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    return _save_llama(tmp_path_factory.mktemp("llama"), tied=True)


@pytest.mark.parametrize(("tied", "dtype"), [(True, None), (False, torch.float32)], ids=["tied-file-dtype", "untied-float32"])
def test_llama_folder_gives_the_library_s_outputs(
    llama_folder: Path, tmp_path: Path, tied: bool, dtype: torch.dtype | None
) -> None:
    if not tied:
        llama_folder = _save_llama(tmp_path, tied=False)
    options = {} if dtype is None else {"dtype": dtype}
    expected = _own_memory(transformers.LlamaForCausalLM.from_pretrained(llama_folder, **options))
    model = torchsurgery.from_pretrained(transformers.LlamaForCausalLM, llama_folder, dtype=dtype)
    assert not model.training and model.dtype == expected.dtype
    # buffers the checkpoint leaves out (rotary tables) as the library computes them
    buffers = dict(expected.named_buffers())
    assert {n: (b.dtype, b.shape) for n, b in model.named_buffers()} == {n: (b.dtype, b.shape) for n, b in buffers.items()}
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    with torch.no_grad():
        assert torch.equal(model(TOKENS).logits, expected(TOKENS).logits)
    assert all(p.is_meta for p in model.parameters())  # never materialised: read from the files as it runs
    assert model.config.tie_word_embeddings == (model.lm_head.weight is model.model.embed_tokens.weight)
    assert model.generation_config.to_dict() == expected.generation_config.to_dict()
    generated = model.generate(TOKENS, max_new_tokens=6, do_sample=False)
    assert torch.equal(generated, expected.generate(TOKENS, max_new_tokens=6, do_sample=False))
    assert torchsurgery.restore(model) is model  # the offload is in the undo log: the skeleton comes back
    assert torchsurgery.surgery_log(model) == [] and all(p.is_meta for p in model.parameters())


def test_config_overrides_and_a_budget(llama_folder: Path) -> None:
    expected = _own_memory(transformers.LlamaForCausalLM.from_pretrained(llama_folder, num_hidden_layers=2))
    budget = 30_000  # a few groups resident (read from the files once), the others streamed
    model = torchsurgery.from_pretrained(transformers.LlamaForCausalLM, llama_folder, num_hidden_layers=2, budget=budget)
    assert len(model.model.layers) == 2
    with torch.no_grad():
        assert torch.equal(model(TOKENS).logits, expected(TOKENS).logits)
    stats = _handle(model).stats()
    assert stats.resident_groups and stats.streamed_groups and 0 < stats.resident_bytes <= budget


def test_unet_in_a_diffusers_subfolder(tmp_path: Path) -> None:
    diffusers.UNet2DModel(**UNET).to(torch.bfloat16).save_pretrained(tmp_path / "unet", max_shard_size="20KB")
    assert (tmp_path / "unet" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    expected = _own_memory(diffusers.UNet2DModel.from_pretrained(tmp_path, subfolder="unet"))
    model = torchsurgery.from_pretrained(diffusers.UNet2DModel, tmp_path, subfolder="unet")
    sample = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(model(sample, 3).sample, expected(sample, 3).sample)
    assert model.dtype == expected.dtype == torch.float32 and all(p.is_meta for p in model.parameters())
    torchsurgery.restore(model)
    assert torchsurgery.surgery_log(model) == []


def test_a_comfyui_fp8_scaled_folder(tmp_path: Path) -> None:
    """A folder whose model.safetensors is in ComfyUI's "fp8 scaled" layout streams the values it stands for."""
    config = transformers.LlamaConfig(**LLAMA, tie_word_embeddings=False)
    plain = transformers.LlamaForCausalLM(config).eval()
    config.save_pretrained(tmp_path)
    state, values = {}, {}
    for key, value in plain.state_dict().items():
        if key.endswith("proj.weight"):
            scale = value.abs().amax() / torch.finfo(torch.float8_e4m3fn).max
            state[key], state[key.replace("weight", "scale_weight")] = (value / scale).to(torch.float8_e4m3fn), scale
            values[key] = state[key].float() * scale
        else:
            state[key] = values[key] = value
    save_file({**state, "scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}, tmp_path / "model.safetensors")
    plain.load_state_dict(values)
    model = torchsurgery.from_pretrained(transformers.LlamaForCausalLM, tmp_path, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS).logits, plain(TOKENS).logits, rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused_clearly(llama_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="cls must be a transformers PreTrainedModel or a diffusers ModelMixin"):
        torchsurgery.from_pretrained(nn.Linear, llama_folder)  # type: ignore[type-var]
    with pytest.raises(FileNotFoundError, match="is not a directory.*snapshot_download"):
        torchsurgery.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "meta-llama/Llama-3-8B")
    transformers.LlamaConfig(**LLAMA).save_pretrained(tmp_path)
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"holds only \['pytorch_model.bin'\].*safe_serialization=True"):
        torchsurgery.from_pretrained(transformers.LlamaForCausalLM, tmp_path)
    with pytest.raises(ValueError, match=r"kwargs names no setting of the config.*\['num_hiden_layers'\]"):
        torchsurgery.from_pretrained(transformers.LlamaForCausalLM, llama_folder, num_hiden_layers=2)


def test_host_budget_reaches_offload(llama_folder: Path) -> None:
    expected = _own_memory(transformers.LlamaForCausalLM.from_pretrained(llama_folder))
    model = torchsurgery.from_pretrained(transformers.LlamaForCausalLM, llama_folder, host_budget=1 << 20)
    assert _handle(model)._options["host_budget"] == 1 << 20
    with torch.no_grad():
        assert torch.equal(model(TOKENS).logits, expected(TOKENS).logits)


# measured in a process of its own: torch and transformers imported, then the peak reset
_MEASURE = textwrap.dedent("""
    import json, sys
    import torch, transformers
    import torchsurgery

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    with torchsurgery.skeleton():  # the lazy imports of the model's modules, before the peak is reset
        transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(sys.argv[1], num_hidden_layers=1))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident size starts again from the current one
    base = status("VmRSS")
    reset = status("VmHWM") - base
    model = torchsurgery.from_pretrained(transformers.LlamaForCausalLM, sys.argv[1], host_budget=int(sys.argv[2]))
    with torch.no_grad():
        for _ in range(2):  # the host tier filled by the first, kept through the second
            model(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]))
    meta = all(p.is_meta for p in model.parameters())
    (record,) = [r for r in torchsurgery._undo.records(model) if r.kind == "offload"]
    group = max(g.nbytes for g in record.handle.plan.groups if not g.resident)
    print(json.dumps(dict(growth=status("VmHWM") - base, reset=reset, group=group, meta=meta,
                          read=record.handle.stats().bytes_moved)))
""")


def _save_big_llama(folder: Path, layers: int) -> int:
    """An fp32 Llama of ``layers`` layers of 13.6 MB (a small vocabulary) as 6 shards and their index."""
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1536, num_hidden_layers=layers,
                                      num_attention_heads=8, tie_word_embeddings=False)
    config.save_pretrained(folder)
    with torchsurgery.skeleton():
        shapes = {k: v.shape for k, v in transformers.LlamaForCausalLM(config).state_dict().items()}
    weight_map, total = {}, 0
    for shard in range(6):
        name = f"model-{shard:05d}-of-00006.safetensors"
        keys = [k for i, k in enumerate(shapes) if i % 6 == shard]
        state = {k: torch.full(shapes[k], 0.01) for k in keys}  # values do not matter here
        save_file(state, folder / name)
        total += sum(v.nbytes for v in state.values())
        weight_map.update(dict.fromkeys(keys, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return total


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable peak (VmHWM)")
@pytest.mark.parametrize("layers", [pytest.param(12, marks=pytest.mark.slow), 6], ids=["165MB", "83MB"])
def test_peak_memory_stays_two_groups_above_the_start(tmp_path: Path, layers: int) -> None:
    """Loading and running a checkpoint raises the peak resident size by at most two streamed
    groups, the host budget and 96 MiB: each group is read as it runs, one group kept in host
    memory, the weights never materialised (``meta`` after the forwards). At 165 MB, the model
    alone exceeds the bound."""
    total = _save_big_llama(tmp_path, layers)
    host_budget = 14 << 20  # one layer (13.6 MB) kept between forwards
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path), str(host_budget)], capture_output=True, text=True, env=env, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["reset"] < 16 << 20, "writing 5 to /proc/self/clear_refs did not reset the peak"
    assert found["meta"] and found["read"] >= total
    assert found["growth"] <= 2 * found["group"] + host_budget + (96 << 20), found
    print(f"peak RSS growth {found['growth'] / 2**20:.1f} MiB for {total / 2**20:.0f} MiB of weights")
