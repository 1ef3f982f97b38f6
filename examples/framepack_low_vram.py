"""FramePack's low-VRAM memory pattern, switched to torchsurgery by one import line.

The video app runs a Hunyuan-video transformer, a Llama and a CLIP text encoder, a SigLIP
image encoder and a VAE on one small GPU: the encoders and the VAE are loaded whole one at a time, the
transformer is brought in as far as memory allows while a ``DynamicSwapInstaller``
serves the rest, and everything goes back between stages. Here the same stages run
with tiny random-weight models from ``diffusers`` and ``transformers``, once with plain
``.to()`` moves and once with ``torchsurgery.compat.framepack`` (the app's function names),
and the outputs are compared. Without a GPU everything runs on the CPU.

``build_models(app_dtypes=True)`` gives the models the app's dtypes: a bf16 transformer
whose ``high_quality_fp32_output_for_inference`` switch is on (its output projection is
converted to fp32 inside ``forward`` and computes in fp32), fp16 encoders and VAE.
The transformer is diffusers' FramePack class: the Hunyuan-video transformer's blocks with
the two layers FramePack adds to them (``clean_x_embedder`` for the clean and history
latents, ``image_projection`` for the SigLIP image embeddings).

``save_models(folder)`` writes them as the app's checkpoints are laid out (a folder per
hub repository, a subfolder per model, sharded safetensors), and ``load_models(folder)``
loads them back with the app's own ``from_pretrained`` lines. A script streams them from
their files instead, within a host-memory budget, by changing only those lines (see
``load_models``'s docs).

Run: .venv/bin/python examples/framepack_low_vram.py
"""

from __future__ import annotations

import copy
import functools
import os
import types
from dataclasses import dataclass
from typing import Any

import diffusers
import torch
import transformers
from torch import nn

import torchsurgery
import torchsurgery.compat.framepack as framepack

SIZES: dict[str, dict[str, int]] = {
    # hidden sizes, layer counts and the latent video's frames/height/width
    "tiny": {"text": 32, "text_layers": 3, "heads": 2, "head_dim": 12, "double": 2, "single": 3,
             "vae": 8, "frames": 3, "side": 8},
    # the tests' streamed jobs: one latent frame, a narrow VAE (fp16 3D convolutions are slow on a CPU)
    "micro": {"text": 32, "text_layers": 3, "heads": 2, "head_dim": 12, "double": 2, "single": 3,
              "vae": 4, "frames": 1, "side": 8},
    "bench": {"text": 256, "text_layers": 4, "heads": 4, "head_dim": 48, "double": 4, "single": 8,
              "vae": 16, "frames": 3, "side": 8},
}
LATENT = 4
IMAGE_EMBED = 16  # SigLIP's hidden size, which the transformer's image projection takes


