"""Model shape from HF configs (offline), from the wrapped command, and their precedence."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from zenithtune.modelinfo import ModelInfo, ModelInfoError, from_argv, from_hf, resolve

MODELS = Path(__file__).parent / "fixtures" / "models"


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    # An empty cache and no network: everything must resolve from local files.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


# --- from_hf: each fixture --------------------------------------------------------------------------

@pytest.mark.parametrize("name, layers, hidden, heads, groups, experts, topk, is_vlm", [
    ("Meta-Llama-3-8B", 32, 4096, 32, 8, 0, None, False),
    ("Meta-Llama-3-70B", 80, 8192, 64, 8, 0, None, False),
    ("Qwen3-30B-A3B", 48, 2048, 32, 4, 128, 8, False),
    ("Mixtral-8x7B-v0.1", 32, 4096, 32, 8, 8, 2, False),
    ("Qwen2.5-VL-7B-Instruct", 28, 3584, 28, 4, 0, None, True),
])
def test_fixture_shapes(name, layers, hidden, heads, groups, experts, topk, is_vlm):
    info = from_hf(str(MODELS / name))
    assert (info.num_layers, info.hidden_size, info.num_attention_heads, info.num_query_groups) == (
        layers, hidden, heads, groups)
    assert (info.num_experts, info.moe_router_topk, info.is_vlm) == (experts, topk, is_vlm)
    assert info.is_moe == (experts > 1)
    assert info.seq_length is None  # max_position_embeddings is not the training length
    assert info.swiglu is True and info.tie_embeddings is False


def test_moe_and_head_dim_details():
    qwen = from_hf(str(MODELS / "Qwen3-30B-A3B"))
    assert qwen.kv_channels == 128 and qwen.head_dim == 128  # head_dim != 2048/32
    assert qwen.moe_ffn_hidden_size == 768 and qwen.moe_shared_expert_size == 0
    mixtral = from_hf(str(MODELS / "Mixtral-8x7B-v0.1"))
    assert mixtral.moe_ffn_hidden_size == 14336  # Mixtral's experts use intermediate_size
    assert mixtral.kv_channels is None and mixtral.head_dim == 128
    vlm = from_hf(str(MODELS / "Qwen2.5-VL-7B-Instruct"))
    assert (vlm.vision_num_layers, vlm.vision_hidden_size) == (32, 1280)
    assert 5e8 < vlm.vision_params < 8e8  # published: ~670M


def test_shared_experts_from_deepseek_style_config(tmp_path):
    cfg = {"model_type": "not_a_transformers_model", "num_hidden_layers": 27, "hidden_size": 2048,
           "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 10944,
           "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2,
           "num_experts_per_tok": 6, "hidden_act": "silu", "vocab_size": 102400}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    info = from_hf(str(tmp_path))  # AutoConfig cannot parse it: read as plain JSON
    assert (info.num_experts, info.moe_router_topk, info.moe_shared_expert_size) == (64, 6, 2 * 1408)


def test_summary_is_one_line():
    assert from_hf(str(MODELS / "Qwen3-30B-A3B")).summary() == (
        "Qwen3-30B-A3B: 48 layers, h=2048, 32 heads / 4 groups, 128 experts top-8")
    info = ModelInfo(name="Qwen/Qwen3-30B-A3B", num_layers=48, hidden_size=2048, num_attention_heads=32,
                     num_query_groups=4, num_experts=128, moe_router_topk=8, seq_length=4096)
    assert info.summary() == "Qwen3-30B-A3B: 48 layers, h=2048, 32 heads / 4 groups, 128 experts top-8, s=4096"
    assert ModelInfo().summary() == "model: shape unknown"


def test_unknown_hub_id_fails_offline_in_one_line():
    with pytest.raises(ModelInfoError) as err:
        from_hf("acme/NoSuchModel-7B")
    msg = str(err.value)
    assert isinstance(err.value, ValueError)
    assert "\n" not in msg and "Traceback" not in msg
    assert "acme/NoSuchModel-7B" in msg and "offline" in msg
    assert "hf download acme/NoSuchModel-7B config.json" in msg
    assert "num_layers=" in msg and "num_query_groups=" in msg


# --- from_argv ----------------------------------------------------------------------------------------

MEGATRON = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
            "--group-query-attention --num-query-groups 8 --seq-length 8192 --vocab-size 128256 "
            "--swiglu --disable-bias-linear --untie-embeddings-and-output-weights").split()


@pytest.mark.parametrize("prefix", [
    ["python", "pretrain_gpt.py"],
    ["torchrun", "--nnodes", "2", "--nproc-per-node", "8", "pretrain_gpt.py"],
    ["python", "-m", "torch.distributed.run", "--nnodes", "2", "/src/Megatron-LM/pretrain_gpt.py"],
    ["torchrun", "--nproc_per_node=8", "-m", "zenithtune.sim"],
])
def test_from_argv_reads_megatron_options_after_the_script(prefix):
    info = from_argv(prefix + MEGATRON)
    assert (info.num_layers, info.hidden_size, info.ffn_hidden_size) == (32, 4096, 14336)
    assert (info.num_attention_heads, info.num_query_groups, info.seq_length) == (32, 8, 8192)
    assert info.swiglu and info.disable_bias_linear and info.tie_embeddings is False
    assert info.num_experts == 0 and not info.is_vlm


def test_launcher_options_are_never_read():
    # `--num-layers` before the script belongs to the launcher (pretend one had such an option)
    info = from_argv(["launcher", "--num-layers", "2", "train.py", "--hidden-size", "1024", "--num-layers", "24"])
    assert info.num_layers == 24
    assert from_argv(["torchrun", "--nnodes", "2", "train.py"]).num_layers is None


def test_equals_and_underscore_spellings():
    info = from_argv(["python", "pretrain_gpt.py", "--num_layers=48", "--hidden_size", "2048",
                      "--num-attention-heads=32", "--group_query_attention", "--num_query_groups=4",
                      "--num_experts", "128", "--moe_router_topk=8", "--moe-ffn-hidden-size", "768",
                      "--moe_shared_expert_intermediate_size", "1024", "--kv_channels=128"])
    assert (info.num_layers, info.hidden_size, info.num_query_groups) == (48, 2048, 4)
    assert (info.num_experts, info.moe_router_topk, info.moe_ffn_hidden_size) == (128, 8, 768)
    assert (info.moe_shared_expert_size, info.kv_channels) == (1024, 128)


def test_megatron_defaults_when_the_command_states_a_shape():
    info = from_argv(["python", "pretrain_gpt.py", "--num-layers", "24", "--hidden-size", "2048",
                      "--num-attention-heads", "16", "--num-query-groups", "4"])
    assert info.num_query_groups == 16  # ignored without --group-query-attention
    assert info.swiglu is False and info.ffn_hidden_size == 8192 and info.tie_embeddings is True
    assert info.disable_bias_linear is False and info.num_experts == 0


def test_vlm_markers():
    assert from_argv(["python", "-m", "zenithtune.sim", "--num-layers", "28", "--vit-gradient-checkpointing"]).is_vlm
    assert from_argv(["megatron", "sft", "--vit_gradient_checkpointing", "true"]).is_vlm
    assert not from_argv(["python", "pretrain_gpt.py", "--num-layers", "28"]).is_vlm
    sim = from_argv(["python", "-m", "zenithtune.sim", "--num-layers", "28", "--vision-num-layers", "32",
                     "--vision-hidden-size=1280", "--vision-ffn-hidden-size", "5120", "--vision-seq-length", "1024"])
    assert sim.is_vlm and (sim.vision_num_layers, sim.vision_hidden_size) == (32, 1280)
    assert (sim.vision_ffn_hidden_size, sim.vision_seq_length) == (5120, 1024)


def test_swift_model_option_loads_the_config_under_the_command():
    argv = ["megatron", "sft", "--model", str(MODELS / "Qwen3-30B-A3B"), "--max_length", "8192",
            "--tensor_model_parallel_size", "2"]
    info = from_argv(argv)
    assert (info.num_layers, info.num_experts, info.seq_length) == (48, 128, 8192)
    assert info.name.endswith("Qwen3-30B-A3B")
    # the command's own options win over the loaded config
    assert from_argv(argv + ["--num_layers", "24"]).num_layers == 24
    assert from_argv(["swift", "sft", "--model", str(MODELS / "Qwen2.5-VL-7B-Instruct")]).is_vlm


# --- resolve: precedence --------------------------------------------------------------------------------

def test_precedence_explicit_over_command_over_model():
    argv = ["python", "pretrain_gpt.py", "--num-layers", "40", "--seq-length", "4096"]
    info = resolve(explicit={"num_layers": 12, "num_query_groups": None}, argv=argv,
                   model=str(MODELS / "Meta-Llama-3-8B"))
    assert info.num_layers == 12  # explicit
    assert info.seq_length == 4096  # the command
    assert info.num_query_groups == 8 and info.vocab_size == 128256  # model=
    info = resolve(explicit={}, argv=argv, model=str(MODELS / "Meta-Llama-3-8B"))
    assert info.num_layers == 40


def test_resolve_each_source_alone():
    assert resolve(explicit={"num_layers": 7}, argv=None, model=None).num_layers == 7
    assert resolve(explicit={}, argv=["x.py", "--num-layers", "9"], model=None).num_layers == 9
    assert resolve(explicit={}, argv=None, model=str(MODELS / "Mixtral-8x7B-v0.1")).num_experts == 8
    assert resolve(explicit=None, argv=None, model=None) == ModelInfo()


def test_resolve_unreadable_model(caplog):
    with pytest.raises(ModelInfoError, match="acme/Gone"):
        resolve(explicit={}, argv=None, model="acme/Gone")
    with caplog.at_level(logging.WARNING):  # the user gave the shape: go on, and say so
        info = resolve(explicit={"num_layers": 48, "num_query_groups": 4}, argv=None, model="acme/Gone")
    assert (info.num_layers, info.num_query_groups) == (48, 4)
    assert "acme/Gone" in caplog.text
    with pytest.raises(ModelInfoError, match="unknown model field"):
        resolve(explicit={"num_layer": 48}, argv=None, model=None)


@pytest.mark.parametrize("info, ffn", [
    (ModelInfo(hidden_size=4096, swiglu=True), 10880),  # int(4*4096*2/3/64)*64, Megatron's --swiglu default
    (ModelInfo(hidden_size=4096, swiglu=False), 16384),
    (ModelInfo(hidden_size=4096), 16384),
    (ModelInfo(hidden_size=4096, ffn_hidden_size=14336, swiglu=True), 14336),
    (ModelInfo(), None),
])
def test_ffn_is_the_stated_width_or_megatrons_default(info, ffn):
    assert info.ffn == ffn
