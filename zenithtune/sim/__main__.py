"""`python -m zenithtune.sim [Megatron options]`: the simulated `pretrain_gpt.py`."""
from __future__ import annotations

import sys

from zenithtune.sim.cli import main
from zenithtune.sim.trainer import simulate

if __name__ == "__main__":
    sys.exit(main(simulate, sys.argv[1:]))
