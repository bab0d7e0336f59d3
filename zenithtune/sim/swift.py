"""The ms-swift flavour: `python -m zenithtune.sim.swift [sft|pt|rlhf] --model DIR --tensor_model_parallel_size 2 ...`

Plays `megatron sft`: options in ms-swift's underscore spelling (dashed aliases parse too), booleans as
`--flag true|false` (or bare), the model shape from `--model`, a local Hugging Face directory with a
config.json (read as plain JSON, through zenithtune.modelinfo's HF translation). The run is the same
simulated Megatron underneath (same rules, memory and time); the log is ms-swift's: one dict per
iteration with `memory(GiB)` (max reserved) and `train_speed(s/it)` (elapsed / iterations so far, so
the warm-up weighs on it, as in ms-swift), never Megatron's `throughput per GPU`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from datetime import timedelta
from functools import cache

from zenithtune.modelinfo import info_from_config
from zenithtune.options import layout_fields
from zenithtune.sim import physics
from zenithtune.sim.arguments import (
    ConfigError,
    SimConfig,
    Vision,
    _Parser,
    add_flavour_options,
    add_perturb_options,
    check_overlap_flags,
    command_flags,
    flavour_of,
    noise_of,
    padded_vocab,
    perturbation,
    world_size,
)
from zenithtune.sim.hardware import GPUS
from zenithtune.sim.trainer import EPOCH, Event, SimResult, finish, prepare, run_config
from zenithtune.validate import Layout

_SUBCOMMANDS = ("sft", "pt", "rlhf")
_BOOL = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _bool(text: str) -> bool:
    try:
        return _BOOL[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}") from None


# Accepted and ignored (they do not change what the simulator models).
_IGNORED = (
    "dataset", "val_dataset", "train_type", "lora_rank", "lora_alpha", "target_modules", "split_dataset_ratio",
    "moe_permute_fusion", "moe_grouped_gemm", "moe_shared_expert_overlap", "moe_aux_loss_coeff",
    "moe_expert_capacity_factor", "finetune", "cross_entropy_loss_fusion", "lr", "lr_warmup_fraction",
    "lr_warmup_iters", "min_lr", "save", "load", "eval_interval", "save_interval", "num_workers",
    "dataset_num_proc", "no_save_optim", "no_save_rng", "model_author", "model_name", "load_safetensors",
    "save_safetensors", "packing", "streaming", "loss_scale", "load_from_cache_file", "torch_dtype",
    "freeze_vit", "freeze_aligner", "freeze_llm", "max_epochs", "system", "padding_free", "seed",
    "weight_decay", "clip_grad", "merge_lora", "model_type", "template", "attn_impl", "max_pixels",
    "use_precision_aware_optimizer", "optimizer_cpu_offload", "eval_iters", "output_dir", "logging_steps",
)


def _add(p: argparse.ArgumentParser, name: str, **kw) -> None:
    """Register --under_score and its --dashed-alias for one destination."""
    flags = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    p.add_argument(*flags, dest=name, **kw)


def _add_bool(p: argparse.ArgumentParser, name: str, default: bool) -> None:
    _add(p, name, type=_bool, nargs="?", const=True, default=default)


@cache
def swift_parser() -> _Parser:
    p = _Parser(prog="megatron sft", allow_abbrev=False)
    _add(p, "model")
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size"):
        _add(p, name, type=int, default=1)
    _add(p, "expert_tensor_parallel_size", type=int)  # None: ms-swift's 1 for a MoE model (Megatron's is tp)
    _add(p, "num_layers_per_virtual_pipeline_stage", type=int)
    _add(p, "virtual_pipeline_model_parallel_size", type=int)
    _add(p, "pipeline_model_parallel_layout")
    _add(p, "decoder_first_pipeline_num_layers", type=int)
    _add(p, "decoder_last_pipeline_num_layers", type=int)
    _add(p, "recompute_modules", nargs="*")
    _add(p, "cp_comm_type", nargs="+")
    _add(p, "micro_batch_size", type=int, default=1)
    _add(p, "global_batch_size", type=int, default=16)
    _add(p, "max_length", type=int, default=2048)
    _add(p, "train_iters", type=int)
    _add(p, "log_interval", type=int, default=1)
    _add(p, "recompute_granularity", choices=["full", "selective", "none"], default="selective")
    _add(p, "recompute_method", choices=["uniform", "block"])
    _add(p, "recompute_num_layers", type=int)
    _add(p, "attention_backend", choices=["auto", "flash", "fused", "unfused", "local"], default="flash")
    for name, default in (("sequence_parallel", False), ("use_distributed_optimizer", True),
                          ("vit_gradient_checkpointing", True), ("overlap_grad_reduce", False),
                          ("overlap_param_gather", False), ("tp_comm_overlap", False), ("bf16", True),
                          ("fp16", False), ("untie_embeddings_and_output_weights", False),
                          ("account_for_embedding_in_pipeline_split", False),
                          ("account_for_loss_in_pipeline_split", False)):
        _add_bool(p, name, default)
    for name in _IGNORED:
        _add(p, name, nargs="*")
    _add(p, "sim_gpu", choices=sorted(GPUS), default="h100")
    _add(p, "sim_gpus_per_node", type=int, default=8)
    _add(p, "sim_world_size", type=int)
    _add(p, "sim_vision_tokens", type=int, default=1024)
    _add(p, "sim_noise", type=float, default=0.0)
    _add(p, "sim_seed", type=int, default=0)
    _add(p, "sim_time_scale", type=float, default=0.0)
    add_perturb_options(lambda name, **kw: _add(p, name, **kw), "sim_perturb_seed", "sim_perturb_scale",
                        "sim_perturb")
    add_flavour_options(lambda name, **kw: _add(p, name, **kw), "sim_flavour", "sim_noise_sigma", "sim_outlier_rate",
                        "sim_noise_seed")
    return p


def _load_hf(model: str | None) -> dict:
    if not model:
        raise ConfigError("please pass --model: a local directory with the model's config.json", "ValueError")
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"--model {model!r}: no config.json there (the simulator reads local directories "
                          f"only; download it with `hf download {model} config.json`)", "ValueError")
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def parse_swift(argv: list[str], env: dict[str, str]) -> SimConfig:
    if argv and argv[0] in _SUBCOMMANDS:
        argv = argv[1:]
    args = swift_parser().parse_args(argv)
    if args.pipeline_model_parallel_size == 1 and (args.decoder_first_pipeline_num_layers is not None
                                                   or args.decoder_last_pipeline_num_layers is not None):
        # ms-swift's MegatronArguments.__post_init__, before Megatron sees the arguments
        raise ConfigError("pipeline_model_parallel_size must be greater than 1 if you want to set "
                          "decoder_first_pipeline_num_layers or decoder_last_pipeline_num_layers.", "ValueError")
    flags = command_flags(["megatron", "sft"], argv)
    raw = _load_hf(args.model)
    info = info_from_config(raw, name=args.model)
    if not (info.num_layers and info.hidden_size and info.num_attention_heads and info.vocab_size):
        raise ConfigError(f"--model {args.model!r}: config.json lacks the layer/hidden/head/vocab sizes", "ValueError")
    notes: list[str] = []
    if args.train_type and args.train_type != ["full"]:
        notes.append(f"[INFO:swift] train_type {' '.join(args.train_type)} is simulated as full-parameter training")
    train_iters = args.train_iters
    if train_iters is None:
        train_iters = 10
        notes.append("[INFO:swift] no --train_iters given: the simulator runs 10 iterations")
    tp = args.tensor_model_parallel_size
    sp = args.sequence_parallel and tp > 1
    warnings = []
    if args.sequence_parallel and tp == 1:
        warnings.append("Disabling sequence parallelism because tensor model parallelism is disabled")
    tie = info.tie_embeddings if info.tie_embeddings is not None else not args.untie_embeddings_and_output_weights
    model = replace(info, seq_length=args.max_length, vocab_size=padded_vocab(info.vocab_size, 1, tp),
                    ffn_hidden_size=info.ffn_hidden_size or 4 * info.hidden_size,
                    num_query_groups=info.num_query_groups or info.num_attention_heads,
                    disable_bias_linear=bool(info.disable_bias_linear), swiglu=bool(info.swiglu),
                    tie_embeddings=tie)
    granularity = None if args.recompute_granularity == "none" else args.recompute_granularity
    n = world_size(args.sim_world_size, env)
    layout = Layout(
        n_gpus=n, gbs=args.global_batch_size, tp=tp, pp=args.pipeline_model_parallel_size,
        cp=args.context_parallel_size, ep=args.expert_model_parallel_size,
        etp=args.expert_tensor_parallel_size if args.expert_tensor_parallel_size is not None else (1 if info.is_moe else None),
        mbs=args.micro_batch_size, layers_per_virtual_stage=args.num_layers_per_virtual_pipeline_stage,
        vpp_size=args.virtual_pipeline_model_parallel_size,
        recompute_granularity=granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers, sequence_parallel=sp,
        pipeline_extra_layers=flags.pipeline_extra_layers, local_impl=flags.local_impl, **layout_fields(flags))
    if min(tp, layout.pp, layout.cp, layout.ep, layout.expert_tp, layout.mbs, n) < 1:
        raise ConfigError("parallel sizes, --micro_batch_size and the world size must be positive integers")
    check_overlap_flags(args, sp)
    vision = None
    if info.is_vlm and info.vision_num_layers and info.vision_hidden_size:
        vcfg = raw.get("vision_config") or {}
        vffn = vcfg.get("intermediate_size") if isinstance(vcfg, dict) else None
        vision = Vision(num_layers=info.vision_num_layers, hidden_size=info.vision_hidden_size,
                        ffn_hidden_size=vffn or 4 * info.vision_hidden_size, tokens=args.sim_vision_tokens,
                        checkpointing=args.vit_gradient_checkpointing)
    return SimConfig(
        model=model, layout=layout, gpu=GPUS[args.sim_gpu], gpus_per_node=min(args.sim_gpus_per_node, n),
        train_iters=train_iters, log_interval=args.log_interval,
        distributed_optimizer=args.use_distributed_optimizer, bf16=args.bf16 or args.fp16,
        flash_attention=args.attention_backend in ("auto", "flash", "fused"), hidden_dropout=0.0,
        attention_dropout=0.0, tp_comm_overlap=args.tp_comm_overlap, overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather, log_throughput=False, vision=vision,
        noise_pct=args.sim_noise, seed=args.sim_seed, time_scale=args.sim_time_scale, perturb=perturbation(args),
        flavour=flavour_of(args), noise=noise_of(args), notes=tuple(notes),
        warnings=tuple(warnings))


def _format_time(seconds: float) -> str:
    """ms-swift's format_time: 1d 2h 3m 4s, leading zero units dropped."""
    s = int(seconds)
    days, hours, minutes, secs = s // 86400, s % 86400 // 3600, s % 3600 // 60, s % 60
    if days:
        return f"{days}d {hours}h {minutes}m {secs}s"
    if hours:
        return f"{hours}h {minutes}m {secs}s"
    if minutes:
        return f"{minutes}m {secs}s"
    return f"{secs}s"


