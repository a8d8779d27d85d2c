"""What both digit examples share: arguments, the dataset, progress, test sharding.

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
from tqdm import tqdm


def parse_args(description: str, epochs: int, lr: float,
               devices: bool = False) -> argparse.Namespace:
    """The command line of both examples (``devices``: with ``--device``, torch only)."""
    p = argparse.ArgumentParser(description=description)
    if devices:
        p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                       help="where to train: cuda puts each rank on GPU local_rank %% count "
                            "(needs a CUDA build of torch and CuPy: pip install "
                            "'mpitrain[cuda13]')")
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


def terminal_columns() -> int:
    """The width of the terminal that stdout shows on; 0 if stdout is no terminal.

    A rank under ``mpiexec`` writes to Open MPI's pseudo-terminal, which has no size
    whether the job's output goes to a terminal or to a pipe; ``mpitrain-run`` started
    from a terminal passes that terminal's width on as ``COLUMNS``."""
    if not sys.stdout.isatty():
        return 0
    try:
        columns = os.get_terminal_size(sys.stdout.fileno()).columns
    except OSError:
        columns = 0
    if columns == 0 and os.environ.get("COLUMNS", "").isdigit():
        columns = int(os.environ["COLUMNS"])
    return columns


class ProgressBar:
    """One epoch's progress, shown by rank 0 only (``enabled``).

    On a terminal (:func:`terminal_columns`), a tqdm bar (steps, rate, loss) that stays
    on the screen, complete, when the epoch ends (an epoch of the digits takes a tenth of
    a second: a bar erased at its end would never be seen). Then, on a terminal or not,
    one plain line per epoch: logs, pipes and mpirun's forwarded output get only those
    lines, never a bar redrawn with carriage returns.
    """

    def __init__(self, epoch: int, epochs: int, total: int, enabled: bool):
        self.prefix = f"epoch {epoch + 1:>{len(str(epochs))}}/{epochs}"
        self.total, self.enabled = total, enabled
        self.start = time.perf_counter()
        columns = terminal_columns() if enabled else 0
        self.bar = tqdm(total=total, desc=self.prefix, unit="step", file=sys.stdout,
                        ncols=columns or None, leave=bool(columns), disable=not columns)

    def update(self, done: int, loss: float) -> None:
        """Move the bar to ``done`` of ``total`` steps, showing the last batch's ``loss``."""
        if not self.bar.disable:
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            self.bar.update(done - self.bar.n)

    def finish(self, summary: str) -> None:
        """Close the bar (it stays, complete) and print the epoch's line, ending with
        ``summary``."""
        self.bar.close()
        if self.enabled:
            print(f"{self.prefix}: {self.total} steps in {time.perf_counter() - self.start:.1f}s, "
                  f"{summary}", flush=True)
