"""Never refuse what the host can run: a model streamed from its checkpoint needs host memory for
the read buffers of the groups it reads on every forward, and without a ``host_budget`` of the
user's, groups whose buffers the host cannot hold fall back to finer ones, down to single
modules one at a time, with one warning naming the choice; only a single weight too large for
what is available is refused. A ``host_budget`` given is the user's: the groups are kept as
chosen, refused only where their buffers alone exceed the memory available.

The memory available is set (``host_tier.available_memory``); each run is checked against the
plain model, bit for bit (the test device computes with the CPU's kernels).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tardy
import torchsurgery
from torchsurgery.offloading import file_reader, host_tier
from torchsurgery.offloading.file_reader import read_buffers
from torchsurgery.offloading.host_fit import host_need

X = torch.randn(2, 32, 16, generator=torch.Generator().manual_seed(1))


def _model() -> nn.Sequential:
    """Eight blocks of two convolutions (a group each, as "blocks" finds them)."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Conv1d(32, 32, 3, padding=1), nn.Conv1d(32, 32, 3, padding=1)) for _ in range(8)])


def _saved(tmp_path: Path) -> tuple[nn.Sequential, Path, torch.Tensor]:
    """The model, its checkpoint and its plain output."""
    from safetensors.torch import save_file

    model = _model()
    path = tmp_path / "model.safetensors"
    save_file(model.state_dict(), path)
    with torch.no_grad():
        return model, path, model(X)


def _need(model: nn.Module, path: Path, groups: str, prefetch: int, device: Any = "cpu", **options: Any) -> int:
    """Host bytes ``model`` streamed from ``path`` to ``device`` in ``groups`` at ``prefetch`` needs besides its host tier."""
    plan = torchsurgery.plan_offload(model, device, storage=path, groups=groups, prefetch=prefetch, host_budget=0, **options)
    return host_need(plan.groups, plan.prefetch, plan.offload_device)


