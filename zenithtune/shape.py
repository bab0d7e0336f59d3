"""The model's dimensions as the tuner's own estimates read them, every unknown resolved once.

`ModelInfo` says what is known about the model (None: unknown). The memory estimate (`memory.py`) and
the throughput prior (`strategies/_throughput.py`) need numbers: `Shape.of(model)` fills the gaps
with the same guesses for both (SwiGLU, seq_length 4096, vocab 131072, top-2 routing, a 32-layer
1280-wide vision tower) and takes the FFN width and head size from `ModelInfo.ffn` / `head_dim`, so
Megatron's defaults are written in one place. The simulator keeps its own shape on purpose (it is
the "truth" the tuner must not read).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from zenithtune.modelinfo import ModelInfo

ASSUMED_SEQ = 4096  # when the command does not say --seq-length
ASSUMED_VOCAB = 131072  # when the vocab comes from a tokenizer we cannot see
ASSUMED_TOPK = 2  # a MoE model's router top-k when not given
ASSUMED_VISION_LAYERS = 32  # a VLM's vision tower when its config says nothing (Qwen2-VL's ViT)
ASSUMED_VISION_HIDDEN = 1280
# Only for an ordering that must exist even without a shape (the throughput prior): a Llama-8B-like body.
ASSUMED_LAYERS = 32
ASSUMED_HIDDEN = 4096


@dataclass(frozen=True)
class Shape:
    """Every dimension a per-GPU estimate needs, as numbers (single letters as in MEGATRON.md)."""

    L: int  # layers
    h: int  # hidden size
    a: int  # attention heads
    g: int  # query groups (== a without GQA)
    d: int  # head dim
    F: int  # dense ffn width
    V: int  # vocab before padding
    s: int  # sequence length
    E: int  # experts (0 = dense)
    k: int  # router top-k (0 = dense)
    Fm: int  # expert ffn width
    Fs: int  # shared-expert ffn width (total)
    n_moe: int  # MoE layers
    glu: bool  # SwiGLU (three MLP matrices instead of two)
    tied: bool  # input embedding and output layer share their weights
    vision_layers: int = 0  # a VLM's vision tower (0: not a VLM)
    vision_hidden: int = 0
    vision_ffn: int = 0
    vision_tokens: int = 0  # patches per sample the tower encodes

    @property
    def mlp_mats(self) -> int:
        """Weight matrices of one MLP: 3 with SwiGLU (gate, up, down), else 2."""
        return 3 if self.glu else 2

    @classmethod
    def of(cls, m: ModelInfo) -> Shape | None:
        """The model's shape with the guesses above; None when its layers or hidden size are unknown."""
        if not m.num_layers or not m.hidden_size:
            return None
        h = m.hidden_size
        a = m.num_attention_heads or max(1, h // 128)
        glu = m.swiglu is not False  # unknown: SwiGLU, like today's models (and the larger estimate)
        full = replace(m, num_attention_heads=a, swiglu=glu)
        F = full.ffn or 4 * h  # (always set: the hidden size is known)
        E = (m.num_experts or 0) if m.is_moe else 0
        freq = m.moe_layer_freq or 1
        s = m.seq_length or ASSUMED_SEQ
        vh = (m.vision_hidden_size or ASSUMED_VISION_HIDDEN) if m.is_vlm else 0
        return cls(L=m.num_layers, h=h, a=a, g=m.num_query_groups or a, d=full.head_dim or h // a, F=F,
                   V=m.vocab_size or ASSUMED_VOCAB, s=s, E=E, k=(m.moe_router_topk or ASSUMED_TOPK) if E else 0,
                   Fm=(m.moe_ffn_hidden_size or F) if E else 0, Fs=(m.moe_shared_expert_size or 0) if E else 0,
                   n_moe=-(-m.num_layers // freq) if E else 0, glu=glu, tied=m.tie_embeddings is not False,
                   vision_layers=(m.vision_num_layers or ASSUMED_VISION_LAYERS) if m.is_vlm else 0,
                   vision_hidden=vh, vision_ffn=(m.vision_ffn_hidden_size or 4 * vh) if m.is_vlm else 0,
                   vision_tokens=(m.vision_seq_length or s) if m.is_vlm else 0)

    @classmethod
    def assumed(cls, m: ModelInfo) -> Shape:
        """`of`, with a Llama-8B-like body where even the layers or hidden size are unknown."""
        shape = cls.of(replace(m, num_layers=m.num_layers or ASSUMED_LAYERS, hidden_size=m.hidden_size or ASSUMED_HIDDEN))
        assert shape is not None  # both are set
        return shape
