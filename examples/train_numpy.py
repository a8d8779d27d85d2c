"""Train an MLP on scikit-learn's digits with numpy only, data-parallel over MPI ranks.

    mpitrain-run -np 4 python examples/train_numpy.py [--epochs 30] [--checkpoint DIR]

The model's backward pass announces each layer's gradients to the
DistributedOptimizer as soon as they are computed (last layer first), so their
allreduces run while the earlier layers' gradients are still being computed.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from common import ProgressBar, load_digits_split, parse_args, shard_test_set

import mpitrain as mt
from mpitrain import checkpoint, trainer


class MLP:
    """Fully connected ReLU layers with a softmax cross-entropy loss."""

    def __init__(self, sizes: list[int], rng: np.random.Generator) -> None:
        self.params: list[trainer.Parameter] = []
        for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:])):
            w = rng.standard_normal((n_in, n_out)) * np.sqrt(2.0 / n_in)  # He initialisation
            self.params += [trainer.Parameter(w, f"layer{i}.weight"),
                            trainer.Parameter(np.zeros(n_out), f"layer{i}.bias")]

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """Logits, and every layer's input (kept for backward)."""
        inputs = []
        for i in range(0, len(self.params), 2):
            inputs.append(x)
            x = x @ self.params[i].data + self.params[i + 1].data
            if i + 2 < len(self.params):
                x = np.maximum(x, 0.0)
        return x, inputs

    def loss_and_backward(self, x: np.ndarray, y: np.ndarray,
                          on_grad: Callable[[trainer.Parameter], None]) -> tuple[float, float]:
        """Mean cross-entropy and accuracy; fills every ``.grad``, calling ``on_grad``."""
        logits, inputs = self.forward(x)
        shifted = logits - logits.max(axis=1, keepdims=True)
        probs = np.exp(shifted)
        probs /= probs.sum(axis=1, keepdims=True)
        loss = float(-np.log(probs[np.arange(len(y)), y] + 1e-12).mean())
        accuracy = float((logits.argmax(1) == y).mean())
        delta = probs
        delta[np.arange(len(y)), y] -= 1.0
        delta /= len(y)
        for i in range(len(self.params) - 2, -1, -2):
            weight, bias = self.params[i], self.params[i + 1]
            weight.grad = inputs[i // 2].T @ delta
            bias.grad = delta.sum(axis=0)
            on_grad(weight)
            on_grad(bias)  # this layer's allreduces start now
            if i:
                delta = (delta @ weight.data.T) * (inputs[i // 2] > 0)
        return loss, accuracy

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Class of each row."""
        return self.forward(x)[0].argmax(1)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], epochs=30, lr=2e-3)
    comm = mt.init()
    x_train, y_train, x_test, y_test = load_digits_split()
    model = MLP([64, 128, 10], np.random.default_rng(args.seed))
    optimizer = trainer.DistributedOptimizer(trainer.Adam(model.params, lr=args.lr))
    sampler = trainer.DistributedSampler(len(x_train), seed=args.seed)
    per_rank = max(1, args.batch_size // comm.size)
    first_epoch = 0
    ckpt = None  # resume from the newest intact checkpoint (damaged ones: skipped, warned)
    if args.checkpoint:
        ckpt = checkpoint.load_latest(args.checkpoint)
    if ckpt is not None:
        state = ckpt.state
        for p in model.params:
            p.data[...] = state["params"][p.name]
        optimizer.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        first_epoch = state["epoch"] + 1
        if comm.rank == 0:
            print(f"resumed from {ckpt.path} (after epoch {first_epoch} of {args.epochs}; "
                  f"training epochs {first_epoch + 1} to {args.epochs})",
                  flush=True)
    else:
        trainer.broadcast_parameters(model.params, root_rank=0)
        trainer.broadcast_optimizer_state(optimizer, root_rank=0)
    if comm.rank == 0:
        print(f"digits: {len(x_train)} training / {len(x_test)} test images, {comm.size} "
              f"rank(s), batch {per_rank} per rank", flush=True)

    for epoch in range(first_epoch, args.epochs):
        sampler.set_epoch(epoch)
        order = sampler.indices()
        steps = len(order) // per_rank
        bar = ProgressBar(epoch, args.epochs, steps, enabled=comm.rank == 0)
        metrics = trainer.Metrics()
        for step in range(steps):
            idx = order[step * per_rank:(step + 1) * per_rank]
            optimizer.zero_grad()
            loss, accuracy = model.loss_and_backward(x_train[idx], y_train[idx],
                                                     optimizer.grad_ready)
            optimizer.step()
            metrics.update(len(idx), loss=loss, accuracy=accuracy)
            bar.update(step + 1, loss)
        epoch_avg = metrics.average()
        bar.finish(f"loss {epoch_avg['loss']:.4f} accuracy {epoch_avg['accuracy']:.4f} "
                   f"(averaged over {comm.size} rank(s))")
        if args.checkpoint:
            checkpoint.save(args.checkpoint, {"params": {p.name: p.data for p in model.params},
                                              "optimizer": optimizer.state_dict(),
                                              "sampler": sampler.state_dict(), "epoch": epoch},
                            step=epoch)

    xs, ys = shard_test_set(x_test, y_test, comm.rank, comm.size)
    correct = float((model.predict(xs) == ys).mean()) if len(ys) else 0.0
    test = trainer.average_metrics({"accuracy": correct}, weight=len(ys))
    if comm.rank == 0:
        print(f"test accuracy: {test['accuracy']:.4f} on {len(y_test)} held-out digits",
              flush=True)
    mt.shutdown()


if __name__ == "__main__":
    main()