def _available(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    monkeypatch.setattr(host_tier, "available_memory", lambda: nbytes)


def _device_options(device: torch.device, model: nn.Module) -> dict[str, Any]:
    """``offload`` arguments under which every block streams on ``device`` (a budget of the user's there)."""
    if device.type == "cpu":
        return {}
    with pytest.raises(torchsurgery.BudgetError) as refused:
        torchsurgery.plan_offload(model, device, budget=1)
    return {"budget": refused.value.needed}


@pytest.fixture(params=["cpu", "tardy"])
def device(request: pytest.FixtureRequest) -> torch.device:
    if request.param == "cpu":
        return torch.device("cpu")
    accelerator = request.getfixturevalue("accelerator")
    if accelerator.type != tardy.NAME:
        pytest.skip("runs on the tardy test device only")
    return accelerator


def test_without_a_host_budget_blocks_whose_buffers_the_host_cannot_hold_stream_as_single_modules(
    device: torch.device, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, path, expected = _saved(tmp_path)
    options = _device_options(device, model)
    blocks, modules = _need(model, path, "blocks", 1, device, **options), _need(model, path, "leaves", 1, device, **options)
    one = _need(model, path, "leaves", 0, device, **options)
    assert one < modules < blocks
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = [id(p) for p in model.parameters()]
    for available, choice in (
        (host_tier.MARGIN + (modules + blocks) // 2, "single modules (groups='leaves') instead"),
        (host_tier.MARGIN + (one + modules) // 2, "single modules one at a time (groups='leaves', prefetch=0) instead"),
        (one, "single modules one at a time (groups='leaves', prefetch=0) instead, in part of that margin"),
    ):
        _available(monkeypatch, available)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            handle = torchsurgery.offload(model, device, storage=path, **options)
        messages = [str(w.message) for w in said]
        assert len(messages) == 1 and messages[0].startswith("torchsurgery.offload: its groups need "), messages
        assert "of host memory to stream from the checkpoint at prefetch=1" in messages[0]
        assert messages[0].split(" (nothing finer")[0].endswith(choice)
        assert [g.name for g in handle.plan.groups] == [f"{b}.{c}" for b in range(8) for c in range(2)]
        with torch.no_grad():
            got = [model(X.to(device)).cpu() for _ in range(2)]  # the second reads the disk tier again
        assert all(torch.equal(g, expected) for g in got)
        handle.remove()
        assert torchsurgery.surgery_log(model) == [] and [id(p) for p in model.parameters()] == ids
        assert all(torch.equal(p, state[n]) for n, p in model.named_parameters())


def test_without_a_host_budget_a_single_weight_the_host_cannot_hold_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, path, _ = _saved(tmp_path)
    one = _need(model, path, "leaves", 0)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    _available(monkeypatch, one - 1)
    with pytest.raises(RuntimeError) as refused:
        torchsurgery.offload(model, storage=path)
    message = str(refused.value)
    assert message.startswith("torchsurgery.offload: the host has too little memory to stream this checkpoint")
    assert f"largest single weight '0.0.weight' ({32 * 32 * 3 * 4} bytes) needs {one} bytes" in message
    assert f"more than the {one - 1} bytes available now; free host memory" in message
    assert torchsurgery.surgery_log(model) == []
    assert all(not p.is_meta and torch.equal(p, state[n]) for n, p in model.named_parameters())


def test_without_a_host_budget_a_model_the_host_can_keep_whole_keeps_its_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kept whole, no group is read on any forward after the first: no read buffer is needed, though
    those of its blocks would not fit."""
    model, path, expected = _saved(tmp_path)
    whole = sum(t.nbytes for t in model.state_dict().values())
    assert whole < _need(model, path, "blocks", 1)
    _available(monkeypatch, host_tier.MARGIN + whole)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle = torchsurgery.offload(model, storage=path)
    assert [(g.name, g.tier) for g in handle.plan.groups] == [(str(b), "host") for b in range(8)]
    with torch.no_grad():
        assert all(torch.equal(model(X), expected) for _ in range(2))
    assert handle.stats().storage_bytes_read == 0
    handle.remove()


def test_an_explicit_host_budget_keeps_the_chosen_groups_and_refuses_only_buffers_beyond_what_is_available(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, path, expected = _saved(tmp_path)
    blocks, one = _need(model, path, "blocks", 1), _need(model, path, "leaves", 0)
    _available(monkeypatch, host_tier.MARGIN + blocks - 1)  # within the margin: the user's choice, no fallback
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle = torchsurgery.offload(model, storage=path, host_budget=0)
    assert [g.name for g in handle.plan.groups] == [str(b) for b in range(8)]
    with torch.no_grad():
        assert torch.equal(model(X), expected)
    handle.remove()
    _available(monkeypatch, blocks - 1)  # the buffers alone exceed what is available
    with pytest.raises(ValueError) as refused:
        torchsurgery.offload(model, storage=path, host_budget=0)
    message = str(refused.value)
    assert "of host memory to stream from the checkpoint at prefetch=1 (2 read buffers for its largest group '0')" in message
    assert "stream finer groups (single modules one at a time (groups='leaves', prefetch=0): " in message
    assert torchsurgery.surgery_log(model) == [] and not any(p.is_meta for p in model.parameters())
    assert one < blocks


def test_a_pool_without_a_host_budget_reports_the_finer_groups_through_on_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, path, expected = _saved(tmp_path)
    modules = _need(model, path, "leaves", 1)
    # the buffers of single modules fit, those of blocks do not, nor can the host keep every block streamed
    _available(monkeypatch, host_tier.MARGIN + modules + 4096)
    heard: list[tuple[nn.Module, str]] = []
    with pytest.raises(torchsurgery.BudgetError) as least:  # a budget the blocks stream in (the pool's own is unlimited)
        torchsurgery.plan_offload(model, budget=1)
    budget = least.value.needed
    pool = torchsurgery.DevicePool("cpu", budget=budget, on_fallback=lambda m, s: heard.append((m, s)))
    pool.add(model, name="convs", storage=path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle = pool.load(model)
    assert len(heard) == 1 and heard[0][0] is model
    assert heard[0][1].startswith("its groups need ") and heard[0][1].endswith("streaming single modules (groups='leaves') instead")
    assert handle is not None and len(handle.plan.groups) == 16
    with torch.no_grad():
        assert torch.equal(model(X), expected)
    pool.close()
    given = torchsurgery.DevicePool("cpu", budget=budget, host_budget=0, on_fallback=lambda m, s: heard.append((m, s)))
    given.add(model, name="convs", storage=path)
    handle = given.load(model)
    assert handle is not None and len(handle.plan.groups) == 8 and len(heard) == 1  # the user's host budget: as chosen
    with torch.no_grad():
        assert torch.equal(model(X), expected)
    given.close()
    assert torchsurgery.surgery_log(model) == []


@pytest.mark.parametrize("storage_dtype", [None, torch.float8_e4m3fn], ids=["file-dtype", "converted-as-read"])
def test_the_reader_makes_no_more_than_the_host_need_counts(
    device: torch.device, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, storage_dtype: torch.dtype | None
) -> None:
    """The read buffers and direct reads' buffers a forward makes, as :func:`host_need` counts them
    (a group converted as it is read lands in its read buffer as the file stores it)."""
    model, path, expected = _saved(tmp_path)
    made: list[int] = []
    aligned = file_reader._aligned

    def recorded(nbytes: int, allocate: Any) -> torch.Tensor:
        made.append(nbytes)
        return aligned(nbytes, allocate)

    monkeypatch.setattr(file_reader, "_aligned", recorded)
    options = {"storage_dtype": storage_dtype, "dtype": torch.float32}
    options.update(_device_options(device, model) if device.type != "cpu" else {})
    handle = torchsurgery.offload(model, device, storage=path, groups="leaves", host_budget=0, **options)
    with torch.no_grad():
        outs = [model(X.to(device)).cpu() for _ in range(2)]
    if storage_dtype is None:  # (in fp8: the in-memory offload's values, tests/offloading/test_streamed_storage_dtype.py)
        assert all(torch.equal(out, expected) for out in outs)
    need = host_need(handle.plan.groups, handle.plan.prefetch, handle.plan.offload_device)
    handle.remove()
    reads = [n for n in made if n != file_reader._BOUNCE]
    largest = max(reads)
    assert len(reads) == read_buffers(1, device.type == "cpu") and len(made) - len(reads) <= file_reader._THREADS
    # what a direct read fills of its thread's buffer: a piece (here a whole module) and its alignment
    assert sum(n + 4096 for n in reads) + (len(made) - len(reads)) * (largest + 3 * 4096) <= need


def test_from_pretrained_without_a_host_budget_streams_single_modules_where_the_host_cannot_hold_its_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sharded bf16 Llama folder of twelve layers (more bytes than its layers' buffers): the
    library's own loading of the same folder gives the same logits, bit for bit."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=12,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="200KB")
    with torchsurgery.skeleton():
        skeleton = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    blocks, modules = _need(skeleton, tmp_path, "blocks", 1), _need(skeleton, tmp_path, "leaves", 1)
    assert modules < blocks < sum(p.nbytes for p in skeleton.parameters())
    expected = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    for p in expected.parameters():  # memory of its own, not the file's map (as the offload's buffers are)
        p.data = p.data.clone()
    _available(monkeypatch, host_tier.MARGIN + (modules + blocks) // 2)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model = torchsurgery.from_pretrained(transformers.LlamaForCausalLM, tmp_path)
    messages = [str(w.message) for w in said if "torchsurgery" in str(w.message)]
    assert len(messages) == 1 and messages[0].endswith("streaming single modules (groups='leaves') instead"), messages
    tokens = torch.tensor([[1, 5, 9, 33, 2, 63, 17]])
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, expected(tokens).logits)
    torchsurgery.restore(model)
