"""Megatron's command line, as `pretrain_gpt.py` parses it, turned into one `SimConfig`.

The parser uses Megatron's exact option names (argparse, `allow_abbrev=False`), so an option Megatron
does not know is `pretrain_gpt.py: error: unrecognized arguments: ...` (exit 2). Options that change
nothing the simulator models (learning rate, data paths, tokenizer, logging sinks, ...) are accepted
and ignored, as a real run ignores them for speed. Simulator-only options all start with `--sim-`.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from zenithtune.command import CommandFacts, facts
from zenithtune.modelinfo import ModelInfo
from zenithtune.options import layout_fields
from zenithtune.sim import flavours
from zenithtune.sim.flavours import PLAIN, Flavour
from zenithtune.sim.hardware import GPU, GPUS
from zenithtune.sim.noise import QUIET, Noise
from zenithtune.sim.perturb import NONE, Perturbation, from_options
from zenithtune.validate import Layout, command_errors


class ArgumentError(Exception):
    """argparse refused the command line: `message` is argparse's text, `status` its exit code."""

    def __init__(self, status: int, message: str, stdout: str = ""):
        super().__init__(message)
        self.status = status
        self.message = message
        self.stdout = stdout


class ConfigError(Exception):
    """Megatron's validate_args refused a value (AssertionError / ValueError in the real code)."""

    def __init__(self, message: str, exc_type: str = "AssertionError"):
        super().__init__(message)
        self.message = message
        self.exc_type = exc_type


@dataclass(frozen=True)
class Vision:
    """The vision tower of a VLM run (a ViT in front of the GPT); lives on the first pipeline stage."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    tokens: int  # patch tokens per sample the tower encodes
    checkpointing: bool  # --vit-gradient-checkpointing


@dataclass(frozen=True)
class SimConfig:
    """Everything one simulated run depends on."""

    model: ModelInfo  # complete: every shape field set (vocab padded as Megatron pads it)
    layout: Layout
    gpu: GPU
    gpus_per_node: int
    train_iters: int
    log_interval: int = 1
    distributed_optimizer: bool = False
    bf16: bool = True  # bf16 or fp16 mixed precision; False = fp32 training (TF32 GEMMs)
    flash_attention: bool = True  # fused/flash attention keeps no s x s scores (MCore's default backend)
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    tp_comm_overlap: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    log_throughput: bool = False
    vision: Vision | None = None
    noise_pct: float = 0.0  # --sim-noise: run-to-run noise, percent (seeded)
    seed: int = 0  # --sim-seed
    time_scale: float = 0.0  # --sim-time-scale
    perturb: Perturbation = NONE  # --sim-perturb-seed / --sim-perturb-scale / --sim-perturb (sim/perturb.py)
    flavour: Flavour = PLAIN  # --sim-flavour: structurally different physics (sim/flavours.py)
    noise: Noise = QUIET  # --sim-noise-sigma / --sim-outlier-rate / --sim-noise-seed (sim/noise.py)
    notes: tuple[str, ...] = field(default=())  # lines Megatron prints while parsing (padded vocab, ...)
    warnings: tuple[str, ...] = field(default=())  # Megatron-style warnings for stderr


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so `simulate()` can run in-process."""

    def _print_message(self, message: str, file=None) -> None:  # -h/--help
        if message:
            self._help_text = getattr(self, "_help_text", "") + message

    def exit(self, status: int = 0, message: str | None = None):
        text = getattr(self, "_help_text", "")
        self._help_text = ""
        raise ArgumentError(status, message or "", stdout=text)

    def error(self, message: str):
        raise ArgumentError(2, f"usage: {self.prog} [-h] [options]\n{self.prog}: error: {message}\n")


