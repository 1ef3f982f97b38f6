"""Capture and edit a tensor-parallel (and data-parallel) Llama by module name.

On a machine with GPUs:   torchrun --nproc-per-node 4 examples/distributed_llama.py
(NCCL; 2 GPUs give tensor parallel 2, 4 give a 2 x 2 data x tensor parallel mesh).
Run plainly (python examples/distributed_llama.py) it starts 2 CPU processes on gloo.

The model is parallelised with PyTorch's own DTensor plans; FlexModel needs no shape
hints: it reads the sharding from the plan and hands every editing function the full
activation. Captures land on every rank (as in flex_model; captures_on="first_rank" keeps
them to rank 0), the data-parallel batches concatenated.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from torchsurgery import FlexModel, HookFunction

PLAN = {
    "model.layers.*.self_attn.q_proj": ColwiseParallel(),
    "model.layers.*.self_attn.k_proj": ColwiseParallel(),
    "model.layers.*.self_attn.v_proj": ColwiseParallel(),
    "model.layers.*.self_attn.o_proj": RowwiseParallel(),
    "model.layers.*.mlp.gate_proj": ColwiseParallel(),
    "model.layers.*.mlp.up_proj": ColwiseParallel(),
    "model.layers.*.mlp.down_proj": RowwiseParallel(),
}


def main() -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = "cuda" if cuda else "cpu"
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = 2 if world % 4 == 0 else 1
    mesh = init_device_mesh(device, (dp, world // dp), mesh_dim_names=("dp", "tp"))

    torch.manual_seed(0)  # the same weights on every rank
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4,
    )
    model = transformers.LlamaForCausalLM(config).to(device).eval()
    parallelize_module(model, mesh["tp"], PLAN)

    out: dict[str, list[torch.Tensor]] = {}
    flex = FlexModel(model, out, device_mesh=mesh)
    flex.register_forward_hook(HookFunction("model.layers.*.mlp.up_proj"))  # sharded: gathered

    def silence_layer_2(module: nn.Module, x: torch.Tensor, ctx: object, modules: object) -> torch.Tensor:
        return torch.zeros_like(x)  # sees the whole attention output, on every rank

    flex.register_forward_hook(HookFunction("model.layers.2.self_attn.o_proj", editing_function=silence_layer_2))

    input_ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(mesh.get_local_rank("dp")))
    with torch.no_grad():
        logits = flex(input_ids.to(device)).logits
    q_weight = flex.get_module_parameter("model.layers.0.self_attn.q_proj.weight")  # unsharded, on CPU
    if rank == 0:
        print(f"{world} ranks: data parallel {flex.dp_size} x tensor parallel {flex.tp_size} ({dist.get_backend()})")
        print(f"logits on this rank: {tuple(logits.shape)}; full q_proj weight: {tuple(q_weight.shape)}")
        for name, values in out.items():
            print(f"  {name}: {tuple(values[0].shape)}")  # batch = every replica's rows, features unsharded
    flex.restore()


def _spawned(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        main()
        dist.barrier()  # no rank closes its connections while a peer's last receive is still in flight
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        main()
        dist.barrier()
        dist.destroy_process_group()
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free_port = s.getsockname()[1]
        mp.spawn(_spawned, args=(2, free_port), nprocs=2)
