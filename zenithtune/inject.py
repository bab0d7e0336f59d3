"""Option injection: put a candidate's options into the user's own training command.

The tuner never rebuilds the command; it edits the argv the user wrote, so everything it does not
tune (data paths, model flags, launcher options) reaches the trainer exactly as typed. The edit
follows the spelling conventions of the two trainers we wrap:

* Megatron-LM (``pretrain_gpt.py``): dashed names, booleans are bare flags (``--sequence-parallel``).
* ms-swift (``megatron sft|pt|rlhf``, ``swift sft``): underscored names, booleans take a value
  (``--sequence_parallel true``); dashed aliases also parse.

``--tensor-model-parallel-size`` and ``--tensor_model_parallel_size`` are the same option (argparse
maps both to one dest), so a second spelling would be a duplicate the trainer either rejects or
silently resolves last-wins. Only tokens after the training script are options: a launcher's own
options (``torchrun --nproc-per-node 8``) are never touched (`zenithtune.command` reads the argv).
"""
from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Literal

from zenithtune.command import Occurrence, canonical, find_option, is_swift_command, option_region, options_start, scan

__all__ = ["REMOVE", "OptValue", "BoolStyle", "inject", "find_option", "canonical", "describe",
           "options_start", "is_swift_command"]


class _Remove(Enum):
    """Sentinel type, so `REMOVE` has a type of its own and prints readably."""

    REMOVE = "REMOVE"

    def __repr__(self) -> str:
        return "REMOVE"


REMOVE = _Remove.REMOVE
"""Map an option to this (or None) to delete it, with its value, from the command."""

OptValue = str | int | float | bool | tuple[str, ...] | None | _Remove
BoolStyle = Literal["flag", "value", "auto"]


def _spell(key: str, underscore: bool) -> str:
    return "--" + key[2:].replace("-", "_") if underscore else key


def _prefers_underscore(found: list[Occurrence], swift: bool) -> bool:
    """The spelling most of the user's multi-word options use; ties go to the trainer's convention."""
    under = sum(1 for o in found if "_" in o.name[2:] and "-" not in o.name[2:])
    dash = sum(1 for o in found if "-" in o.name[2:] and "_" not in o.name[2:])
    return under > dash if under != dash else swift


def _check(options: Mapping[str, OptValue]) -> None:
    for key, value in options.items():
        if not isinstance(key, str) or not key.startswith("--") or len(key) < 3:
            fix = "--" + str(key).lstrip("-")
            raise ValueError(f"option name {key!r} must be written with two dashes: use {fix!r}")
        if isinstance(value, tuple) and value and all(isinstance(v, str) for v in value):
            continue  # several values (an nargs option: --recompute-modules layernorm mlp)
        if value is not None and value is not REMOVE and not isinstance(value, (str, int, float)):
            raise ValueError(f"option {key} has value {value!r} of type {type(value).__name__}; "
                             f"use a str, int, float, bool, a tuple of str, or None/REMOVE to remove it")
    seen: dict[str, str] = {}
    for key in options:
        if canonical(key) in seen:
            raise ValueError(f"option {canonical(key)} is given twice (as {seen[canonical(key)]!r} and "
                             f"{key!r}); keep one spelling")
        seen[canonical(key)] = key


def _bool_word(value: bool, like: str | None) -> str:
    """true/false in the capitalisation the user already uses for this option."""
    word = "true" if value else "false"
    return word.capitalize() if like and like[0].isupper() else word


def inject(argv: list[str], options: Mapping[str, OptValue], *,
           bool_style: BoolStyle = "auto") -> list[str]:
    """Return a copy of ``argv`` with ``options`` set.

    ``options`` maps dashed names to values: str/int/float → ``--k v``; a tuple of str → ``--k v1 v2``
    (an ``nargs`` option, never in the ``--k=v`` form); True → flag present (or
    ``--k true``); None/REMOVE → option and its value removed; False → removed for flags, ``--k false``
    where booleans take values. An option already present is updated in place, keeping its form
    (``--k v``/``--k=v``) and spelling; later duplicates are dropped. A missing one is appended in the
    spelling most of the command's options use.

    ``bool_style``: ``flag`` (Megatron), ``value`` (ms-swift), or ``auto`` — the form the option
    already has, else ``value`` for ms-swift commands and ``flag`` otherwise.
    """
    if bool_style not in ("flag", "value", "auto"):
        raise ValueError(f"bool_style {bool_style!r} is not one of flag, value, auto")
    _check(options)
    found = scan(argv)
    swift = is_swift_command(argv)
    underscore = _prefers_underscore(found, swift)
    _, end = option_region(argv)

    replace: dict[int, list[str]] = {}  # occurrence start -> new tokens
    drop: set[int] = set()  # occurrence starts to delete
    spans = {o.start: o for o in found}
    appended: list[str] = []
    for key, value in options.items():
        key = canonical(key)
        mine = [o for o in found if o.key == key]
        first = mine[0] if mine else None
        drop.update(o.start for o in mine[1:])
        if value is None or value is REMOVE:
            if first:
                drop.add(first.start)
            continue
        name = first.name if first else _spell(key, underscore)
        inline = first.inline if first else False
        if isinstance(value, bool):
            style = bool_style
            if style == "auto":
                if first and (first.bool_value or not first.values):
                    style = "value" if first.bool_value else "flag"
                else:
                    style = "value" if swift else "flag"
            if style == "flag":
                if not value:
                    if first:
                        drop.add(first.start)
                    continue
                tokens = [name]
            else:
                word = _bool_word(value, first.bool_value if first else None)
                tokens = [f"{name}={word}"] if inline else [name, word]
        elif isinstance(value, tuple):
            tokens = [name, *value]
        else:
            text = str(value)
            tokens = [f"{name}={text}"] if inline else [name, text]
        if first:
            replace[first.start] = tokens
        else:
            appended += tokens

    out: list[str] = []
    i = 0
    while i < len(argv):
        if i in spans and (i in drop or i in replace):
            occ = spans[i]
            if i not in drop:
                out += replace[i]
            i = occ.end
            continue
        if i == end:
            out += appended
            appended = []
        out.append(argv[i])
        i += 1
    return out + appended


def describe(argv_before: list[str], argv_after: list[str]) -> list[str]:
    """Human-readable option changes for the trial log: ``--micro-batch-size 1 -> 4``,
    ``+ --sequence-parallel``, ``- --recompute-method uniform``."""
    def table(argv: list[str]) -> dict[str, list[Occurrence]]:
        t: dict[str, list[Occurrence]] = {}
        for occ in scan(argv):
            t.setdefault(occ.key, []).append(occ)
        return t

    def show(occ: Occurrence) -> str:
        text = occ.rendered()
        return occ.name if text is None else f"{occ.name} {text}"

    before, after = table(argv_before), table(argv_after)
    lines: list[str] = []
    for key, occs in after.items():
        new = occs[0]
        if key not in before:
            lines.append(f"+ {show(new)}")
            continue
        old = before[key][0]
        if old.rendered() != new.rendered():
            lines.append(f"{new.name} {old.rendered() or '(flag)'} -> {new.rendered() or '(flag)'}")
        lines += [f"- {show(o)} (duplicate)" for o in before[key][len(occs):]]
    for key, occs in before.items():
        if key not in after:
            lines += [f"- {show(o)}" for o in occs]
    return lines
