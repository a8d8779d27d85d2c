"""Train an MLP on scikit-learn's digits with PyTorch, data-parallel over MPI ranks.

    mpitrain-run -np 4 python examples/train.py [--epochs 20] [--checkpoint DIR] [--timeline t.json]
    mpitrain-run -np 2 python examples/train.py --device cuda    # on GPUs: one per rank


A Horovod script in all but the import line: ``import mpitrain.torch as hvd``.
Each rank trains on its shard of every epoch (DistributedSampler), gradients are
averaged by hvd.DistributedOptimizer while backward runs, rank 0 draws the progress
bar, and the epoch's loss/accuracy and the final test accuracy are averaged over
all ranks' samples.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from common import ProgressBar, load_digits_split, parse_args, shard_test_set

import mpitrain.torch as hvd
from mpitrain import trainer


def make_model() -> torch.nn.Module:
    """64 pixels -> 128 -> 64 -> 10 classes."""
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                               torch.nn.Linear(128, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


def choose_device(name: str) -> torch.device:
    """``cpu``, or this rank's GPU (``local_rank % count``) for ``cuda``; exits with a
    message on every rank where CUDA is not there."""
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit(f"rank {hvd.rank()}: --device cuda needs a GPU and a CUDA build of "
                         f"torch (this torch {torch.__version__} sees none); run without "
                         "--device to train on the CPU")
    device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], epochs=20, lr=2e-3, devices=True)
    hvd.init()
    device = choose_device(args.device)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_digits_split()
    x_train, x_test = (torch.from_numpy(x).float().to(device) for x in (x_train, x_test))
    y_train, y_test = (torch.from_numpy(y).to(device) for y in (y_train, y_test))

    model = make_model().to(device)
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=args.lr),
                                         named_parameters=model.named_parameters())
    sampler = trainer.DistributedSampler(len(x_train), seed=args.seed)
    per_rank = max(1, args.batch_size // hvd.size())
    torch.manual_seed(args.seed + hvd.rank())  # dropout masks differ by rank
    first_epoch = 0
    ckpt = None  # resume from the newest intact checkpoint (damaged ones: skipped, warned)
    if args.checkpoint:
        ckpt = hvd.load_latest_checkpoint(args.checkpoint, model, optimizer)
    if ckpt is not None:
        sampler.load_state_dict(ckpt.state["extra"]["sampler"])
        first_epoch = ckpt.state["extra"]["epoch"] + 1
        if hvd.rank() == 0:
            print(f"resumed from {ckpt.path} (after epoch {first_epoch} of {args.epochs}; "
                  f"training epochs {first_epoch + 1} to {args.epochs})",
                  flush=True)
    else:  # start every rank from rank 0's weights and optimizer state
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    if hvd.rank() == 0:
        print(f"digits: {len(x_train)} training / {len(x_test)} test images, {hvd.size()} "
              f"rank(s), batch {per_rank} per rank, on {device.type}", flush=True)

    for epoch in range(first_epoch, args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        order = torch.from_numpy(sampler.indices()).to(device)
        steps = len(order) // per_rank
        bar = ProgressBar(epoch, args.epochs, steps, enabled=hvd.rank() == 0)
        metrics = trainer.Metrics()
        for step in range(steps):
            idx = order[step * per_rank:(step + 1) * per_rank]
            optimizer.zero_grad()
            logits = model(x_train[idx])
            loss = torch.nn.functional.cross_entropy(logits, y_train[idx])
            loss.backward()
            optimizer.step()
            accuracy = (logits.argmax(1) == y_train[idx]).double().mean()
            metrics.update(len(idx), loss=loss.item(), accuracy=accuracy.item())
            bar.update(step + 1, loss.item())
        epoch_avg = metrics.average()
        bar.finish(f"loss {epoch_avg['loss']:.4f} accuracy {epoch_avg['accuracy']:.4f} "
                   f"(averaged over {hvd.size()} rank(s))")
        if args.checkpoint:
            hvd.save_checkpoint(args.checkpoint, epoch, model, optimizer,
                                extra={"epoch": epoch, "sampler": sampler.state_dict()})

    model.eval()
    xs, ys = shard_test_set(x_test, y_test, hvd.rank(), hvd.size())
    with torch.no_grad():
        correct = (model(xs).argmax(1) == ys).double().mean().item() if len(ys) else 0.0
    test = trainer.average_metrics({"accuracy": correct}, weight=len(ys))
    if hvd.rank() == 0:
        print(f"test accuracy: {test['accuracy']:.4f} on {len(y_test)} held-out digits",
              flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    np.seterr(all="raise")
    main()
