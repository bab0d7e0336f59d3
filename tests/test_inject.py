"""Option injection, tested by tables: argv before, options, argv after."""
from __future__ import annotations

import shlex

import pytest

from zenithtune.inject import REMOVE, canonical, describe, find_option, inject, is_swift_command, options_start

MEG = "torchrun --nproc-per-node 8 pretrain_gpt.py"
SIM = "python -m zenithtune.sim"
SWIFT = "megatron sft --model Qwen/Qwen3-8B"


def cmd(text: str) -> list[str]:
    return shlex.split(text)


@pytest.mark.parametrize("before, options, after", [
    # forms are kept
    (f"{MEG} --micro-batch-size 1 --lr 1e-4", {"--micro-batch-size": 4},
     f"{MEG} --micro-batch-size 4 --lr 1e-4"),
    (f"{MEG} --micro-batch-size=1 --lr 1e-4", {"--micro-batch-size": 4},
     f"{MEG} --micro-batch-size=4 --lr 1e-4"),
    # the user's spelling is kept, never a second spelling
    (f"{MEG} --tensor_model_parallel_size 2", {"--tensor-model-parallel-size": 4},
     f"{MEG} --tensor_model_parallel_size 4"),
    (f"{MEG} --tensor_model_parallel_size=2", {"--tensor-model-parallel-size": 4},
     f"{MEG} --tensor_model_parallel_size=4"),
    # duplicates: first position updated, later ones (with values) dropped
    (f"{MEG} --tp-x 1 --lr 1 --tp_x=2 --seed 3 --tp-x 5", {"--tp-x": 8},
     f"{MEG} --tp-x 8 --lr 1 --seed 3"),
    # missing options are appended
    (f"{MEG} --num-layers 4", {"--micro-batch-size": 2}, f"{MEG} --num-layers 4 --micro-batch-size 2"),
    (f"{MEG}", {"--micro-batch-size": 2}, f"{MEG} --micro-batch-size 2"),
    # ... in the spelling the command mostly uses
    (f"{MEG} --num_layers 4 --hidden_size 8 --seq-length 2", {"--micro-batch-size": 2},
     f"{MEG} --num_layers 4 --hidden_size 8 --seq-length 2 --micro_batch_size 2"),
    (f"{SWIFT} --tensor_model_parallel_size 2", {"--micro-batch-size": 2},
     f"{SWIFT} --tensor_model_parallel_size 2 --micro_batch_size 2"),
    ("swift sft --model m", {"--micro-batch-size": 2}, "swift sft --model m --micro_batch_size 2"),
    # removal, with and without a value, every occurrence
    (f"{MEG} --recompute-method uniform --lr 1", {"--recompute-method": None}, f"{MEG} --lr 1"),
    (f"{MEG} --recompute-method=uniform --lr 1", {"--recompute-method": REMOVE}, f"{MEG} --lr 1"),
    (f"{MEG} --sequence-parallel --lr 1", {"--sequence-parallel": None}, f"{MEG} --lr 1"),
    (f"{MEG} --lr 1 --sequence-parallel", {"--sequence-parallel": REMOVE}, f"{MEG} --lr 1"),
    (f"{MEG} --a 1 --lr 1 --a 2", {"--a": None}, f"{MEG} --lr 1"),
    (f"{MEG} --lr 1", {"--recompute-method": None}, f"{MEG} --lr 1"),
    # negative numbers are values, before and after the edited option
    (f"{MEG} --init -1 --mbs 1 --eps -1e-3 --x -0.5", {"--mbs": 2},
     f"{MEG} --init -1 --mbs 2 --eps -1e-3 --x -0.5"),
    (f"{MEG} --init -1 --mbs 1", {"--init": None}, f"{MEG} --mbs 1"),
    (f"{MEG} --mbs 1", {"--offset": -2}, f"{MEG} --mbs 1 --offset -2"),
    # quoted strings with spaces survive untouched, even when they look like options
    (f"{MEG} --note 'a b  c' --mbs 1 --extra '--foo 1 --bar'", {"--mbs": 2},
     f"{MEG} --note 'a b  c' --mbs 2 --extra '--foo 1 --bar'"),
    (f"{MEG} --extra '--mbs 1' --mbs 1", {"--mbs": 2}, f"{MEG} --extra '--mbs 1' --mbs 2"),
    (f"{MEG} --note='x y' --mbs 1", {"--note": None}, f"{MEG} --mbs 1"),
    # nargs options keep all of their values
    (f"{MEG} --data-path 0.5 a 0.5 b --mbs 1", {"--mbs": 2}, f"{MEG} --data-path 0.5 a 0.5 b --mbs 2"),
    (f"{MEG} --data-path 0.5 a 0.5 b --mbs 1", {"--data-path": "c"}, f"{MEG} --data-path c --mbs 1"),
    # Megatron booleans are bare flags
    (f"{MEG} --lr 1", {"--sequence-parallel": True}, f"{MEG} --lr 1 --sequence-parallel"),
    (f"{MEG} --sequence-parallel --lr 1", {"--sequence-parallel": True}, f"{MEG} --sequence-parallel --lr 1"),
    (f"{MEG} --sequence-parallel --lr 1", {"--sequence-parallel": False}, f"{MEG} --lr 1"),
    (f"{MEG} --lr 1", {"--sequence-parallel": False}, f"{MEG} --lr 1"),
    # ms-swift booleans take true/false values
    (f"{SWIFT} --lr 1", {"--sequence-parallel": True}, f"{SWIFT} --lr 1 --sequence_parallel true"),
    (f"{SWIFT} --sequence_parallel true --lr 1", {"--sequence-parallel": False},
     f"{SWIFT} --sequence_parallel false --lr 1"),
    (f"{SWIFT} --sequence_parallel=True", {"--sequence-parallel": False}, f"{SWIFT} --sequence_parallel=False"),
    # an option already written with a true/false value keeps that form, in any command
    (f"{MEG} --use-x true", {"--use-x": False}, f"{MEG} --use-x false"),
    # strings true/false are plain values (--vit-gradient-checkpointing takes one)
    (f"{MEG} --lr 1", {"--vit-gradient-checkpointing": "false"},
     f"{MEG} --lr 1 --vit-gradient-checkpointing false"),
    (f"{MEG} --vit-gradient-checkpointing true", {"--vit-gradient-checkpointing": "false"},
     f"{MEG} --vit-gradient-checkpointing false"),
    # launcher options before the script are never training options
    (f"{MEG} --lr 1", {"--nproc-per-node": 2}, f"{MEG} --lr 1 --nproc-per-node 2"),
    (f"{MEG} --lr 1", {"--nproc-per-node": None}, f"{MEG} --lr 1"),
    ("python -u pretrain_gpt.py --mbs 1", {"--mbs": 2}, "python -u pretrain_gpt.py --mbs 2"),
    # python -m prefix: the module name is not an option value
    (f"{SIM} --num-layers 4", {"--num-layers": 8}, f"{SIM} --num-layers 8"),
    (f"{SIM}", {"--mbs": 8}, f"{SIM} --mbs 8"),
    ("bash pretrain.sh --mbs 1", {"--mbs": 2}, "bash pretrain.sh --mbs 2"),
    # no script marker: everything after argv[0] is options
    ("./train --mbs 1 --x", {"--mbs": 2, "--x": None}, "./train --mbs 2"),
    # a lone -- ends the options: appended options go before it, what follows is untouched
    (f"{MEG} --lr 1 -- --mbs 1", {"--mbs": 2}, f"{MEG} --lr 1 --mbs 2 -- --mbs 1"),
    # several options at once, in the order given
    (f"{MEG} --micro-batch-size 1 --recompute-granularity full --recompute-method uniform",
     {"--micro-batch-size": 2, "--recompute-granularity": "selective", "--recompute-method": None,
      "--recompute-num-layers": None, "--tensor-model-parallel-size": 2},
     f"{MEG} --micro-batch-size 2 --recompute-granularity selective --tensor-model-parallel-size 2"),
])
def test_inject(before: str, options: dict, after: str) -> None:
    argv = cmd(before)
    original = list(argv)
    assert inject(argv, options) == cmd(after)
    assert argv == original, "inject must not modify its input"