class FramePackTransformer(diffusers.HunyuanVideoFramepackTransformer3DModel):
    """diffusers' FramePack transformer with the app's fp32 output switch.

    With ``high_quality_fp32_output_for_inference`` on, the app's transformer converts its
    output projection with ``self.proj_out.to(dtype=torch.float32)`` inside ``forward``
    (once: when it does not compute in fp32 yet) and feeds it fp32 hidden states. diffusers'
    class has no such switch: here it is done between the output norm and the projection,
    where the app does it (a forward hook of ``norm_out``).
    """

    high_quality_fp32_output_for_inference = False

    # with the parent's signature: from_pretrained reads the config's keys from it
    @functools.wraps(diffusers.HunyuanVideoFramepackTransformer3DModel.__init__)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.norm_out.register_forward_hook(self._fp32_output)

    def _fp32_output(self, norm_out: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        if not self.high_quality_fp32_output_for_inference:
            return None
        if self.proj_out.weight.dtype != torch.float32:
            self.proj_out.to(dtype=torch.float32)
        return output.to(dtype=torch.float32)


@dataclass
class Models:
    """The app's five models."""

    text_encoder: nn.Module  # Llama: the prompt's hidden states
    text_encoder_2: nn.Module  # CLIP text: the pooled prompt
    transformer: nn.Module  # the Hunyuan-video (FramePack) transformer
    vae: nn.Module  # the Hunyuan-video VAE
    image_encoder: nn.Module  # SigLIP vision: the start frame's embeddings, for the transformer's image projection


def build_models(size: str = "tiny", seed: int = 0, *, app_dtypes: bool = False) -> Models:
    """Random-weight models of the app's architectures, built from small configs.

    With ``app_dtypes``, in the app's dtypes: the transformer in bf16 with its fp32 output
    switch on, the encoders and the VAE in fp16.
    """
    s = SIZES[size]
    torch.manual_seed(seed)
    llama = transformers.LlamaModel(transformers.LlamaConfig(
        hidden_size=s["text"], intermediate_size=2 * s["text"], num_hidden_layers=s["text_layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["heads"], vocab_size=128, max_position_embeddings=64,
    ))
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        hidden_size=s["text"] // 2, intermediate_size=s["text"], num_hidden_layers=2, num_attention_heads=s["heads"],
        vocab_size=128, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
    ))
    third = s["head_dim"] // 3
    transformer = FramePackTransformer(
        in_channels=LATENT, out_channels=LATENT, num_attention_heads=s["heads"], attention_head_dim=s["head_dim"],
        num_layers=s["double"], num_single_layers=s["single"], num_refiner_layers=1, text_embed_dim=s["text"],
        pooled_projection_dim=s["text"] // 2, rope_axes_dim=(third, third, third), image_condition_type=None,
        has_image_proj=True, image_proj_dim=IMAGE_EMBED, has_clean_x_embedder=True,
    )
    siglip = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
        hidden_size=IMAGE_EMBED, intermediate_size=2 * IMAGE_EMBED, num_hidden_layers=2, num_attention_heads=2,
        image_size=8 * s["side"], patch_size=16,
    ))
    vae = diffusers.AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=LATENT, down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4, block_out_channels=(s["vae"],) * 4, layers_per_block=1,
        norm_num_groups=4, spatial_compression_ratio=8, temporal_compression_ratio=4,
    )
    models = Models(llama, clip, transformer, vae, siglip)
    for model in vars(models).values():
        model.eval().requires_grad_(False)
    if app_dtypes:
        transformer.high_quality_fp32_output_for_inference = True
        transformer.to(dtype=torch.bfloat16)
        for model in (llama, clip, vae, siglip):
            model.to(dtype=torch.float16)
    return models


# where each model lives, as in the app's hub repositories: (repository, subfolder)
CHECKPOINTS: dict[str, tuple[str, str | None]] = {
    "text_encoder": ("hunyuanvideo", "text_encoder"),
    "text_encoder_2": ("hunyuanvideo", "text_encoder_2"),
    "vae": ("hunyuanvideo", "vae"),
    "image_encoder": ("flux_redux", "image_encoder"),
    "transformer": ("framepack_i2v", None),
}


