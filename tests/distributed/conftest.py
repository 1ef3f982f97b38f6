"""A one-rank gloo process group in this process, for tests that need one but no peers."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank() -> Iterator[None]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
