"""The wrapper's undo-log entry: restore, torchsurgery.restore and garbage collection
leave the model as it was."""

from __future__ import annotations

import gc

import pytest
import torch
from _flex_models import IDS, pristine, tiny_gpt2

import torchsurgery
from torchsurgery import FlexModel, HookFunction


def test_restore_leaves_the_model_pristine_even_with_groups_disabled() -> None:
    model = tiny_gpt2()
    before = pristine(model)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    flex.create_hook_group("mlps", "mlp")
    flex.register_full_backward_hook(HookFunction("transformer.h.0"))
    flex.register_hook(HookFunction("transformer.wte.weight"))
    flex(IDS, groups="mlps", complement=True)  # the anchor failed to restore here
    assert torchsurgery.surgery_log(model)[0].kind == "flex"
    assert flex.restore() is model
    assert pristine(model) == before
    assert torchsurgery.surgery_log(model) == []
    with pytest.raises(RuntimeError, match="restored"):
        flex(IDS)


def test_torchsurgery_restore_and_garbage_collection_remove_the_wrapper() -> None:
    model = tiny_gpt2()
    before = pristine(model)
    flex = FlexModel(model, {})
    flex.register_forward_hook(HookFunction("transformer.h.*.mlp"))
    torchsurgery.restore(model)
    assert pristine(model) == before
    flex2 = FlexModel(model, {})
    flex2.register_forward_hook(HookFunction("transformer.h.*"))
    del flex2
    gc.collect()
    assert pristine(model) == before
