"""A whole job configured only by Horovod's variables: HOROVOD_TIMELINE writes the
timeline, HOROVOD_FUSION_THRESHOLD and HOROVOD_CYCLE_TIME reach the engine, every rank
says once which alias it reads, and rank 0 warns once about a variable without effect.

The job starts its own ``mpirun`` with a hard timeout.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from mpirun import run

SCRIPT = """
    import numpy as np
    import mpitrain as mt
    from mpitrain import config
    comm = mt.init()
    assert config.FUSION_THRESHOLD.get() == 4096, config.FUSION_THRESHOLD.get()
    assert config.CYCLE_TIME_MS.get() == 2.5, config.CYCLE_TIME_MS.get()
    for step in range(3):
        hs = [comm.allreduce_async(np.ones(300), name=f"grad/{j}") for j in range(4)]
        assert all(h.wait()[0] == comm.size for h in hs)
    mt.shutdown()
    mt.init()
    print("rank", comm.rank, "done", flush=True)
"""


def test_a_job_configured_by_horovod_variables(tmp_path: Path) -> None:
    timeline = tmp_path / "timeline.json"
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT))
    code, out = run(3, [sys.executable, str(script)], 240, HOROVOD_TIMELINE=str(timeline),
                    HOROVOD_FUSION_THRESHOLD="4096", HOROVOD_CYCLE_TIME="2.5",
                    HOROVOD_LOG_LEVEL="info", HOROVOD_AUTOTUNE="1")
    assert code == 0, out
    assert out.count("done") == 3
    for rank in range(3):
        said = f"[rank {rank}] mpitrain INFO: mpitrain: HOROVOD_FUSION_THRESHOLD='4096' is read as"
        assert out.count(said) == 1, out
    assert out.count("HOROVOD_AUTOTUNE has no effect in mpitrain") == 1, out
    with open(timeline, encoding="utf-8") as f:
        events = json.load(f)
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert any(name.startswith("ALLREDUCE") for name in names), names