def simulate_swift(argv: list[str], env: dict[str, str] | None = None) -> SimResult:
    """Run `megatron sft argv` on the simulated cluster, in-process."""
    argv = [str(a) for a in argv]
    cfg = prepare(argv, env, parse_swift)
    if isinstance(cfg, SimResult):
        return cfg
    warnings, out = run_config(cfg, env)
    if isinstance(out, SimResult):
        return out
    x = physics.shape_of(cfg)
    mem_gib = round(out.memory.reserved_peak / physics.GIB, 2)
    body: list[Event] = []
    now = out.startup
    loss0 = 2.2
    for i, sec in enumerate(out.iterations, start=1):
        now += sec
        if i % cfg.log_interval and i != cfg.train_iters:
            continue
        elapsed = now - out.startup
        speed = elapsed / i
        logs = {"loss": round(loss0 / (1 + 0.05 * i), 8), "grad_norm": round(1.5 / (1 + 0.1 * i), 8),
                "learning_rate": 1e-05, "consumed_samples": i * cfg.layout.gbs,
                "iteration": f"{i}/{cfg.train_iters}", "elapsed_time": _format_time(elapsed),
                "remaining_time": _format_time((cfg.train_iters - i) * speed), "memory(GiB)": mem_gib,
                "train_speed(s/it)": round(speed, 6)}
        body.append(Event(now, "stdout", str(logs)))
    end = now + 2.0
    res = finish(cfg, out, warnings, body, end)
    # ms-swift's own banner instead of Megatron's "training ..." datetime line
    res.events = [e for e in res.events if not e.text.startswith("[after dataloaders")]
    res.events.insert(0, Event(0.0, "stdout", f"[INFO:swift] model: {cfg.model.name} ({x.L} layers, "
                                              f"hidden {x.h}, vocab {x.V})"))
    res.events.append(Event(end, "stdout", "[INFO:swift] End time of running main: "
                            + (EPOCH + timedelta(seconds=end)).strftime("%Y-%m-%d %H:%M:%S")))
    res.events.sort(key=lambda e: e.at)
    return res


if __name__ == "__main__":
    from zenithtune.sim.cli import main

    sys.exit(main(simulate_swift, sys.argv[1:]))