# Accepted and ignored: they change nothing the simulator models.
_IGNORED_VALUE_OPTIONS = (
    "--lr", "--min-lr", "--lr-decay-style", "--lr-decay-iters", "--lr-decay-samples", "--lr-warmup-iters",
    "--lr-warmup-fraction", "--lr-warmup-samples", "--weight-decay", "--clip-grad", "--adam-beta1",
    "--adam-beta2", "--adam-eps", "--init-method-std", "--seed", "--split", "--tokenizer-type",
    "--tokenizer-model", "--vocab-file", "--merge-file", "--save", "--load", "--save-interval",
    "--eval-interval", "--eval-iters", "--distributed-backend", "--distributed-timeout-minutes",
    "--tensorboard-dir", "--wandb-project", "--wandb-exp-name", "--exit-interval", "--transformer-impl",
    "--normalization", "--norm-epsilon", "--rotary-base", "--rotary-percent", "--timing-log-level",
    "--moe-token-dispatcher-type", "--moe-aux-loss-coeff", "--moe-router-load-balancing-type",
    "--moe-router-dtype", "--moe-expert-capacity-factor", "--ckpt-format", "--num-workers",
    "--dataloader-type", "--optimizer", "--loss-scale", "--initial-loss-scale", "--data-cache-path",
    "--micro-batch-size-per-gpu", "--manual-gc-interval", "--tensorboard-log-interval",
    "--use-rotary-position-embeddings-base",
)
_IGNORED_FLAGS = (
    "--mock-data", "--use-mcore-models", "--no-load-optim", "--no-load-rng", "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-bias-swiglu-fusion",
    "--no-gradient-accumulation-fusion", "--no-rope-fusion", "--cross-entropy-loss-fusion",
    "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard", "--log-memory-to-tensorboard",
    "--log-params-norm", "--log-num-zeros-in-grad", "--manual-gc", "--moe-grouped-gemm",
    "--moe-permute-fusion", "--qk-layernorm", "--attention-softmax-in-fp32",
    "--accumulate-allreduce-grads-in-fp32", "--no-create-attention-mask-in-dataloader",
    "--use-rotary-position-embeddings", "--no-position-embedding", "--apply-query-key-layer-scaling",
    "--no-async-tensor-model-parallel-allreduce", "--empty-unused-memory-level", "--no-save-optim",
    "--no-save-rng", "--use-checkpoint-args", "--exit-on-missing-checkpoint", "--moe-shared-expert-overlap",
    "--overlap-param-gather-with-optimizer-step", "--check-for-nan-in-loss-and-grad",
    "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute",  # read from the layout (command.facts)
)


