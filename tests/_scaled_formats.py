"""The scaled storage formats the tests run each check with (fp8 per channel and per tensor, e5m2, int8)."""

from __future__ import annotations

import torch

from torchsurgery.compact import Scaled

FORMATS = [
    Scaled(torch.float8_e4m3fn, per="channel"),
    Scaled(torch.float8_e4m3fn, per="tensor"),
    Scaled(torch.float8_e5m2, per="channel"),
    Scaled(torch.int8, per="channel"),
]
IDS = [f"{str(f.dtype).removeprefix('torch.')}-{f.per}" for f in FORMATS]
