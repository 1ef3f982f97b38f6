"""Checkpoint files that change, fail or lie while a model streams from them.

A model streams from a folder of shards, one block per shard. A shard is truncated,
written to in place, deleted or replaced between forwards or in the middle of one, or its
reads fail with an I/O error. Each time the forward raises an error naming the file, and
``remove()`` still works: a skeleton goes back to ``meta``; a model that had values of its
own gets exactly those back (from the original the open file keeps, where the file was
deleted or replaced), or, where the file no longer holds them, is refused changing nothing
until the file is put back. The reference is the plain model.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file
from torch import nn

import torchsurgery
from torchsurgery import CheckpointError, _checkpoint, offload

WIDTH = 320  # four blocks of 410 KB: enough bytes read for the read rate to be judged


def _blocks() -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)]).eval()


def _save(model: nn.Module, folder: Path) -> Path:
    """``model`` as one shard per block and an index; the files dated long ago (any write changes their time)."""
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i in range(4):
        name = f"model-{i}.safetensors"
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k.startswith(f"{i}.")}
        save_file(state, folder / name)
        os.utime(folder / name, ns=(10**18, 10**18))
        weight_map.update(dict.fromkeys(state, name))
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _rewrite(path: Path) -> None:
    with open(path, "r+b") as f:  # the same size, other values (the last bytes: a weight's)
        f.seek(-64, os.SEEK_END)
        f.write(bytes(64))


def _replace(path: Path) -> None:
    copy = path.with_suffix(".new")
    shutil.copy(path, copy)
    os.replace(copy, path)  # as tools save: a new file renamed over the old one


CHANGES: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncate": (_truncate, "its size went from"),
    "rewrite": (_rewrite, "written to in place"),
    "delete": (os.remove, "it was deleted"),
    "replace": (_replace, "another file was put in its place"),
}


@pytest.fixture
def reference() -> nn.Sequential:
    return _blocks()


def _offloaded(reference: nn.Module, folder: Path, own_values: bool) -> tuple[nn.Module, torchsurgery.OffloadHandle]:
    index = _save(reference, folder)
    if own_values:
        model = _blocks()
        model.load_state_dict(reference.state_dict())
    else:
        with torchsurgery.skeleton():
            model = _blocks()
    # no host tier: every forward reads the files (a group kept in memory is not read again)
    return model, offload(model, storage=index, host_budget=0)


def _check_removed(model: nn.Module, reference: nn.Module, own_values: bool) -> None:
    assert torchsurgery.surgery_log(model) == []
    if own_values:  # exactly the values it had
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    else:
        assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("own_values", [False, True], ids=["skeleton", "own-values"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_shard_changed_between_forwards(reference: nn.Module, tmp_path: Path, change: str, own_values: bool) -> None:
    model, handle = _offloaded(reference, tmp_path / "ckpt", own_values)
    x = torch.randn(2, WIDTH)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    shard = tmp_path / "ckpt" / "model-2.safetensors"
    saved = tmp_path / "saved.safetensors"
    shutil.copy(shard, saved)
    do, what = CHANGES[change]
    do(shard)
    with pytest.raises(CheckpointError, match=rf"model-2.safetensors: .*changed since it was opened.*{what}.*offload again"):
        with torch.no_grad():
            model(x)
    assert handle.active
    if own_values and change in ("truncate", "rewrite"):  # the values are no longer in the file: refused, nothing changed
        with pytest.raises(RuntimeError, match="could not undo offload"):
            torchsurgery.restore(model)
        assert handle.active and all(p.is_meta for p in model[2].parameters())
        shutil.copy(saved, shard)  # the file put back as it was: the same removal goes through
    handle.remove()
    _check_removed(model, reference, own_values)


@pytest.mark.parametrize("own_values", [False, True], ids=["skeleton", "own-values"])
def test_a_shard_truncated_in_the_middle_of_a_forward(reference: nn.Module, tmp_path: Path, own_values: bool) -> None:
    model, handle = _offloaded(reference, tmp_path / "ckpt", own_values)
    x = torch.randn(2, WIDTH)
    with torch.no_grad():
        model(x)  # the order is recorded: the next forward reads ahead
    shard = tmp_path / "ckpt" / "model-3.safetensors"
    shutil.copy(shard, tmp_path / "saved.safetensors")
    hook = model[1].register_forward_pre_hook(lambda *_: _truncate(shard))
    with pytest.raises(CheckpointError, match=r"model-3.safetensors: ('3\.0\.(weight|bias)' ends early|changed since it was opened).*its size went from"):
        with torch.no_grad():
            model(x)
    hook.remove()
    if own_values:
        shutil.copy(tmp_path / "saved.safetensors", shard)
    handle.remove()
    _check_removed(model, reference, own_values)


@pytest.mark.parametrize("own_values", [False, True], ids=["skeleton", "own-values"])
def test_an_io_error_names_the_file_and_key(
    reference: nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own_values: bool
) -> None:
    model, handle = _offloaded(reference, tmp_path / "ckpt", own_values)

    def failing(fd: int, views: list[memoryview], offset: int) -> int:
        raise OSError(5, "Input/output error")

    x = torch.randn(2, WIDTH)
    with monkeypatch.context() as patched:
        patched.setattr(_checkpoint.os, "preadv", failing)
        with pytest.raises(OSError, match=r"reading group '0' from .*model-0.safetensors failed \(Input/output error\); check the file and its disk"):
            with torch.no_grad():
                model(x)
        if own_values:  # its values cannot be read back: refused, nothing changed
            with pytest.raises(OSError, match=r"model-\d.safetensors.*\(Input/output error\)"):
                handle.remove()
            assert handle.active
    with torch.no_grad():  # the disk is back: the model runs again
        assert torch.equal(model(x), reference(x))
    handle.remove()
    _check_removed(model, reference, own_values)


def _link_out(folder: Path, outside: Path) -> str:
    os.symlink(outside, folder / "linked.safetensors")
    return "linked.safetensors"


ESCAPES: dict[str, Callable[[Path, Path], str]] = {
    "absolute": lambda folder, outside: str(outside),
    "dotdot": lambda folder, outside: f"../{outside.name}",
    "subfolder": lambda folder, outside: "sub/model-0.safetensors",
    "symlink-out": _link_out,
}


@pytest.mark.parametrize("escape", list(ESCAPES))
def test_index_entries_leading_out_of_the_folder_are_refused(reference: nn.Module, tmp_path: Path, escape: str) -> None:
    folder = tmp_path / "ckpt"
    index = _save(reference, folder)
    outside = tmp_path / "outside.safetensors"
    shutil.copy(folder / "model-0.safetensors", outside)
    (folder / "sub").mkdir()
    shutil.copy(folder / "model-0.safetensors", folder / "sub" / "model-0.safetensors")
    name = ESCAPES[escape](folder, outside)
    weight_map = json.loads(index.read_text())["weight_map"]
    index.write_text(json.dumps({"weight_map": {k: name if v == "model-0.safetensors" else v for k, v in weight_map.items()}}))
    with torchsurgery.skeleton():
        model = _blocks()
    with pytest.raises(CheckpointError, match=rf"shard '{name}' is not a file next to the index"):
        offload(model, storage=folder)
    assert torchsurgery.surgery_log(model) == []
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                      num_attention_heads=2)
    config.save_pretrained(folder)
    with pytest.raises(CheckpointError, match="is not a file next to the index"):
        torchsurgery.from_pretrained(transformers.LlamaForCausalLM, folder)


def test_a_folder_s_checkpoint_linked_from_outside_is_refused(reference: nn.Module, tmp_path: Path) -> None:
    save_file(reference.state_dict(), tmp_path / "elsewhere.safetensors")
    (tmp_path / "ckpt").mkdir()
    os.symlink(tmp_path / "elsewhere.safetensors", tmp_path / "ckpt" / "model.safetensors")
    with torchsurgery.skeleton():
        model = _blocks()
    with pytest.raises(CheckpointError, match="model.safetensors is a symbolic link leading out of"):
        offload(model, storage=tmp_path / "ckpt")
    offload(model, storage=tmp_path / "elsewhere.safetensors").remove()  # a file named itself is read


def test_a_hugging_face_cache_snapshot_is_read(reference: nn.Module, tmp_path: Path) -> None:
    """The hub's cache keeps each file once in ``blobs`` and links to it from ``snapshots/<revision>``."""
    repo = tmp_path / "models--org--name"
    index = _save(reference, repo / "blobs")
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for path in (repo / "blobs").iterdir():
        blob = path.with_name(f"{hash(path.name) & 0xFFFFFF:06x}")
        path.rename(blob)
        os.symlink(Path("../../blobs") / blob.name, snapshot / path.name)
    assert not index.exists() and (snapshot / index.name).is_file()
    with torchsurgery.skeleton():
        model = _blocks()
    x = torch.randn(2, WIDTH)
    with offload(model, storage=snapshot), torch.no_grad():
        assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize(("seconds_per_read", "slow"), [(1.0, True), (0.0, False)], ids=["slow", "fast"])
def test_a_slow_filesystem_is_named_in_the_hint(
    reference: nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seconds_per_read: float, slow: bool
) -> None:
    """Reads timed by a clock that advances a second per read (1.6 MB in 8 s) or not at all."""
    ticks = iter(range(10**6))
    monkeypatch.setattr(_checkpoint, "_clock", lambda: next(ticks) * seconds_per_read / 2)
    with torchsurgery.skeleton():
        model = _blocks()
    handle = offload(model, storage=_save(reference, tmp_path / "ckpt"), groups="leaves")
    with torch.no_grad():
        model(torch.randn(2, WIDTH))
    assert ("MB/s, far below a local disk" in handle.stats().hint) is slow
    handle.remove()
