"""Run an unmodified Megatron-LM training script on CPU (torch CPU build, gloo).

Usage (one process per rank, as torchrun starts them)::

    torchrun --standalone --nproc-per-node 2 tests/megatron/cpu_launch.py \
        tests/megatron/upstream/pretrain_gpt.py --distributed-backend gloo --transformer-impl local ...

Megatron-LM assumes a CUDA device in a handful of places even when the model is tiny and the
process group is gloo. This module changes exactly those, in this process only, and then runs the
script as ``__main__`` (``runpy``), so Megatron's own files stay byte-for-byte as released.

What it changes (and nothing else):
- ``torch.cuda.is_available`` answers True (``initialize_megatron`` asserts it), ``device_count``
  1, ``current_device`` the CPU device, ``set_device`` nothing.
- A torch-function mode turns every ``device="cuda"`` / ``torch.device("cuda")`` argument of a
  torch call into the CPU (Megatron writes ``device="cuda"`` literally in about a hundred places).
- ``Tensor.cuda`` / ``Module.cuda`` return the object unchanged.
- ``Tensor.type()`` without arguments names a CPU tensor's CUDA counterpart
  (``torch.cuda.FloatTensor``): the optimizers assert on those names. Conversions are untouched.
- The tensor-parallel RNG tracker's calls (``torch.cuda.get_rng_state``/``set_rng_state``/
  ``manual_seed``/``default_generators``, lazily queued calls) use the CPU generator. Megatron then
  logs "CPU RNG state changed within GPU RNG context": the two are one generator here.
- ``synchronize``, ``empty_cache``, ``reset_peak_memory_stats`` do nothing; the memory counters
  report 0, so Megatron's memory line prints zeros. ``Event`` records the wall clock, ``Stream`` is
  a no-op; ``get_device_capability``/``name``/``properties`` describe a pretend device.
- ``TORCHDYNAMO_DISABLE=1`` (unless set): Megatron's ``torch.compile``'d fusions run eagerly.
- ``typing.override`` is backported from ``typing_extensions`` (megatron-core 0.19 targets
  Python 3.12; the CPU torch wheel here is for 3.11).
The launcher selects nothing else: the command passes Megatron's own switches for its CPU-capable
paths (``--transformer-impl local --distributed-backend gloo --use-cpu-initialization`` and the
``--no-*-fusion`` options; see tests/megatron/test_megatron_cpu.py and docs/megatron.md).
"""
from __future__ import annotations

import contextlib
import os
import runpy
import sys
import time
import typing
from collections import namedtuple
from pathlib import Path

# torch.compile (Megatron's jit_fuser) would try to trace through the stand-ins below; on CPU the
# fused functions run eagerly instead. Set before torch is imported, where dynamo reads it.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


class _Event:
    """A CUDA event stand-in: records the wall clock so elapsed_time still means something."""

    def __init__(self, enable_timing: bool = False, **_: object) -> None:
        self._t = 0.0

    def record(self, stream: object = None) -> None:
        self._t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _Event) -> float:
        return (end._t - self._t) * 1000.0


class _Stream:
    """A CUDA stream stand-in: CPU work is already ordered, so waiting is a no-op."""

    def __init__(self, *_: object, **__: object) -> None:
        pass

    def wait_stream(self, other: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: _Event | None = None) -> _Event:
        event = event or _Event()
        event.record()
        return event


class _AnyIndex:
    """torch.cuda.default_generators for a process with one (CPU) generator, whatever the index."""

    def __init__(self, generator: torch.Generator) -> None:
        self._generator = generator

    def __getitem__(self, index: object) -> torch.Generator:
        return self._generator

    def __len__(self) -> int:
        return 1


_Props = namedtuple("_Props", "name major minor total_memory multi_processor_count")


def _patch_cuda() -> None:
    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.device_count = lambda: 1
    cuda.current_device = lambda: _CPU
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.reset_peak_memory_stats = lambda device=None: None
    for counter in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                    "max_memory_reserved"):
        setattr(cuda, counter, lambda device=None: 0)
    cuda.memory_stats = lambda device=None: {}
    cuda.Event = _Event
    cuda.Stream = _Stream
    cuda.current_stream = lambda device=None: _Stream()
    cuda.default_stream = lambda device=None: _Stream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.get_device_capability = lambda device=None: (8, 0)
    cuda.get_device_name = lambda device=None: "cpu"
    cuda.get_device_properties = lambda device=None: _Props("cpu", 8, 0, 0, 1)
    # One RNG: Megatron's tensor-parallel RNG tracker saves/restores "the CUDA generator"; here
    # that is the CPU default generator, and lazily queued calls run at once.
    cpu_rng = torch.default_generator
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    cuda.manual_seed = lambda seed: cpu_rng.manual_seed(seed)
    cuda.manual_seed_all = cuda.manual_seed
    cuda.default_generators = _AnyIndex(cpu_rng)
    cuda._lazy_call = lambda callable, **kwargs: callable()
    cuda._lazy_init = lambda: None
    # Megatron's optimizers check parameter kinds by name ('torch.cuda.FloatTensor'); the no-argument
    # form of Tensor.type() names a CPU tensor as its CUDA counterpart (conversions are untouched).
    cpu_type = torch.Tensor.type

    def _type(self: torch.Tensor, dtype: object = None, non_blocking: bool = False, **kwargs: object):
        if dtype is None and not kwargs:
            name = cpu_type(self)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return cpu_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = _type
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self


def _on_cpu(value: object) -> object:
    if isinstance(value, torch.device) and value.type == "cuda":
        return _CPU
    if isinstance(value, str) and value.split(":")[0] == "cuda":
        return _CPU
    return value


class _CudaDeviceToCpu(TorchFunctionMode):
    """Every ``device="cuda"`` / ``torch.device("cuda")`` argument of a torch call becomes the CPU.

    Megatron writes ``device="cuda"`` literally in about a hundred places (JIT warm-up, batch
    broadcast, loss reduction); a torch-function mode sees them all without touching its files.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        args = tuple(_on_cpu(a) for a in args)
        return func(*args, **kwargs)


def _backport_python312() -> None:
    # megatron-core >= 0.17 is published for Python >= 3.12 only, and torch's CPU wheel here is
    # cp311; the one 3.12 name Megatron's training code imports is typing.override.
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: cpu_launch.py SCRIPT [ARGS...]   (the Megatron script and its options)")
    script = Path(argv[0]).resolve()
    if not script.is_file():
        sys.exit(f"cpu_launch.py: script {argv[0]!r} not found; pass the path to pretrain_gpt.py")
    _backport_python312()
    _patch_cuda()
    # The script imports its siblings (gpt_builders, model_provider) as top-level modules.
    sys.path.insert(0, str(script.parent))
    sys.argv = [str(script), *argv[1:]]
    with _CudaDeviceToCpu():
        runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
