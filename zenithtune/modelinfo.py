"""What the tuner knows about the model's shape.

`ModelInfo` is the one description of a model used by the validator, the memory estimate and the
strategies. Every field may be None ("unknown"): a rule that needs an unknown field does not fire.

Three sources, highest precedence first (`resolve`):
1. explicit values the user gave (`num_layers=48`, `num_query_groups=4`, any field below);
2. the wrapped command's own options (`from_argv`: Megatron's `--num-layers ...`, or ms-swift's
   `--model <id or dir>`, whose config is loaded like 3.);
3. `model=<HF id or local dir>` through `transformers.AutoConfig`, offline only (`from_hf`).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, fields, replace
from typing import Any

from zenithtune import command
from zenithtune.command import parse_bool
from zenithtune.errors import UserError

log = logging.getLogger(__name__)


class ModelInfoError(UserError):
    """The model's shape could not be resolved; the message is one line naming the fix."""


@dataclass(frozen=True)
class ModelInfo:
    name: str | None = None  # where the shape came from (HF id, directory, "command", ...)
    num_layers: int | None = None
    hidden_size: int | None = None
    ffn_hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_query_groups: int | None = None  # == heads for plain multi-head attention
    kv_channels: int | None = None  # head dim when it is not hidden/heads
    vocab_size: int | None = None
    seq_length: int | None = None
    num_experts: int | None = None  # None or 0 for dense models
    moe_router_topk: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_size: int | None = None  # total ffn width of shared experts, 0/None if none
    moe_layer_freq: int | None = None  # every k-th layer is MoE (1 = all); None = all
    swiglu: bool | None = None
    disable_bias_linear: bool | None = None
    tie_embeddings: bool | None = None
    is_vlm: bool = False
    vision_num_layers: int | None = None
    vision_hidden_size: int | None = None
    vision_params: int | None = None  # parameter count of the vision tower, if known
    vision_ffn_hidden_size: int | None = None  # MLP width of the vision tower
    vision_seq_length: int | None = None  # patch tokens per sample the vision tower encodes

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts) and (self.num_experts or 0) > 1

    @property
    def ffn(self) -> int | None:
        """The dense FFN width: the stated one, else Megatron's default for this hidden size (see
        `default_ffn_hidden_size`); None when the hidden size is unknown. memory, sim and
        strategies/_throughput should read this instead of recomputing the default."""
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return default_ffn_hidden_size(self.hidden_size, self.swiglu) if self.hidden_size else None

    @property
    def head_dim(self) -> int | None:
        if self.kv_channels:
            return self.kv_channels
        if self.hidden_size and self.num_attention_heads:
            return self.hidden_size // self.num_attention_heads
        return None

    def merged_over(self, lower: ModelInfo) -> ModelInfo:
        """This info's known fields, falling back to `lower`'s for the unknown ones."""
        values = {}
        for f in fields(self):
            mine = getattr(self, f.name)
            values[f.name] = mine if mine is not None else getattr(lower, f.name)
        values["is_vlm"] = self.is_vlm or lower.is_vlm
        return replace(self, **values)

    def summary(self) -> str:
        """One line for logs: "Qwen3-30B-A3B: 48 layers, h=2048, 32 heads / 4 groups, 128 experts top-8"."""
        parts: list[str] = []
        if self.num_layers:
            parts.append(f"{self.num_layers} layers")
        if self.hidden_size:
            parts.append(f"h={self.hidden_size}")
        if self.num_attention_heads:
            groups = self.num_query_groups or self.num_attention_heads
            parts.append(f"{self.num_attention_heads} heads / {groups} groups")
        elif self.num_query_groups:
            parts.append(f"{self.num_query_groups} groups")
        if self.is_moe:
            parts.append(f"{self.num_experts} experts" + (f" top-{self.moe_router_topk}" if self.moe_router_topk else ""))
        if self.seq_length:
            parts.append(f"s={self.seq_length}")
        if self.is_vlm:
            parts.append("VLM" + (f" (vision {self.vision_num_layers} layers)" if self.vision_num_layers else ""))
        label = os.path.basename(os.path.normpath(self.name)) if self.name else "model"
        return f"{label}: {', '.join(parts) if parts else 'shape unknown'}"


