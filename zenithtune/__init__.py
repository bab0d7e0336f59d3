"""zenithtune: a Hydra-native auto-tuner for Megatron-LM and ms-swift distributed training."""
from __future__ import annotations

__version__ = "0.1.0"
