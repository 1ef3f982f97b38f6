"""A compact ``storage_dtype`` for weights streamed from a checkpoint: converted as they are read.

The reference is the same model loaded plainly in memory and offloaded with the same
``storage_dtype`` and ``dtype`` (the in-memory offload): outputs equal it bit for bit,
whether a group sits in the disk tier (converted at every read), the host tier (converted
once, the converted bytes kept and counted) or on the device (converted as it is installed).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import save_file
from test_pretrained import _MEASURE, _save_big_llama
from torch import nn

import torchsurgery
from torchsurgery import _undo
from torchsurgery.compact import Scaled

LLAMA = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=True)
TOKENS = torch.tensor([[1, 5, 9, 33, 2, 63, 17]])
FORMATS = [torch.bfloat16, torch.float8_e4m3fn, Scaled(torch.float8_e4m3fn)]
FORMAT_IDS = ["bf16", "fp8", "scaled-fp8"]
X = torch.linspace(-2, 2, 3 * 16).reshape(3, 16)


def _handle(model: nn.Module) -> Any:
    (record,) = [r for r in _undo.records(model) if r.kind == "offload"]
    return record.handle


def _narrow_dtype(fmt: torch.dtype | Scaled) -> torch.dtype:
    return fmt.dtype if isinstance(fmt, Scaled) else fmt


def _bytes(handle: Any, model: nn.Module, tier: str, streamed: bool = False) -> tuple[int, int]:
    """(bytes the file stores, bytes kept: the storage format's, scales included) of the groups in
    ``tier`` (``streamed``: those still streamed, where a measured forward made some resident)."""
    names = set(handle.stats().streamed_groups) if streamed else {g.name for g in handle.plan.groups}
    groups = [g for g in handle.plan.groups if g.tier == tier and g.name in names]
    # a weight tied to one of another group is read and kept there too (within one group: once)
    params = [p for g in groups for p in g.params if p.tied_to not in {q.name for q in g.params}]
    numel = [p.lookup(model).numel() for p in params]
    stored = sum(n * p.storage_dtype.itemsize + p.scale_nbytes for n, p in zip(numel, params, strict=True))
    return sum(numel) * 4, stored  # the files here are fp32


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An fp32 Llama (tied embeddings) saved by ``save_pretrained`` in shards of about 20 KB."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama32")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(folder, max_shard_size="20KB")
    assert len(list(folder.glob("model-*.safetensors"))) > 3
    return folder


def _in_memory(cls: Any, folder: Path, fmt: torch.dtype | Scaled, **options: Any) -> nn.Module:
    """The reference: the library's own load of ``folder``, offloaded from memory in ``fmt``."""
    plain = cls.from_pretrained(folder).eval()
    for p in plain.parameters():
        p.data = p.data.clone()  # memory of its own, not the file's map
    torchsurgery.offload(plain, storage_dtype=fmt, dtype=torch.float32, **options)
    return plain


@pytest.mark.parametrize("host_budget", [0, 40_000, 1 << 30], ids=["disk", "host-and-disk", "host"])
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_llama_streamed_in_a_storage_dtype_equals_the_in_memory_offload(
    llama_folder: Path, fmt: torch.dtype | Scaled, host_budget: int
) -> None:
    cls = transformers.LlamaForCausalLM
    expected = _in_memory(cls, llama_folder, fmt)
    model = torchsurgery.from_pretrained(cls, llama_folder, storage_dtype=fmt, dtype=torch.float32, host_budget=host_budget)
    handle = _handle(model)
    plan = {p.name: p for p in handle.plan.params}
    assert plan["model.layers.0.mlp.down_proj.weight"].storage_dtype == _narrow_dtype(fmt)
    assert plan["model.layers.0.input_layernorm.weight"].storage_dtype == torch.float32  # a norm keeps its own
    disk_file, _ = _bytes(handle, model, "disk")
    host_file, host_stored = _bytes(handle, model, "host")
    # where the budget ends inside a group the host keeps its first bytes (never of one converted as read)
    split_file, split_stored = _bytes(handle, model, "split")
    split = [g for g in handle.plan.groups if g.tier == "split"]
    assert split_file == split_stored and len(split) <= 1
    kept_part = sum(g.host_bytes for g in split)
    disk_file += split_file - kept_part
    host_file, host_stored = host_file + kept_part, host_stored + kept_part
    reads = []
    with torch.no_grad():
        for tokens in (TOKENS, TOKENS, TOKENS[:, :1]):  # the host tier filled by the first, kept after
            assert torch.equal(model(tokens).logits, expected(tokens).logits)
            stats = handle.stats()
            reads.append(stats.storage_bytes_read)
    assert reads == [disk_file + host_file, disk_file, disk_file]  # from the file: its own bytes
    assert stats.peak_host_bytes == host_stored <= host_budget  # the host keeps the converted bytes
    if host_budget == 40_000:
        assert host_file > host_budget  # more weights than the file's bytes would let it keep
    assert all(p.is_meta for p in model.parameters())  # never materialised
    assert torchsurgery.restore(model) is model  # the skeleton comes back, as without storage_dtype
    assert torchsurgery.surgery_log(model) == [] and all(p.is_meta for p in model.parameters())


def test_a_bf16_checkpoint_kept_in_bfloat16_converts_nothing(tmp_path: Path) -> None:
    torch.manual_seed(1)
    cls = transformers.LlamaForCausalLM
    cls(transformers.LlamaConfig(**LLAMA)).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="20KB")
    expected = _in_memory(cls, tmp_path, torch.bfloat16)
    model = torchsurgery.from_pretrained(cls, tmp_path, storage_dtype=torch.bfloat16, dtype=torch.float32, host_budget=1 << 30)
    handle = _handle(model)
    assert {p.storage_dtype for p in handle.plan.params} == {torch.bfloat16}
    assert all(packed.conversion is None for packed in handle._streaming.packed.values())  # read as stored
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(TOKENS).logits, expected(TOKENS).logits)
    torchsurgery.restore(model)


