"""Hook groups: created by substring, glob or HookFunctions, chosen per forward."""

from __future__ import annotations

import pytest
import torch
from _flex_models import IDS, tiny_gpt2

from torchsurgery import FlexModel


def test_groups_create_update_remove_and_choose_hooks_per_forward() -> None:
    model = tiny_gpt2(layers=3)
    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out)
    mlps = flex.create_hook_group("mlps", "mlp")  # by substring, as flex_model (whose version matched nothing)
    assert [h.module_name for h in mlps] == [n for n, _ in model.named_modules() if "mlp" in n]
    assert len(mlps) == 15
    attn = flex.create_hook_group("attn", "transformer.h.*.attn")  # and by glob
    assert [h.module_name for h in attn] == [f"transformer.h.{i}.attn" for i in range(3)]
    assert flex.get_hook_function_groups(attn[0]) == {"all", "attn"}
    flex.update_hook_groups(attn[:1], "first")
    flex.update_hook_groups("h.1.attn", "first")
    assert {h.module_name for h in flex.get_group_hook_functions("first")} == {
        "transformer.h.0.attn", "transformer.h.1.attn"
    }

    flex(IDS, groups="attn")
    assert sorted(out) == [f"transformer.h.{i}.attn" for i in range(3)]
    out.clear()
    flex(IDS, groups="attn", complement=True)
    assert set(out) == {h.module_name for h in mlps}
    out.clear()
    flex(IDS, groups=["first"])
    assert sorted(out) == ["transformer.h.0.attn", "transformer.h.1.attn"]
    out.clear()

    flex.remove_hook_groups(attn[0], "first")  # re-enabling later works (the anchor raised TypeError)
    flex(IDS, groups="first")
    assert sorted(out) == ["transformer.h.1.attn"]
    out.clear()
    flex(IDS)  # "all" again
    assert len(out) == len(mlps) + len(attn)
    with pytest.raises(ValueError, match="'all'"):
        flex.remove_hook_groups(attn, "all")
    with pytest.raises(ValueError, match="unknown hook group"):
        flex(IDS, groups="nope")
    with pytest.raises(ValueError, match="matches no submodule"):
        flex.create_hook_group("x", "does_not_exist")
    flex.restore()