def save_models(folder: str | os.PathLike[str], size: str = "tiny", seed: int = 0, shards: int = 4) -> Models:
    """Save ``build_models(size, seed, app_dtypes=True)`` under ``folder`` as the app's checkpoints are laid out.

    Each model in about ``shards`` safetensors shards (``save_pretrained``'s ``max_shard_size``)
    with its index and config, in the folder :data:`CHECKPOINTS` names. Returns the models saved.
    """
    models = build_models(size, seed, app_dtypes=True)
    for name, model in vars(models).items():
        repo, subfolder = CHECKPOINTS[name]
        nbytes = sum(t.nbytes for t in model.state_dict().values())
        target = os.path.join(folder, repo, subfolder or "")
        model.save_pretrained(target, max_shard_size=max(1, nbytes // shards))  # type: ignore[operator]
    return models


def load_models(folder: str | os.PathLike[str]) -> Models:
    """The app's loading lines, on the checkpoints :func:`save_models` wrote: every model whole in host memory.

    To stream the weights from their files instead, a script changes these lines only:
    ``LlamaModel.from_pretrained(repo, subfolder="text_encoder", torch_dtype=torch.float16)``
    becomes ``torchsurgery.from_pretrained(LlamaModel, repo, subfolder="text_encoder",
    dtype=torch.float16, host_budget=...)``, and so for each model.
    """

    def repo(name: str) -> str:
        return os.path.join(folder, CHECKPOINTS[name][0])

    fp16, bf16 = torch.float16, torch.bfloat16
    text_encoder = transformers.LlamaModel.from_pretrained(repo("text_encoder"), subfolder="text_encoder", torch_dtype=fp16)
    text_encoder_2 = transformers.CLIPTextModel.from_pretrained(repo("text_encoder_2"), subfolder="text_encoder_2", torch_dtype=fp16)
    vae = diffusers.AutoencoderKLHunyuanVideo.from_pretrained(repo("vae"), subfolder="vae", torch_dtype=fp16)
    image_encoder = transformers.SiglipVisionModel.from_pretrained(repo("image_encoder"), subfolder="image_encoder", torch_dtype=fp16)
    transformer = FramePackTransformer.from_pretrained(repo("transformer"), torch_dtype=bf16)
    return _as_the_app_sets_up(Models(text_encoder, text_encoder_2, transformer, vae, image_encoder))


def stream_models(folder: str | os.PathLike[str], host_share: float = 0.4) -> Models:
    """:func:`load_models` with its ``from_pretrained`` lines changed as a script changes them:
    every model streamed from its files, never whole in host memory, keeping at most
    ``host_share`` of its checkpoint's bytes there."""

    def repo(name: str) -> str:
        return os.path.join(folder, CHECKPOINTS[name][0])

    def cap(name: str) -> int:
        return int(host_share * checkpoint_bytes(folder, name))

    fp16, bf16 = torch.float16, torch.bfloat16
    text_encoder = torchsurgery.from_pretrained(transformers.LlamaModel, repo("text_encoder"), subfolder="text_encoder", dtype=fp16, host_budget=cap("text_encoder"))
    text_encoder_2 = torchsurgery.from_pretrained(transformers.CLIPTextModel, repo("text_encoder_2"), subfolder="text_encoder_2", dtype=fp16, host_budget=cap("text_encoder_2"))
    vae = torchsurgery.from_pretrained(diffusers.AutoencoderKLHunyuanVideo, repo("vae"), subfolder="vae", dtype=fp16, host_budget=cap("vae"))
    image_encoder = torchsurgery.from_pretrained(transformers.SiglipVisionModel, repo("image_encoder"), subfolder="image_encoder", dtype=fp16, host_budget=cap("image_encoder"))
    transformer = torchsurgery.from_pretrained(FramePackTransformer, repo("transformer"), dtype=bf16, host_budget=cap("transformer"))
    return _as_the_app_sets_up(Models(text_encoder, text_encoder_2, transformer, vae, image_encoder))


def checkpoint_bytes(folder: str | os.PathLike[str], name: str) -> int:
    """Bytes of the safetensors shards of model ``name`` under ``folder``."""
    repo, subfolder = CHECKPOINTS[name]
    path = os.path.join(folder, repo, subfolder or "")
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def _as_the_app_sets_up(models: Models) -> Models:
    """What the app does to its models once loaded: eval mode, no gradients, the fp32 output switch on."""
    for model in vars(models).values():
        model.eval().requires_grad_(False)
    models.transformer.high_quality_fp32_output_for_inference = True
    return models


def plain_moves() -> Any:
    """The app's memory functions done with whole-model ``.to()`` moves (the reference)."""

    def to(model: nn.Module, device: Any, *_: Any, **__: Any) -> None:
        model.to(device)

    def unload(*models: nn.Module) -> None:
        for model in models:
            model.to("cpu")

    return types.SimpleNamespace(
        load_model_as_complete=to, move_model_to_device_with_memory_preservation=to,
        offload_model_from_device_for_memory_preservation=lambda model, *_, **__: model.to("cpu"),
        fake_diffusers_current_device=to, unload_complete_models=unload,
    )


def pool_moves(pool: torchsurgery.DevicePool) -> Any:
    """The app's memory functions as a ComfyUI-style pool does them: each model loaded into
    ``pool`` before use (the least recently used pushed back as far as needed), nothing unloaded
    by hand."""

    def load(model: nn.Module, *_: Any, **__: Any) -> None:
        pool.load(model)

    return types.SimpleNamespace(
        load_model_as_complete=load, move_model_to_device_with_memory_preservation=load,
        offload_model_from_device_for_memory_preservation=lambda *_, **__: None,
        fake_diffusers_current_device=load, unload_complete_models=lambda *_: None,
    )


def run(models: Models, memory: Any, device: torch.device, *, sections: int = 2, steps: int = 3,
        size: str = "tiny", seed: int = 1, preserved_gb: tuple[float, float] = (6, 8),
        grad_off: Any = torch.no_grad) -> dict[str, torch.Tensor]:
    """The app's stages, with its moves in and out, done with ``memory``'s functions.

    ``preserved_gb``: the GiB the app keeps free when it moves the transformer in and when
    it takes it back for the VAE. Inputs take each model's dtype, as the app's pipelines do.
    ``grad_off``: the app runs under ``torch.inference_mode``.
    """
    # TODO(inference_mode): default to torch.inference_mode, as the app, once the test device
    # (tests/tardy) takes inference tensors in its queued copies and the installer with a dtype
    # reads under inference_mode on the CPU ("Cannot set version_counter for inference tensor")
    s = SIZES[size]
    text, clip, transformer, vae = models.text_encoder, models.text_encoder_2, models.transformer, models.vae
    siglip = models.image_encoder
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (1, 12), generator=g)
    mask = torch.ones_like(ids)
    image = torch.rand(1, 3, 1, 8 * s["side"], 8 * s["side"], generator=g) * 2 - 1
    out: dict[str, torch.Tensor] = {}
    # read before any model is installed or moved
    t_dtype, v_dtype, i_dtype = transformer.dtype, vae.dtype, siglip.dtype
    with grad_off():
        memory.unload_complete_models(text, clip, siglip, vae, transformer)

        # text: the Llama encoder is only made to look as if on the device (the installer
        # brings its weights at use); the CLIP encoder is loaded whole
        memory.fake_diffusers_current_device(text, device)
        memory.load_model_as_complete(clip, device)
        hidden = text(ids.to(device), attention_mask=mask.to(device), output_hidden_states=True).hidden_states
        prompt = hidden[-3]  # the app conditions on the third hidden state from the end
        pooled = clip(ids.to(device)).pooler_output
        out["prompt"], out["pooled"] = prompt.cpu(), pooled.cpu()

        # the start image, encoded by the VAE loaded whole
        memory.load_model_as_complete(vae, device)
        start = vae.encode(image.to(device, v_dtype)).latent_dist.mode() * vae.config.scaling_factor
        out["start"] = start.cpu()

        # the start image's embeddings, from the SigLIP encoder loaded whole (the app's
        # preprocessing scales pixels to [-1, 1], as they are here)
        memory.load_model_as_complete(siglip, device)
        image_embeds = siglip(pixel_values=image[:, :, 0].to(device, i_dtype)).last_hidden_state
        out["image_embeds"] = image_embeds.cpu()

        frames, side = s["frames"], s["side"]
        history = torch.zeros(1, LATENT, 1 + 2 + 16, side, side, device=device)
        for section in range(sections):
            memory.unload_complete_models()
            memory.move_model_to_device_with_memory_preservation(transformer, device, preserved_memory_gb=preserved_gb[0])
            latents = torch.randn(1, LATENT, frames, side, side, generator=g).to(device)
            clean = torch.cat([start, history[:, :, :1]], dim=2)
            for step in range(steps):
                t = 1.0 - step / steps
                velocity = transformer(
                    hidden_states=latents.to(t_dtype), timestep=torch.tensor([t * 1000.0], device=device),
                    encoder_hidden_states=prompt.to(t_dtype), encoder_attention_mask=mask.bool().to(device),
                    pooled_projections=pooled.to(t_dtype), image_embeds=image_embeds.to(t_dtype),
                    indices_latents=torch.arange(3, 3 + frames, device=device),
                    guidance=torch.tensor([10000.0], device=device),
                    latents_clean=clean.to(t_dtype), indices_latents_clean=torch.tensor([0, 1], device=device),
                    latents_history_2x=history[:, :, 1:3].to(t_dtype),
                    indices_latents_history_2x=torch.tensor([2, 3], device=device),
                    latents_history_4x=history[:, :, 3:].to(t_dtype),
                    indices_latents_history_4x=torch.arange(4, 20, device=device),
                ).sample
                latents = latents - velocity.float() / steps  # a plain Euler step of the flow, in fp32
            out[f"latents{section}"] = latents.cpu()
            history = torch.cat([latents[:, :, :1], history[:, :, :-1]], dim=2)

            memory.offload_model_from_device_for_memory_preservation(transformer, device, preserved_memory_gb=preserved_gb[1])
            memory.load_model_as_complete(vae, device)
            pixels = vae.decode((latents / vae.config.scaling_factor).to(v_dtype)).sample
            out[f"pixels{section}"] = pixels.cpu()
            memory.unload_complete_models()
    return out


def install_like_the_app(models: Models, device: torch.device, compute_dtype: torch.dtype | None = None) -> None:
    """What the app does on a small GPU: the transformer and the Llama encoder get the installer."""
    kwargs: dict[str, Any] = {"device": device}
    if compute_dtype is not None:
        kwargs["dtype"] = compute_dtype
    framepack.DynamicSwapInstaller.install_model(models.transformer, **kwargs)
    framepack.DynamicSwapInstaller.install_model(models.text_encoder, **kwargs)


def main() -> None:
    device = framepack.gpu
    reference = build_models()
    ours = copy.deepcopy(reference)
    expected = run(reference, plain_moves(), device)
    install_like_the_app(ours, device)
    got = run(ours, framepack, device)
    print(f"device: {device}")
    for key, value in expected.items():
        print(f"{key:9s} {tuple(value.shape)!s:24s} max |difference| {float((got[key] - value).abs().max()):.2e}")


if __name__ == "__main__":
    main()
