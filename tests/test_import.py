"""Importing torchsurgery pulls in no optional package and leaves CUDA alone."""

from __future__ import annotations

import subprocess
import sys

import torchsurgery


def _run(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()


def test_import_does_not_initialise_cuda() -> None:
    out = _run("import torch, torchsurgery; print(torch.cuda.is_initialized())")
    assert out == "False"


# What the command line and the examples need, never the library itself.
_OPTIONAL = ("transformers", "diffusers", "accelerate", "matplotlib", "typer", "click", "rich", "safetensors")


def test_import_pulls_in_no_optional_package() -> None:
    # What importing torchsurgery adds on top of an imported torch: no optional package and
    # not the command line. (How long the import takes is measured by benchmarks/import_time.py.)
    code = (
        "import sys, torch; before = set(sys.modules); import torchsurgery; "
        "print(' '.join(sorted(set(sys.modules) - before)))"
    )
    added = _run(code).split()
    tops = {name.split(".")[0] for name in added}
    assert "torchsurgery" in tops
    assert sorted(tops & set(_OPTIONAL)) == []
    assert [m for m in added if m.startswith("torchsurgery.cli")] == []


def test_import_leaves_the_compiler_unimported_until_a_weight_is_made() -> None:
    # torch._dynamo takes longer to import than torch itself: patching, flex, loading and the
    # command line never need it; the first weight of ours made brings it in, with the
    # compiler's rules for our frames, before anything can compile them
    code = (
        "import sys, torch\n"
        "import torchsurgery\n"
        "print('torch._dynamo' in sys.modules)\n"
        "torchsurgery.offload(torch.nn.Linear(4, 4), storage_dtype=torch.bfloat16, dtype=torch.float32)\n"
        "from torchsurgery.compact import tensor\n"
        "from torchsurgery.offloading.streams import GroupStreamer as G\n"
        "print('torch._dynamo' in sys.modules, tensor._skipped_by_the_compiler)\n"
        "print(getattr(G.bring_in, '_torchdynamo_disable', False), getattr(G.release, '_torchdynamo_disable', False))\n"
    )
    # and every streamer's transfers run outside compiled regions, as the decorator made them
    assert _run(code).split() == ["False", "True", "True", "True", "True"]


def test_public_names_are_exported() -> None:
    for name in torchsurgery.__all__:
        assert hasattr(torchsurgery, name), name