@cache
def megatron_parser() -> _Parser:
    """Built once per process: building argparse costs more than parsing with it."""
    p = _Parser(prog="pretrain_gpt.py", description="Megatron-LM Arguments (zenithtune simulator)",
                allow_abbrev=False)
    # model shape
    p.add_argument("--num-layers", type=int)
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--ffn-hidden-size", type=int)
    p.add_argument("--num-attention-heads", type=int)
    p.add_argument("--group-query-attention", action="store_true")
    p.add_argument("--num-query-groups", type=int, default=1)
    p.add_argument("--kv-channels", type=int)
    p.add_argument("--seq-length", type=int)
    p.add_argument("--max-position-embeddings", type=int)
    p.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "mrope", "none"],
                   default="learned_absolute")
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--swiglu", action="store_true")
    p.add_argument("--disable-bias-linear", action="store_true")
    p.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    p.add_argument("--hidden-dropout", type=float, default=0.1)
    p.add_argument("--attention-dropout", type=float, default=0.1)
    p.add_argument("--attention-backend", choices=["auto", "flash", "fused", "unfused", "local"], default="auto")
    p.add_argument("--use-flash-attn", action="store_true")
    p.add_argument("--num-experts", type=int)
    p.add_argument("--moe-router-topk", type=int, default=2)
    p.add_argument("--moe-ffn-hidden-size", type=int)
    p.add_argument("--moe-shared-expert-intermediate-size", type=int)
    p.add_argument("--moe-layer-freq", type=int, default=1)
    # vision tower (VLM runs only; see parse_megatron)
    p.add_argument("--vision-num-layers", type=int)
    p.add_argument("--vision-hidden-size", type=int)
    p.add_argument("--vision-ffn-hidden-size", type=int)
    p.add_argument("--vision-seq-length", type=int, default=1024)
    p.add_argument("--vit-gradient-checkpointing", choices=["true", "false"], type=str.lower)
    # batch and schedule
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--global-batch-size", type=int)
    p.add_argument("--train-iters", type=int)
    p.add_argument("--train-samples", type=int)
    p.add_argument("--log-interval", type=int, default=1)  # Megatron's default is 100; 1 suits short trials
    p.add_argument("--log-throughput", action="store_true")
    # parallelism
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--context-parallel-size", type=int, default=1)
    p.add_argument("--expert-model-parallel-size", type=int, default=1)
    p.add_argument("--expert-tensor-parallel-size", type=int)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    p.add_argument("--num-virtual-stages-per-pipeline-rank", type=int)
    p.add_argument("--pipeline-model-parallel-layout")
    p.add_argument("--decoder-first-pipeline-num-layers", type=int)
    p.add_argument("--decoder-last-pipeline-num-layers", type=int)
    p.add_argument("--account-for-embedding-in-pipeline-split", action="store_true")
    p.add_argument("--account-for-loss-in-pipeline-split", action="store_true")
    p.add_argument("--cp-comm-type", nargs="+", default=["p2p"])
    p.add_argument("--hierarchical-context-parallel-sizes", nargs="+", type=int)
    p.add_argument("--hybrid-context-parallel", action="store_true")
    p.add_argument("--calculate-per-token-loss", action="store_true")
    p.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm")
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--overlap-grad-reduce", action="store_true")
    p.add_argument("--overlap-param-gather", action="store_true")
    p.add_argument("--tp-comm-overlap", action="store_true")
    # recompute
    p.add_argument("--recompute-granularity", choices=["full", "selective"])
    p.add_argument("--recompute-method", choices=["uniform", "block"])
    p.add_argument("--recompute-num-layers", type=int)
    p.add_argument("--recompute-activations", action="store_true")
    p.add_argument("--recompute-modules", nargs="*")
    # precision
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--fp16", action="store_true")
    # accepted, ignored
    for name in _IGNORED_VALUE_OPTIONS:
        p.add_argument(name, help=argparse.SUPPRESS)
    for name in _IGNORED_FLAGS:
        p.add_argument(name, action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data-path", nargs="*", help=argparse.SUPPRESS)
    # the simulator's own
    p.add_argument("--sim-gpu", choices=sorted(GPUS), default="h100", help="GPU the simulator plays")
    p.add_argument("--sim-gpus-per-node", type=int, default=8, help="GPUs per node (NVLink domain)")
    p.add_argument("--sim-world-size", type=int, help="world size (default: env WORLD_SIZE, else 1)")
    p.add_argument("--sim-noise", type=float, default=0.0, help="run-to-run noise in percent (seeded)")
    p.add_argument("--sim-seed", type=int, default=0, help="seed of --sim-noise")
    p.add_argument("--sim-time-scale", type=float, default=0.0,
                   help="sleep this x the simulated wall time (0: instant)")
    add_perturb_options(p.add_argument, "--sim-perturb-seed", "--sim-perturb-scale", "--sim-perturb")
    add_flavour_options(p.add_argument, "--sim-flavour", "--sim-noise-sigma", "--sim-outlier-rate", "--sim-noise-seed")
    return p


def add_perturb_options(add: Any, seed: str, scale: str, factors: str) -> None:
    """The perturbation options (both flavours spell them their own way)."""
    add(seed, type=int, default=None, help="draw per-component errors of memory and speed from this seed")
    add(scale, type=float, default=0.3, help="largest drawn error per component (0.3: +-30 %%)")
    add(factors, default=None, help="explicit factors, e.g. ep_comm=1.3,activations=1.2 (sim/perturb.py)")


def add_flavour_options(add: Any, flavour: str, sigma: str, rate: str, seed: str) -> None:
    """The flavour and measurement-noise options (both front ends spell them their own way)."""
    add(flavour, action="append", default=None,
        help="structurally different physics, e.g. stand_in or mbs_buffers,tp_exposed (sim/flavours.py)")
    add(sigma, type=float, default=0.0, help="per-run noise: iteration times x exp(N(0, sigma)) (0.03: ~3 %%)")
    add(rate, type=float, default=0.0, help="share of runs 1.5x slower (outliers)")
    add(seed, type=int, default=0, help="seed of the measurement noise")


def flavour_of(args: Any) -> Flavour:
    try:
        return flavours.parse(",".join(args.sim_flavour or []))
    except ValueError as err:
        raise ConfigError(str(err), "ValueError") from None


def noise_of(args: Any) -> Noise:
    try:
        return Noise(args.sim_noise_sigma, args.sim_outlier_rate, args.sim_noise_seed)
    except ValueError as err:
        raise ConfigError(str(err), "ValueError") from None


def perturbation(args: Any) -> Perturbation:
    try:
        return from_options(args.sim_perturb_seed, args.sim_perturb_scale, args.sim_perturb)
    except ValueError as err:
        raise ConfigError(str(err), "ValueError") from None


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by x TP."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab / multiple) * multiple)


def world_size(option: int | None, env: dict[str, str]) -> int:
    if option is not None:
        return option
    value = env.get("WORLD_SIZE")
    if value is None and env.get("NPROC_PER_NODE"):  # ms-swift's launcher variables
        value = str(int(env["NPROC_PER_NODE"]) * int(env.get("NNODES", "1")))
    try:
        return int(value) if value else 1
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={value!r} is not an integer", "ValueError") from None


def command_flags(program: list[str], argv: list[str]) -> CommandFacts:
    """The layout flags as the tuner reads them (`command.facts`), so both judge them with the same
    functions (`validate.command_errors`, the rules); Megatron refuses the command's contradictions."""
    flags = facts([*program, *argv])
    errors = command_errors(flags)
    if errors:
        raise ConfigError(errors[0])
    return flags


def parse_megatron(argv: list[str], env: dict[str, str]) -> SimConfig:
    """Parse like pretrain_gpt.py; raise ArgumentError (exit 2) or ConfigError (exit 1)."""
    args = megatron_parser().parse_args(argv)
    flags = command_flags(["pretrain_gpt.py"], argv)
    if args.vision_num_layers is None and args.vit_gradient_checkpointing is not None:
        # pretrain_gpt.py has no ViT: the option only exists for a run with a vision tower
        megatron_parser().error("unrecognized arguments: --vit-gradient-checkpointing "
                                "(vision options need a vision tower: --vision-num-layers)")
    notes: list[str] = []
    warnings: list[str] = []
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size"):
        if getattr(args, name) is None:
            raise ConfigError(f"--{name.replace('_', '-')} is required")
    if args.train_iters is None and args.train_samples is None:
        raise ConfigError("either --train-iters or --train-samples must be provided")
    if args.bf16 and args.fp16:
        raise ConfigError("cannot use both --bf16 and --fp16")
    n = world_size(args.sim_world_size, env)
    if n < 1:
        raise ConfigError(f"world size ({n}) must be at least 1")
    if args.sim_gpus_per_node < 1:
        raise ConfigError(f"--sim-gpus-per-node ({args.sim_gpus_per_node}) must be at least 1")
    tp = args.tensor_model_parallel_size
    if min(tp, args.pipeline_model_parallel_size, args.context_parallel_size,
           args.expert_model_parallel_size, args.expert_tensor_parallel_size or 1, args.micro_batch_size) < 1:
        raise ConfigError("parallel sizes and --micro-batch-size must be positive integers")

    h, a = args.hidden_size, args.num_attention_heads
    sequence_parallel = args.sequence_parallel
    if sequence_parallel and tp == 1:
        warnings.append("Disabling sequence parallelism because tensor model parallelism is disabled")
        sequence_parallel = False
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute" and args.max_position_embeddings < args.seq_length:
        raise ConfigError(f"max_position_embeddings ({args.max_position_embeddings}) must be at least "
                          f"seq_length ({args.seq_length})")
    groups = args.num_query_groups if args.group_query_attention else a
    if not args.group_query_attention and any(tok.split("=")[0] == "--num-query-groups" for tok in argv):
        warnings.append(f"--num-query-groups ({args.num_query_groups}) is ignored without "
                        f"--group-query-attention; using {a} groups (one per head)")
    ffn = args.ffn_hidden_size or (int(4 * h * 2 / 3 / 64) * 64 if args.swiglu else 4 * h)
    raw_vocab = args.vocab_size
    if raw_vocab is None:
        raw_vocab = 50257
        notes.append("> no --vocab-size given: using the GPT-2 BPE vocabulary (50257 tokens)")
    vocab = padded_vocab(raw_vocab, args.make_vocab_size_divisible_by, tp)
    notes.append(f" > padded vocab (size: {raw_vocab}) with {vocab - raw_vocab} dummy tokens "
                 f"(new size: {vocab})")
    experts = args.num_experts or 0
    model = ModelInfo(
        name="command", num_layers=args.num_layers, hidden_size=h, ffn_hidden_size=ffn,
        num_attention_heads=a, num_query_groups=groups, kv_channels=args.kv_channels, vocab_size=vocab,
        seq_length=args.seq_length, num_experts=experts,
        moe_router_topk=args.moe_router_topk if experts else None,
        moe_ffn_hidden_size=(args.moe_ffn_hidden_size or ffn) if experts else None,
        moe_shared_expert_size=(args.moe_shared_expert_intermediate_size or 0) if experts else None,
        moe_layer_freq=args.moe_layer_freq if experts else None, swiglu=args.swiglu,
        disable_bias_linear=args.disable_bias_linear, tie_embeddings=not args.untie_embeddings_and_output_weights,
        is_vlm=args.vision_num_layers is not None, vision_num_layers=args.vision_num_layers,
        vision_hidden_size=args.vision_hidden_size)

    granularity, method, num_layers = args.recompute_granularity, args.recompute_method, args.recompute_num_layers
    if args.recompute_activations:
        if granularity not in (None, "selective"):
            raise ConfigError("--recompute-activations (selective) conflicts with --recompute-granularity full")
        granularity = "selective"
    dp_guess = n // (tp * args.pipeline_model_parallel_size * args.context_parallel_size) or 1
    gbs = args.global_batch_size
    if gbs is None:
        gbs = args.micro_batch_size * dp_guess
        notes.append(f"setting global batch size to {gbs}")
    layout = Layout(
        n_gpus=n, gbs=gbs, tp=tp, pp=args.pipeline_model_parallel_size, cp=args.context_parallel_size,
        ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size, mbs=args.micro_batch_size,
        layers_per_virtual_stage=args.num_layers_per_virtual_pipeline_stage,
        vpp_size=args.num_virtual_stages_per_pipeline_rank,
        recompute_granularity=granularity, recompute_method=method, recompute_num_layers=num_layers,
        sequence_parallel=sequence_parallel, overlap_p2p=args.overlap_p2p_comm,
        pipeline_extra_layers=flags.pipeline_extra_layers, local_impl=flags.local_impl, **layout_fields(flags))

    check_overlap_flags(args, sequence_parallel)
    train_iters = args.train_iters if args.train_iters is not None else max(1, args.train_samples // gbs)
    if train_iters < 1 or args.log_interval < 1:
        raise ConfigError(f"--train-iters ({train_iters}) and --log-interval ({args.log_interval}) must be >= 1")

    vision = None
    if args.vision_num_layers is not None:
        vh = args.vision_hidden_size or 1280
        vision = Vision(num_layers=args.vision_num_layers, hidden_size=vh,
                        ffn_hidden_size=args.vision_ffn_hidden_size or 4 * vh, tokens=args.vision_seq_length,
                        checkpointing=(args.vit_gradient_checkpointing or "true") == "true")  # ms-swift's default
    return SimConfig(
        model=model, layout=layout, gpu=GPUS[args.sim_gpu], gpus_per_node=min(args.sim_gpus_per_node, n),
        train_iters=train_iters, log_interval=args.log_interval,
        distributed_optimizer=args.use_distributed_optimizer, bf16=args.bf16 or args.fp16,
        flash_attention=args.use_flash_attn or args.attention_backend in ("auto", "flash", "fused"),
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        tp_comm_overlap=args.tp_comm_overlap, overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather, log_throughput=args.log_throughput, vision=vision,
        noise_pct=args.sim_noise, seed=args.sim_seed, time_scale=args.sim_time_scale, perturb=perturbation(args),
        flavour=flavour_of(args), noise=noise_of(args), notes=tuple(notes), warnings=tuple(warnings))


def check_overlap_flags(args: Any, sequence_parallel: bool) -> None:
    """Option-consistency checks Megatron makes on flags the tuner never varies (both flavours); the
    command's own contradictions (--overlap-param-gather without the distributed optimizer, ...) are
    `command_flags`'s."""
    if args.tp_comm_overlap and not sequence_parallel:
        raise ConfigError("Tensor parallel communication/GEMM overlap can happen only when sequence "
                          "parallelism is enabled")
