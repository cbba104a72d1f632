"""One tuning worker of tests/tuner/test_postgres.py, run as a script in a process of its own.

``python tune_worker.py URL STUDY TRIALS READY GO OUT``: builds the 3,000-event graph of the
tests, writes the file READY, waits for the file GO (so that the workers open the study at the
same moment: the races of a fresh database and a new study are run, not avoided), runs
:func:`fastopt.tuner.tune` on study STUDY in storage URL for TRIALS trials, and writes to OUT the
number of trainers it built (one per trial it ran) and its worker name.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np


def main(url: str, study: str, trials: int, ready: Path, go: Path, out: Path) -> None:
    import torch

    from fastopt.config import Config
    from fastopt.data import TemporalGraph, load_dataset
    from fastopt.tuner import Window, tune
    from fastopt.tuner.study import default_trainer

    torch.set_num_threads(1)  # two workers share the cores
    wiki = load_dataset("wikipedia")
    rng = np.random.default_rng(0)
    n = 3000
    graph = TemporalGraph(wiki.src[:n], wiki.dst[:n], wiki.ts[:n], wiki.num_nodes, name="wikipedia-head3000",
                          edge_feat=rng.standard_normal((n, 8), dtype=np.float32))
    config = Config()
    for name, value in {"train.device": "cpu", "model.memory_dim": 8, "model.dim": 8, "model.time_dim": 8,
                        "sampler.threads": 1, "tuner.confirm_rounds": 0}.items():  # one trainer per trial
        config.set(name, value)
    make, built = default_trainer("tgn", graph), []

    def counting(cfg):
        built.append(cfg)
        return make(cfg)

    ready.write_text("ready")
    deadline = time.monotonic() + 120
    while not go.exists():
        if time.monotonic() > deadline:
            raise SystemExit("the test never said go")
        time.sleep(0.01)
    tune(graph, "tgn", config, trials=trials, storage=url, study_name=study, window=Window(1, 2),
         say=lambda line: print(line, flush=True), make_trainer=counting)
    out.write_text(json.dumps({"worker": f"{socket.gethostname()}:{os.getpid()}", "built": len(built)}))


if __name__ == "__main__":
    url_, study_, trials_, ready_, go_, out_ = sys.argv[1:]
    main(url_, study_, int(trials_), Path(ready_), Path(go_), Path(out_))