class Net(nn.Module):
    """A norm, blocks of two linear layers and a convolution (a weight of three dimensions)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, w), nn.GELU(), nn.Linear(w, 16)) for w in (8, 24, 16, 32))
        self.conv = nn.Conv1d(3, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        for block in self.blocks:
            x = x + block(x)
        return self.conv(x.unsqueeze(0)).squeeze(0)


def _saved_net(tmp_path: Path) -> tuple[Net, Path]:
    torch.manual_seed(2)
    reference = Net().eval()
    path = tmp_path / "net.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, path)
    return reference, path


@pytest.mark.parametrize(
    "fmt", [torch.float8_e5m2, Scaled(torch.float8_e4m3fn, per="tensor"), Scaled(torch.int8)],
    ids=["e5m2", "scaled-per-tensor", "scaled-int8"],
)
def test_a_skeleton_streamed_in_a_storage_dtype_on_each_device(device: torch.device, tmp_path: Path, fmt: Any) -> None:
    reference, path = _saved_net(tmp_path)
    options: dict[str, Any] = {"storage_dtype": fmt, "dtype": torch.float32}
    if device.type != "cpu":  # a budget that streams the groups through the device's ring
        with pytest.raises(torchsurgery.BudgetError) as refused:
            torchsurgery.plan_offload(reference, device, budget=1, **options)
        options["budget"] = refused.value.needed
    expected_model = copy.deepcopy(reference)
    torchsurgery.offload(expected_model, device, **options)
    with torchsurgery.skeleton():
        model = Net().eval()
    handle = torchsurgery.offload(model, device, storage=path, host_budget=1_500, groups="leaves", **options)
    assert {g.tier for g in handle.plan.groups} >= {"host", "disk"}
    with torch.no_grad():
        expected = expected_model(X.to(device))
        for _ in range(2):
            assert torch.equal(model(X.to(device)), expected)
    # a split group (the budget ends inside it; never one converted as read): its first bytes kept
    kept_part = sum(g.host_bytes for g in handle.plan.groups if g.tier == "split")
    split_file = _bytes(handle, model, "split", streamed=True)[0]
    assert handle.stats().storage_bytes_read == _bytes(handle, model, "disk", streamed=True)[0] + split_file - kept_part
    assert handle.stats().peak_host_bytes == _bytes(handle, model, "host")[1] + kept_part
    handle.remove()
    assert all(p.is_meta for p in model.parameters())


def test_a_model_with_values_gives_back_the_file_s_values_and_rounds_its_resident_ones(tmp_path: Path) -> None:
    reference, path = _saved_net(tmp_path)
    model, expected_model = copy.deepcopy(reference), copy.deepcopy(reference)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    budget = 3_000  # the first groups resident (converted as they are installed), the others streamed
    torchsurgery.offload(expected_model, storage_dtype=torch.bfloat16, dtype=torch.float32, budget=budget, groups="leaves")
    handle = torchsurgery.offload(model, storage=path, storage_dtype=torch.bfloat16, dtype=torch.float32, budget=budget,
                                  groups="leaves", host_budget=0)
    resident = {p.name for p in handle.plan.params if p.residency is torchsurgery.Residency.RESIDENT}
    assert resident and {p.name for p in handle.plan.params if p.residency is torchsurgery.Residency.FILE}
    with torch.no_grad():
        assert torch.equal(model(X), expected_model(X))
    handle.remove()
    for name, p in model.named_parameters():
        assert type(p) is nn.Parameter and p.dtype == torch.float32
        # read back from the file: the model's own values; resident ones were converted in memory: rounded
        kept = before[name].to(torch.bfloat16).float() if name in resident and "norm" not in name else before[name]
        assert torch.equal(p.detach(), kept), name


def test_bad_storage_formats_are_refused_as_without_a_checkpoint(llama_folder: Path, tmp_path: Path) -> None:
    cls = transformers.LlamaForCausalLM
    for bad in (torch.int8, "bf16"):
        with pytest.raises(TypeError, match="storage_dtype must be a dtype weights can be stored in"):
            torchsurgery.from_pretrained(cls, llama_folder, storage_dtype=bad)
    reference, path = _saved_net(tmp_path)
    model = copy.deepcopy(reference)
    with pytest.raises(ValueError, match="master_dtype does not apply with storage=.*inference only"):
        torchsurgery.offload(model, storage=path, storage_dtype=torch.bfloat16, master_dtype=torch.float32)
    with pytest.raises(TypeError, match="storage_dtype must be a dtype"):
        torchsurgery.offload(model, storage=path, storage_dtype=torch.int8)
    assert torchsurgery.surgery_log(model) == []
    assert all(type(p) is nn.Parameter and torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True))


def test_the_host_tier_counts_the_scales_it_keeps(tmp_path: Path) -> None:
    _, path = _saved_net(tmp_path)
    with torchsurgery.skeleton():
        model = Net().eval()
    options: dict[str, Any] = {"storage_dtype": Scaled(torch.int8), "dtype": torch.float32, "groups": "leaves"}
    planned = torchsurgery.plan_offload(model, storage=path, **options)
    values = [sum(p.lookup(model).numel() * p.storage_dtype.itemsize for p in g.params) for g in planned.groups]
    # the values of the first three groups without their scales: with them, the third no longer fits
    handle = torchsurgery.offload(model, storage=path, host_budget=sum(values[:3]), **options)
    with torch.no_grad():
        for _ in range(2):
            model(X)
    disk_file, _ = _bytes(handle, model, "disk")
    _, host_stored = _bytes(handle, model, "host")
    assert handle.stats().storage_bytes_read == disk_file  # every group the plan put in the host tier is kept
    assert handle.stats().peak_host_bytes == host_stored < sum(values[:3])
    handle.remove()


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable peak (VmHWM)")
def test_peak_memory_converting_as_it_reads_stays_as_streaming_the_file_s_dtype(tmp_path: Path) -> None:
    """Converted as read, a checkpoint raises the peak resident size by no more than streaming it in
    the file's dtype does: two groups as the file stores them, the host budget and 96 MiB."""
    total = _save_big_llama(tmp_path, 6)  # 83 MB of fp32 weights
    host_budget = 14 << 20  # two layers kept in bf16 (one in fp32)
    measure = _MEASURE.replace("host_budget=int(sys.argv[2]))",
                               "host_budget=int(sys.argv[2]), storage_dtype=torch.bfloat16, dtype=torch.float32)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", measure, str(tmp_path), str(host_budget)], capture_output=True, text=True,
                         env=env, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["reset"] < 16 << 20, "writing 5 to /proc/self/clear_refs did not reset the peak"
    assert found["meta"] and found["read"] * 2 >= total  # every weight streamed, in bf16
    assert found["growth"] <= 2 * (2 * found["group"]) + host_budget + (96 << 20), found  # a group: its bf16 bytes


def test_a_file_cut_short_while_converted_as_read_is_named_and_the_model_stays_removable(tmp_path: Path) -> None:
    reference, path = _saved_net(tmp_path)
    with torchsurgery.skeleton():
        model = Net().eval()
    handle = torchsurgery.offload(model, storage=path, storage_dtype=Scaled(torch.float8_e4m3fn), dtype=torch.float32,
                                  groups="leaves", host_budget=0)
    with torch.no_grad():
        model(X)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        with pytest.raises(torchsurgery.CheckpointError, match="net.safetensors"):
            model(X)
    assert handle.active
    torchsurgery.restore(model)
    assert torchsurgery.surgery_log(model) == [] and all(p.is_meta for p in model.parameters())