def default_ffn_hidden_size(hidden_size: int, swiglu: bool | None) -> int:
    """Megatron's FFN width when --ffn-hidden-size is not given: 4h, or with SwiGLU 8h/3 rounded down to
    a multiple of 64 (megatron/training/arguments.py, validate_args: `args.ffn_hidden_size = int((4 *
    args.hidden_size * 2 / 3) / 64) * 64` under --swiglu)."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64 if swiglu else 4 * hidden_size


MODEL_FIELDS = frozenset(f.name for f in fields(ModelInfo))


# --- the wrapped command -------------------------------------------------------------------------

# Megatron option (dashed, no leading --) -> ModelInfo field; ms-swift's underscore spelling is the same
# name with "_" and is normalised before lookup.
_INT_OPTIONS = {
    "num-layers": "num_layers",
    "hidden-size": "hidden_size",
    "ffn-hidden-size": "ffn_hidden_size",
    "num-attention-heads": "num_attention_heads",
    "num-query-groups": "num_query_groups",
    "kv-channels": "kv_channels",
    "seq-length": "seq_length",
    "vocab-size": "vocab_size",
    "num-experts": "num_experts",
    "moe-router-topk": "moe_router_topk",
    "moe-ffn-hidden-size": "moe_ffn_hidden_size",
    "moe-shared-expert-intermediate-size": "moe_shared_expert_size",
    "moe-layer-freq": "moe_layer_freq",
    "vision-num-layers": "vision_num_layers",
    "vision-hidden-size": "vision_hidden_size",
    "vision-ffn-hidden-size": "vision_ffn_hidden_size",
    "vision-seq-length": "vision_seq_length",
}
_FLAGS = ("swiglu", "disable-bias-linear", "untie-embeddings-and-output-weights", "group-query-attention")
def _flag(opts: dict[str, str | None], name: str) -> bool | None:
    """True/False when the flag is given (bare, or ms-swift's `--flag true|false`), else None."""
    if name not in opts:
        return None
    value = opts[name]
    if value is None:
        return True
    word = parse_bool(value.split()[0]) if value.split() else None
    return True if word is None else word


def _int(key: str, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        log.warning("ignoring --%s=%r from the command: not an integer", key, value)
        return None


def from_argv(argv: list[str]) -> ModelInfo:
    """The model shape the wrapped command's own options state.

    Megatron's options (`--num-layers 32 --hidden-size 4096 ...`, also `--k=v` and ms-swift's
    `--num_layers`) give the shape directly; when the command states a shape (`--num-layers` or
    `--hidden-size`) Megatron's defaults fill the rest: query groups = heads without
    `--group-query-attention`, no SwiGLU/bias-free/untied unless the flag is given, ffn = 4h
    (SwiGLU: 8h/3 rounded down to 64), top-k 2, dense without `--num-experts`.
    ms-swift's `--model <id or dir>` loads that config (`from_hf`) under the command's options.
    `--vit-gradient-checkpointing`, `--vit_*` or a `--vision-*` option marks a VLM.
    """
    opts = command.options(list(argv))
    values: dict[str, Any] = {}
    for key, field in _INT_OPTIONS.items():
        if key in opts:
            value = _int(key, opts[key])
            if value is not None:
                values[field] = value
    if "seq_length" not in values and "max-length" in opts:
        # ms-swift's --max_length is its sequence length (an upper bound without packing)
        value = _int("max-length", opts["max-length"])
        if value is not None:
            values["seq_length"] = value
    flags = {name: _flag(opts, name) for name in _FLAGS}
    if flags["swiglu"] is not None:
        values["swiglu"] = flags["swiglu"]
    if flags["disable-bias-linear"] is not None:
        values["disable_bias_linear"] = flags["disable-bias-linear"]
    if flags["untie-embeddings-and-output-weights"] is not None:
        values["tie_embeddings"] = not flags["untie-embeddings-and-output-weights"]
    if any(k.startswith(("vit-", "vision-")) for k in opts):
        values["is_vlm"] = True

    hf_model = opts.get("model")
    states_shape = "num_layers" in values or "hidden_size" in values
    if states_shape and not hf_model:
        _megatron_defaults(values, gqa=bool(flags["group-query-attention"]))
    elif flags["group-query-attention"] is False:
        values.pop("num_query_groups", None)

    info = ModelInfo(name=hf_model or ("command" if values else None), **values)
    if hf_model:
        info = info.merged_over(from_hf(hf_model))
    return info


def _megatron_defaults(values: dict[str, Any], *, gqa: bool) -> None:
    """Fill what Megatron's argument parser derives when an option is absent."""
    heads, hidden = values.get("num_attention_heads"), values.get("hidden_size")
    if not gqa and heads:
        values["num_query_groups"] = heads  # --num-query-groups is ignored without --group-query-attention
    values.setdefault("swiglu", False)
    values.setdefault("disable_bias_linear", False)
    values.setdefault("tie_embeddings", True)
    if hidden and "ffn_hidden_size" not in values:
        values["ffn_hidden_size"] = default_ffn_hidden_size(hidden, values["swiglu"])
    if values.get("num_experts"):
        values.setdefault("moe_router_topk", 2)
        values.setdefault("moe_ffn_hidden_size", values.get("ffn_hidden_size"))
        values.setdefault("moe_shared_expert_size", 0)
    else:
        values.setdefault("num_experts", 0)


# --- Hugging Face configs ------------------------------------------------------------------------

def _offline_error(model: str, why: str) -> ModelInfoError:
    why = " ".join(str(why).split())[:160]  # one line, never a traceback
    return ModelInfoError(
        f"model={model!r}: cannot read its config offline ({why}); zenithtune works offline: pre-download it "
        f"with `hf download {model} config.json`, pass a local directory with config.json, "
        f"or give the shape instead (num_layers=..., num_query_groups=..., num_experts=... for MoE)")


def _load_config(model: str) -> Any:
    """AutoConfig offline; a cached/local config.json that AutoConfig cannot parse (unknown or
    remote-code model_type) is read as plain JSON instead (said in the log)."""
    try:
        # Without torch, importing transformers prints "PyTorch was not found" (an advisory warning):
        # zenithtune only reads configs, so the line is noise on a user's terminal.
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        from transformers import AutoConfig  # lazy: importing transformers takes ~1.5 s
    except ImportError as exc:  # pragma: no cover - transformers is a dependency
        raise _offline_error(model, f"transformers is not installed: {exc}") from None
    try:
        return AutoConfig.from_pretrained(model, local_files_only=True)
    except Exception as exc:  # OSError (not cached), ValueError/KeyError (unknown model_type), ...
        error = exc
    path = os.path.join(model, "config.json") if os.path.isdir(model) else None
    if path is None:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model, "config.json")
            path = cached if isinstance(cached, str) else None
        except Exception:
            path = None
    if path and os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as fh:
                raw = json.load(fh)
        except (OSError, ValueError) as exc:
            raise _offline_error(model, f"{path}: {exc}") from None
        log.warning("model=%s: AutoConfig could not parse it (%s); reading %s as plain JSON",
                    model, " ".join(str(error).split())[:120], path)
        return raw
    raise _offline_error(model, type(error).__name__ if not str(error) else str(error).splitlines()[0]) from None


def _get(cfg: Any, *names: str) -> Any:
    """First non-None value among `names` on a config object or dict."""
    for name in names:
        value = cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)
        if value is not None:
            return value
    return None


