"""What ``mpitrain-run`` starts on every rank: ``python run_rank.py COMMAND [ARGS...]``.

It sets torchrun's per-rank variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``) from the ones the MPI gives each rank, then replaces itself with
``COMMAND`` (``os.execvp``: the same process, the same pid), so that code written for
``torchrun`` finds them in ``os.environ`` from its first line. ``MASTER_ADDR`` and
``MASTER_PORT`` are the same on every rank and come from the launcher.

It imports only the standard library, never MPI (a rank must not initialise MPI before
its command does), and runs as a file (``python -I .../run_rank.py``) so that it needs no
``mpitrain`` on the rank's ``sys.path``; ``python -m mpitrain.run_rank`` works too.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping

TORCH_VARIABLES: dict[str, tuple[str, ...]] = {
    "RANK": ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"),
    "WORLD_SIZE": ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"),
    "LOCAL_RANK": ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"),
    "LOCAL_WORLD_SIZE": ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"),
}
"""Each torchrun variable, taken from the first of these that is set: Open MPI's, then
MPICH's (Hydra, PMI-1), then PMIx's."""


def torch_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """torchrun's per-rank variables for a rank whose environment is ``environ``.

    A variable that no MPI variable gives is left out (the rank then keeps whatever it
    had, usually nothing).
    """
    found = {}
    for name, sources in TORCH_VARIABLES.items():
        for source in sources:
            if environ.get(source):
                found[name] = environ[source]
                break
    return found


def main(argv: list[str] | None = None) -> int:
    """Set torchrun's variables and run the command in this process.

    Returns only if the command cannot be started: 127 if it is not found, 126 if it
    cannot be executed, 2 if there is none.
    """
    command = sys.argv[1:] if argv is None else argv
    if not command:
        print("usage: python -m mpitrain.run_rank COMMAND [ARGS...] (started by mpitrain-run "
              "on every rank)", file=sys.stderr)
        return 2
    os.environ.update(torch_variables(os.environ))
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"mpitrain-run: rank {os.environ.get('RANK', '?')} cannot run {command[0]!r}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126


if __name__ == "__main__":
    sys.exit(main())
