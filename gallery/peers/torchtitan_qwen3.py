"""Peer: torchtitan 0.2.2's Qwen3 MoE model code (Qwen3Model, 30B-A3B args with the preset's layer count) in a
plain training loop: torchtitan's trainer needs torch nightlies (0.3.0 does not import on torch 2.11), its model
code runs on 2.11.

    python gallery/peers/torchtitan_qwen3.py [--compile] [--fp8 rowwise] --global-batch 2,16 --json out-{gbs}.json

Built on the meta device, materialised on the GPU with torchtitan's init_weights, cast to bf16; SDPA attention,
experts through torch._grouped_mm (use_grouped_mm=True), fused AdamW, cross entropy on fp32 logits (torchtitan's
sum-reduced loss over the token count).
--compile: as torchtitan's trainer does it (`compile.enable`, components model + loss): its own apply_compile
(each block, or each MoE block's submodules, wrapped with torch.compile(fullgraph=True) and registered back into
model.layers; the grouped-experts function compiled) and the loss function compiled.
--compile-mode blocks (with --compile): each WHOLE block `torch.compile`d and registered back into model.layers
(experts included, one graph per block where dynamo can), the loss compiled: faster than the trainer's
per-submodule wrapping on this proxy (58.5k vs 49.8k tokens/s at global batch 2); the records name the mode
(`compile_mode`: trainer | blocks) and the tables compare moelab with the faster one.
--fp8 rowwise: as torchtitan's float8 converters do it, before compiling: torchao's convert_to_float8_training
with the "rowwise" recipe for the Linear layers (the LM head `output` and the router `gate` left in bf16, as
moelab's train.fp8 leaves them) and torchao's FP8 rowwise grouped GEMMs for the routed experts (token groups
padded to 16 rows)."""
from __future__ import annotations

import dataclasses

import torch

from common import model_config, parser, random_batches, result, run_batches


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


def convert_fp8(model) -> dict:
    """torchao float8 rowwise training for the Linear layers and the routed experts; returns what was used."""
    import torchao
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    skip = ("output", "router.gate")

    def linear_filter(mod, fqn):
        return (isinstance(mod, torch.nn.Linear) and not any(s in fqn for s in skip)
                and mod.weight.shape[0] % 16 == 0 and mod.weight.shape[1] % 16 == 0)

    torch._inductor.config.emulate_precision_casts = True  # torchtitan sets it for the rowwise recipe
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                               module_filter_fn=linear_filter)
    from torchao.quantization.quant_api import quantize_

    try:  # torchao >= 0.16
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig as MoEConfig
    except ImportError:
        from torchao.prototype.moe_training.conversion_utils import MoETrainingConfig as MoEConfig
    from torchtitan.models.moe.utils import set_token_group_alignment_size_m

    set_token_group_alignment_size_m(16)
    quantize_(model, config=MoEConfig(), filter_fn=lambda mod, fqn: fqn.endswith("experts"))
    return {"torchao_version": torchao.__version__, "fp8_linear_recipe": "rowwise",
            "fp8_experts": MoEConfig.__name__}


def compile_like_trainer(model):
    from torchtitan.config.job_config import Compile
    from torchtitan.models.llama4.infra.parallelize import apply_compile

    apply_compile(model, Compile(enable=True, components=["model", "loss"]), ep_enabled=False)


def compile_blocks(model):
    """Each whole transformer block torch.compile'd and registered back into model.layers (the fastest way to
    compile torchtitan's Qwen3 model code measured on the proxy)."""
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, torch.compile(block))


COMPILE_MODES = {"trainer": (compile_like_trainer, "compiled as its trainer (blocks + loss)"),
                 "blocks": (compile_blocks, "each whole block torch.compile'd + compiled loss")}


def main():
    ap = parser(__doc__)
    ap.add_argument("--fp8", default="off", choices=["off", "rowwise"])
    ap.add_argument("--compile-mode", default="trainer", choices=sorted(COMPILE_MODES),
                    help="with --compile: trainer = torchtitan's apply_compile; blocks = each whole block")
    ap.add_argument("--max-norm", default=None, type=float,
                    help="also time the step clipping as torchtitan's trainer does every step "
                         "(torchtitan.distributed.utils.clip_grad_norm_, foreach; its default max_norm is 1.0): "
                         "records with -clip{MAX} before -gbs in the --json name")
    args = ap.parse_args()
    m = model_config(args)
    model, version = build(m, args.seq)
    extra = {"torchtitan_version": version, "fp8": args.fp8}
    if args.compile:
        extra["compile_mode"] = args.compile_mode
    if args.fp8 != "off":
        extra.update(convert_fp8(model))
    from torchtitan.components.loss import cross_entropy_loss

    loss_fn = cross_entropy_loss
    if args.compile:
        COMPILE_MODES[args.compile_mode][0](model)
        loss_fn = torch.compile(cross_entropy_loss)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=True)
    batches = random_batches(args, m.vocab_size)

    def make_step(micro, max_norm=None):
        from torchtitan.distributed import utils as dist_utils

        def step(i):
            for j in range(micro):
                ids = batches[(i * micro + j) % len(batches)]
                logits = model(ids[:, :-1])
                loss = loss_fn(logits, ids[:, 1:]) / ids[:, 1:].numel()
                (loss / micro).backward()
            if max_norm is not None:  # as torchtitan's Trainer.train_step: the norm, then the clip by it
                dist_utils.clip_grad_norm_(list(model.parameters()), max_norm, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    variant = ("0.2.2 model code, " + (COMPILE_MODES[args.compile_mode][1] if args.compile else "eager")
               + (", torchao float8 rowwise" if args.fp8 != "off" else ""))
    run_batches(args, make_step, lambda gbs, times, error=None: result(
        "torchtitan", variant, args, times, extra, gbs=gbs, error=error))
    if args.max_norm is not None:  # the same model, clipping as its trainer does
        clipped = {**extra, "grad_clip": args.max_norm}
        args.json = args.json and args.json.replace("-gbs{gbs}", f"-clip{args.max_norm:g}-gbs{{gbs}}")
        run_batches(args, lambda micro: make_step(micro, args.max_norm), lambda gbs, times, error=None: result(
            "torchtitan", variant + f", its trainer's clip_grad_norm_ (max_norm {args.max_norm:g})", args, times,
            clipped, gbs=gbs, error=error))


if __name__ == "__main__":
    main()