def _as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text_config(cfg: Any) -> Any:
    if isinstance(cfg, dict):
        sub = _get(cfg, "text_config", "llm_config", "language_config")
        return sub if isinstance(sub, dict) else cfg
    getter = getattr(cfg, "get_text_config", None)
    return getter() if callable(getter) else cfg


def _vision_config(cfg: Any) -> Any:
    return _get(cfg, "vision_config", "vision_tower", "vision_encoder", "vit_config", "visual")


def _vision_params(vision: Any) -> tuple[int | None, int | None, int | None]:
    """(layers, hidden, approximate parameter count) of a vision tower config.

    Approximate: blocks as attention 4·hv² plus an MLP (3·hv·F gated, else 2·hv·F), plus a
    patch-merger projection when the config names one; patch embedding and norms are ignored.
    """
    layers = _as_int(_get(vision, "depth", "num_hidden_layers", "num_layers", "layers"))
    hidden = _as_int(_get(vision, "hidden_size", "embed_dim", "width"))
    if not layers or not hidden:
        return layers, hidden, None
    ffn = _as_int(_get(vision, "intermediate_size"))
    if ffn is None:
        ratio = _get(vision, "mlp_ratio")
        ffn = int(hidden * (ratio if isinstance(ratio, (int, float)) else 4))
    gated = str(_get(vision, "hidden_act") or "").lower() in ("silu", "swish")
    params = layers * (4 * hidden * hidden + (3 if gated else 2) * hidden * ffn)
    merge, out = _as_int(_get(vision, "spatial_merge_size")), _as_int(_get(vision, "out_hidden_size"))
    if merge and out:
        wide = hidden * merge * merge
        params += wide * wide + wide * out
    return layers, hidden, params


