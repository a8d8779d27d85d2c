"""What both digit examples share: arguments, the dataset, the progress bar, test sharding.

The dataset is scikit-learn's ``digits`` (1797 8x8 images, shipped inside the
scikit-learn package, so nothing is downloaded): 80% for training, a stratified 20%
held out for the final test accuracy.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np


def parse_args(description: str, epochs: int, lr: float) -> argparse.Namespace:
    """The command line of both examples."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--epochs", type=int, default=epochs, help="passes over the training set")
    p.add_argument("--batch-size", type=int, default=64,
                   help="global batch size, split evenly over the ranks")
    p.add_argument("--lr", type=float, default=lr, help="learning rate")
    p.add_argument("--seed", type=int, default=42, help="initialisation and shuffling seed")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="save a checkpoint here after every epoch; resume from the newest")
    p.add_argument("--timeline", metavar="FILE",
                   help="write the engine's Chrome-trace timeline (MPITRAIN_TIMELINE)")
    args = p.parse_args()
    if args.timeline:  # read by the engine when it starts
        os.environ["MPITRAIN_TIMELINE"] = args.timeline
    return args


def load_digits_split(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``x_train, y_train, x_test, y_test``: pixels scaled to [0, 1], float64, int64 labels."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = digits.data.astype(np.float64) / 16.0
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, stratify=y,
                                                        random_state=seed)
    return x_train, y_train, x_test, y_test


def shard_test_set(x: np.ndarray, y: np.ndarray, rank: int, size: int) -> tuple[Any, Any]:
    """This rank's block of the test set (blocks differ by at most one sample)."""
    return np.array_split(x, size)[rank], np.array_split(y, size)[rank]


class ProgressBar:
    """A plain-text progress bar for one epoch, drawn on rank 0 only."""

    def __init__(self, epoch: int, epochs: int, total: int, enabled: bool, width: int = 30):
        self.prefix = f"epoch {epoch + 1:>{len(str(epochs))}}/{epochs}"
        self.total, self.enabled, self.width = max(total, 1), enabled, width
        self.start = time.perf_counter()
        self.shown = -1

    def update(self, done: int, loss: float) -> None:
        """Redraw after ``done`` of ``total`` steps (at most ~20 times per epoch)."""
        tick = done * 20 // self.total
        if not self.enabled or (tick == self.shown and done != self.total):
            return
        self.shown = tick
        filled = done * self.width // self.total
        bar = "#" * filled + "." * (self.width - filled)
        sys.stdout.write(f"\r{self.prefix} [{bar}] {done}/{self.total} loss {loss:.4f} "
                         f"{time.perf_counter() - self.start:5.1f}s")
        sys.stdout.flush()

    def finish(self, summary: str) -> None:
        """End the bar's line with the epoch's summary."""
        if self.enabled:
            sys.stdout.write(f"  {summary}\n")
            sys.stdout.flush()
