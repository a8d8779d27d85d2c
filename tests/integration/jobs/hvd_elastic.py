"""A Horovod elastic script (hvd.elastic.run, TorchState, ElasticSampler) with a rank
that is killed mid-training.

Usage: hvd_elastic.py OUT_DIR [--victim RANK STEP]

Every step each rank trains a small model on its batch of the sampler, and the ranks
sum a per-sample count of the samples they trained on into ``state.counts`` (one row
per epoch), which is committed with the model: at the end it says how often each
sample went into a committed step. ``--victim``: that rank writes
``OUT_DIR/victim.pid`` when it reaches global step STEP and waits there to be killed.
Each rank that finishes writes ``OUT_DIR/rank<r>.json``: its final parameters, the
counts, the rank count and the rank counts it was reset to.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import numpy as np
import torch

import mpitrain.torch as hvd

SAMPLES, EPOCHS, BATCH, FEATURES = 96, 2, 4, 6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--victim", type=int, nargs=2, default=(-1, -1))
    args = p.parse_args()
    hvd.init()
    first_rank = hvd.rank()
    torch.manual_seed(1 + first_rank)  # different on every rank: the first sync must fix it
    x = torch.randn(SAMPLES, FEATURES, generator=torch.Generator().manual_seed(3))
    y = x @ torch.arange(1.0, FEATURES + 1) + 0.5
    dataset = torch.utils.data.TensorDataset(torch.arange(SAMPLES), x, y)
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02,
                                                         momentum=0.5),
                                         named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=11)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler,
                                   epoch=0, step=0, counts=np.zeros((EPOCHS, SAMPLES)))
    resets: list[int] = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def train(state: Any) -> None:
        while state.epoch < EPOCHS:
            state.sampler.set_epoch(state.epoch)
            loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH,
                                                 sampler=state.sampler)
            for batch_idx, (idx, xb, yb) in enumerate(loader):
                if (first_rank, state.step) == tuple(args.victim):
                    with open(os.path.join(args.out, "victim.pid"), "w") as f:
                        f.write(str(os.getpid()))
                    time.sleep(60)  # killed here by the test
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(xb).squeeze(1), yb)
                loss.backward()
                optimizer.step()
                seen = torch.zeros(SAMPLES, dtype=torch.float64)
                seen.index_add_(0, idx, torch.ones(len(idx), dtype=torch.float64))
                state.counts[state.epoch] += hvd.allreduce(seen, op=hvd.Sum).numpy()
                state.sampler.record_batch(batch_idx, BATCH)
                state.step += 1
                state.commit()
            state.epoch += 1
            state.commit()

    train(state)
    params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    with open(os.path.join(args.out, f"rank{first_rank}.json"), "w") as f:
        json.dump({"params": params, "counts": state.counts.tolist(), "size": hvd.size(),
                   "resets": resets, "steps": state.step}, f)


if __name__ == "__main__":
    main()
