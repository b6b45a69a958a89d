"""Peer: torchtitan 0.2.2's Qwen3 MoE model code (Qwen3Model, 30B-A3B args with the preset's layer count) in a
plain training loop: torchtitan's trainer needs torch nightlies (0.3.0 does not import on torch 2.11), its model
code runs on 2.11.

    python gallery/peers/torchtitan_qwen3.py --json out.json

Built on the meta device, materialised on the GPU with torchtitan's init_weights, cast to bf16; SDPA attention,
experts through torch._grouped_mm (use_grouped_mm=True), fused AdamW, cross entropy on fp32 logits."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from common import model_config, parser, random_batches, result, time_training


def build(m, seq: int):
    import torchtitan
    from torchtitan.models.qwen3 import Qwen3Model, qwen3_args

    args = dataclasses.replace(qwen3_args["30B-A3B"], n_layers=m.num_layers, max_seq_len=seq)
    with torch.device("meta"):
        model = Qwen3Model(args)
    model.to_empty(device="cuda")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cuda"))
    model.to(torch.bfloat16)
    model.train()
    return model, getattr(torchtitan, "__version__", "0.2.2")


def main():
    args = parser(__doc__).parse_args()
    m = model_config(args)
    model, version = build(m, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=True)
    batches = random_batches(args, m.vocab_size)
    micro = args.global_batch // args.micro_batch

    def step(i):
        for j in range(micro):
            ids = batches[(i * micro + j) % len(batches)]
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
            (loss / micro).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = time_training(step, args.steps, args.warmup)
    result("torchtitan", "0.2.2 model code, plain loop", args, times, {"torchtitan_version": version})


if __name__ == "__main__":
    main()