def info_from_config(cfg: Any, name: str | None = None) -> ModelInfo:
    """Translate a Hugging Face config (a PretrainedConfig or its dict) into a ModelInfo.

    `max_position_embeddings` is what the model supports, not the training sequence length, so
    `seq_length` stays unknown here.
    """
    text = _text_config(cfg)
    layers = _as_int(_get(text, "num_hidden_layers", "num_layers", "n_layer"))
    hidden = _as_int(_get(text, "hidden_size", "n_embd", "d_model"))
    heads = _as_int(_get(text, "num_attention_heads", "n_head"))
    groups = _as_int(_get(text, "num_key_value_heads", "multi_query_group_num")) or heads
    head_dim = _as_int(_get(text, "head_dim", "kv_channels"))
    kv_channels = head_dim if head_dim and hidden and heads and head_dim * heads != hidden else None
    ffn = _as_int(_get(text, "intermediate_size", "ffn_hidden_size", "n_inner"))

    experts = _as_int(_get(text, "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")) or 0
    topk = moe_ffn = shared = freq = None
    if experts > 1:
        topk = _as_int(_get(text, "num_experts_per_tok", "moe_topk", "moe_router_topk"))
        moe_ffn = _as_int(_get(text, "moe_intermediate_size")) or ffn  # Mixtral: experts use intermediate_size
        shared = _as_int(_get(text, "shared_expert_intermediate_size"))
        n_shared = _as_int(_get(text, "n_shared_experts", "num_shared_experts"))
        if shared is None and n_shared and moe_ffn:
            shared = n_shared * moe_ffn
        shared = shared or 0
        freq = _as_int(_get(text, "decoder_sparse_step", "moe_layer_freq"))

    act = str(_get(text, "hidden_act", "hidden_activation", "activation_function") or "").lower()
    swiglu = True if act in ("silu", "swish") else (False if act else None)
    mlp_bias = _get(text, "mlp_bias")
    # HF's gated-MLP decoders carry no bias in their linear layers unless mlp_bias says so.
    disable_bias = (not mlp_bias) if mlp_bias is not None else (True if swiglu else None)
    tie = _get(text, "tie_word_embeddings")
    if tie is None:
        tie = _get(cfg, "tie_word_embeddings")

    vision = _vision_config(cfg)
    v_layers, v_hidden, v_params = _vision_params(vision) if vision is not None else (None, None, None)
    v_ffn = _as_int(_get(vision, "intermediate_size")) if vision is not None else None
    return ModelInfo(
        name=name, num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
        num_query_groups=groups, kv_channels=kv_channels, vocab_size=_as_int(_get(text, "vocab_size")),
        seq_length=None, num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=moe_ffn,
        moe_shared_expert_size=shared, moe_layer_freq=freq, swiglu=swiglu, disable_bias_linear=disable_bias,
        tie_embeddings=bool(tie) if tie is not None else None, is_vlm=vision is not None,
        vision_num_layers=v_layers, vision_hidden_size=v_hidden, vision_params=v_params,
        vision_ffn_hidden_size=v_ffn)


def from_hf(model: str) -> ModelInfo:
    """Shape from a local directory with config.json, or a hub id already in the HF cache.

    Never touches the network; raises `ModelInfoError` (one line, with the fix) when it cannot.
    """
    return _sizes_checked(info_from_config(_load_config(model), name=model), f"model={model}")


# Sizes that may be 0 (a dense model has 0 experts, no shared experts).
_ZERO_OK = ("num_experts", "moe_shared_expert_size")


def _sizes_checked(info: ModelInfo, source: str) -> ModelInfo:
    """A shape with a size below 1 (a config saying -3 layers) is refused in one line."""
    for f in fields(info):
        value = getattr(info, f.name)
        if isinstance(value, int) and not isinstance(value, bool) and value < (0 if f.name in _ZERO_OK else 1):
            raise ModelInfoError(f"{source}: {f.name}={value} is not a valid size (it must be a positive whole "
                                 f"number); fix the config or give it explicitly ({f.name}=...)")
    return info


# --- all sources together ------------------------------------------------------------------------

def resolve(*, explicit: dict[str, Any] | None, argv: list[str] | None, model: str | None) -> ModelInfo:
    """Explicit values > the command's options > `model=` (AutoConfig, offline).

    A source that cannot be read raises `ModelInfoError`, unless a higher-precedence source already
    gives the number of layers: then the failure is logged and the known fields are used.
    """
    given = {k: v for k, v in (explicit or {}).items() if v is not None}
    unknown = sorted(set(given) - MODEL_FIELDS)
    if unknown:
        raise ModelInfoError(f"unknown model field(s) {unknown}; known: {sorted(MODEL_FIELDS - {'name'})}")
    info = ModelInfo(**given)
    for _source, load in (("the command", (lambda: from_argv(argv)) if argv else None),
                         (f"model={model}", (lambda: from_hf(model)) if model else None)):
        if load is None:
            continue
        try:
            info = info.merged_over(load())
        except ModelInfoError as exc:
            if not info.num_layers:
                raise
            log.warning("%s; continuing with the shape given so far (%s)", exc, info.summary())
    if info.name is None and (model or argv):
        info = replace(info, name=model or "command")
    return _sizes_checked(info, "the model shape")
