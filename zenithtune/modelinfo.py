"""What the tuner knows about the model's shape.

`ModelInfo` is the one description of a model used by the validator, the memory estimate and the
strategies. Every field may be None ("unknown"): a rule that needs an unknown field does not fire.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace


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

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts) and (self.num_experts or 0) > 1

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