@pytest.mark.parametrize("before, options, style, after", [
    (f"{MEG} --lr 1", {"--sp": True}, "value", f"{MEG} --lr 1 --sp true"),
    (f"{MEG} --lr 1", {"--sp": False}, "value", f"{MEG} --lr 1 --sp false"),
    (f"{SWIFT} --sp true", {"--sp": True}, "flag", f"{SWIFT} --sp"),
    (f"{SWIFT} --sp true", {"--sp": False}, "flag", f"{SWIFT}"),
    (f"{MEG} --sp", {"--sp": True}, "value", f"{MEG} --sp true"),
    # auto keeps an existing bare flag even in an ms-swift command
    (f"{SWIFT} --sp", {"--sp": True}, "auto", f"{SWIFT} --sp"),
    (f"{SIM}.swift --num_layers 4", {"--sp": True}, "auto", f"{SIM}.swift --num_layers 4 --sp true"),
])
def test_bool_style(before: str, options: dict, style: str, after: str) -> None:
    assert inject(cmd(before), options, bool_style=style) == cmd(after)


@pytest.mark.parametrize("options, message", [
    ({"micro-batch-size": 2}, "'--micro-batch-size'"),
    ({"-m": 2}, "'--m'"),
    ({"--mbs": [1, 2]}, "--mbs has value [1, 2]"),
    ({"--a-b": 1, "--a_b": 2}, "given twice"),
])
def test_inject_rejects(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        inject(cmd(MEG), options)


def test_bad_bool_style() -> None:
    with pytest.raises(ValueError, match="flag, value, auto"):
        inject(cmd(MEG), {}, bool_style="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("argv, name, value", [
    (f"{MEG} --micro-batch-size 4", "--micro-batch-size", "4"),
    (f"{MEG} --micro_batch_size=4", "--micro-batch-size", "4"),
    (f"{MEG} --micro-batch-size 4", "--micro_batch_size", "4"),
    (f"{MEG} --sequence-parallel --lr 1", "--sequence-parallel", True),
    (f"{MEG} --lr 1", "--sequence-parallel", None),
    (f"{MEG} --init -1", "--init", "-1"),
    (f"{MEG} --note 'a b'", "--note", "a b"),
    (f"{MEG} --data-path 0.5 a", "--data-path", "0.5 a"),
    (f"{MEG} --mbs 1 --mbs 2", "--mbs", "1"),
    (f"{MEG} --lr 1", "--nproc-per-node", None),
    (f"{SWIFT} --sequence_parallel true", "--sequence-parallel", "true"),
])
def test_find_option(argv: str, name: str, value: object) -> None:
    assert find_option(cmd(argv), name) == value


