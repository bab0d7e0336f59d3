"""Learning from a refusal: the injected options a trainer rejected, so one refused feature costs
one launch, not one per candidate that carries it.

Megatron (and ms-swift) refuse some settings only at run time, with a message naming the feature:
  pretrain_gpt.py: error: unrecognized arguments: --expert-tensor-parallel-size 2
  AssertionError: sequence parallel not supported by torch LayerNorm when instantiating TransformerLayer
`refused(message, options)` finds which of the options zenithtune injected for that trial the message
names, and returns them as a `Trait`; every later candidate whose injected options include the same
values is pruned before launch with the trial's message. A message that names none of the injected
options (an NCCL error, a data-loader crash) teaches nothing and returns None.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Words by which a failure says a setting is refused rather than that something broke on the way.
_REFUSAL = re.compile(r"not supported|unsupported|not implemented|notimplementederror|assertionerror|"
                      r"requires|must be|must not|cannot be used|is not compatible|incompatible|"
                      r"unrecognized arguments|invalid choice|not allowed", re.IGNORECASE)
_NUMBER = re.compile(r"-?[0-9]+(\.[0-9]*)?")
_UNRECOGNIZED = re.compile(r"unrecognized arguments?:\s*(.*)", re.IGNORECASE)
_GENERIC_WORDS = {"size", "num", "model", "the"}
ANY = "*"  # an option refused whatever its value (an unrecognized argument)


@dataclass(frozen=True)
class Trait:
    """Injected option values a trainer refused in one trial."""

    options: tuple[tuple[str, str], ...]  # (option, value as injected; ANY: whatever value) pairs
    trial: int | None  # the trial that showed it
    message: str  # the trainer's own words

    def matches(self, options: Mapping[str, Any]) -> bool:
        """Whether a candidate's injected options carry every refused value (so it would fail alike)."""
        return all(_as_text(options.get(opt)) == value or (value == ANY and _as_text(options.get(opt)) is not None)
                   for opt, value in self.options)

    def describe(self) -> str:
        what = " ".join(opt if value in ("true", ANY) else f"{opt} {value}" for opt, value in self.options)
        where = f"trial {self.trial}" if self.trial is not None else "an earlier trial"
        return f"the trainer refused {what} in {where}: {self.message}"


def _as_text(value: Any) -> str | None:
    """An injected value as compared: None and False mean the option is absent."""
    if value is None or value is False or value == "false":
        return None
    if isinstance(value, tuple):  # several values (--recompute-modules layernorm mlp)
        return " ".join(value)
    return "true" if value is True else str(value)


def _phrases(option: str) -> list[str]:
    """How a message may name an option: `--sequence-parallel` -> 'sequence parallel', 'sequence_parallel',
    'sequence-parallel'; `--tensor-model-parallel-size` also as 'tensor model parallel'."""
    words = option.lstrip("-").replace("_", "-").split("-")
    out = {" ".join(words), "_".join(words), "-".join(words)}
    core = [w for w in words if w not in _GENERIC_WORDS]
    if len(core) >= 2:
        out.add(" ".join(core))
    return sorted(out, key=len, reverse=True)


def refused(message: str, options: Mapping[str, Any], trial: int | None = None) -> Trait | None:
    """The injected option values `message` says the trainer refused, or None when it names none."""
    if not message or not _REFUSAL.search(message):
        return None
    present: dict[str, str] = {opt: t for opt, v in options.items() if (t := _as_text(v)) is not None}
    unknown = _UNRECOGNIZED.search(message)
    if unknown:
        named = {tok.split("=")[0] for tok in unknown.group(1).split() if tok.startswith("--")}
        pairs = [(opt, ANY) for opt in present if opt in named or opt.replace("-", "_") in named
                 or opt.replace("_", "-") in named]
    else:
        # Sizes (TP, MBS, ...) are layout arithmetic, which the validator owns; a refusal teaches only
        # features: flags and named choices (sequence parallel, a recompute method, ...).
        text = message.lower()
        pairs = [(opt, value) for opt, value in present.items()
                 if not _NUMBER.fullmatch(value) and any(p in text for p in _phrases(opt.lower()))]
    if not pairs:
        return None
    return Trait(tuple(sorted(pairs)), trial, message)
