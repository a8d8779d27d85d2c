"""What a rank started by ``mpitrain-run`` finds of torchrun's variables.

Usage: torch_env.py [--torch]   (or ``python -m torch_env`` with this folder on the path)

Prints ``env <json>``: the variables as they were when this module was imported. With
``--torch`` it then joins ``torch.distributed`` the way torchrun scripts do
(``init_process_group("gloo")``, which reads them) and prints ``torch RANK SIZE SUM``,
SUM being the all-reduced sum of the ranks.
"""

from __future__ import annotations

import json
import os
import sys

VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT")
AT_IMPORT = {name: os.environ.get(name) for name in VARIABLES}


def main() -> None:
    print("env", json.dumps(AT_IMPORT), flush=True)
    if "--torch" in sys.argv:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        total = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(total)
        print("torch", dist.get_rank(), dist.get_world_size(), int(total.item()), flush=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