@pytest.mark.parametrize("name, key", [
    ("--tensor_model_parallel_size", "--tensor-model-parallel-size"),
    ("--tensor-model-parallel-size", "--tensor-model-parallel-size"),
    ("--micro_batch-size", "--micro-batch-size"),
    ("--lr=1", "--lr"),
])
def test_canonical(name: str, key: str) -> None:
    assert canonical(name) == key


@pytest.mark.parametrize("argv, start, swift", [
    (MEG, 4, False),
    (SIM, 3, False),
    ("python -m zenithtune.sim.swift", 3, True),
    ("megatron sft --model m", 2, True),
    ("env NPROC_PER_NODE=8 megatron pt --model m", 4, True),
    ("swift sft --model m", 2, True),
    ("torchrun --nproc-per-node 8 /site-packages/swift/cli/_megatron/sft.py --x 1", 4, True),
    ("torchrun --nproc-per-node 8 /opt/swiftly/sft.py --x 1", 4, False),
    ("python pretrain_gpt.py", 2, False),
    ("./train --x 1", 1, False),
    ("", 0, False),
])
def test_options_start(argv: str, start: int, swift: bool) -> None:
    assert options_start(cmd(argv)) == start
    assert is_swift_command(cmd(argv)) is swift


@pytest.mark.parametrize("before, after, lines", [
    (f"{MEG} --micro-batch-size 1", f"{MEG} --micro-batch-size 4", ["--micro-batch-size 1 -> 4"]),
    (f"{MEG}", f"{MEG} --sequence-parallel", ["+ --sequence-parallel"]),
    (f"{MEG}", f"{MEG} --mbs 2", ["+ --mbs 2"]),
    (f"{MEG} --recompute-method uniform", f"{MEG}", ["- --recompute-method uniform"]),
    (f"{MEG} --sp", f"{MEG}", ["- --sp"]),
    (f"{MEG} --sp", f"{MEG} --sp true", ["--sp (flag) -> true"]),
    (f"{MEG} --mbs 1 --mbs 2", f"{MEG} --mbs 1", ["- --mbs 2 (duplicate)"]),
    (f"{MEG} --mbs 1", f"{MEG} --mbs 1", []),
])
def test_describe(before: str, after: str, lines: list[str]) -> None:
    assert describe(cmd(before), cmd(after)) == lines


def test_describe_of_inject() -> None:
    """What a trial log shows for a typical candidate."""
    before = cmd(f"{MEG} --micro-batch-size 1 --recompute-method uniform --lr 1e-4")
    after = inject(before, {"--micro-batch-size": 4, "--sequence-parallel": True, "--recompute-method": None})
    assert describe(before, after) == ["--micro-batch-size 1 -> 4", "+ --sequence-parallel",
                                       "- --recompute-method uniform"]
