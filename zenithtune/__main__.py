"""`python -m zenithtune [hydra overrides] [-- command ...]`, or `python -m zenithtune optimize|apply|analyze ...`
(the original CLI, zenithtune.cli).

Everything after the first lone `--` is the wrapped training command, kept as an argv list and
handed to the config through the environment (see zenithtune.resolvers); the rest goes to Hydra.
"""
from __future__ import annotations

import sys

from zenithtune.overrides import SUBCOMMANDS


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        from zenithtune.cli import main as cli_main

        return cli_main(argv)
    from zenithtune.hydra_main import main as hydra_entry

    return hydra_entry(argv)


if __name__ == "__main__":
    sys.exit(main())
