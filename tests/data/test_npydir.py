"""Graph folders: written a chunk at a time, read memory-mapped, trained from without reading the
feature table into RAM."""

import json
import os
import subprocess
import sys
from collections import namedtuple

import numpy as np
import pytest

from fastopt.cli import main
from fastopt.data import load_dataset
from fastopt.data.npydir import is_npy_dir, load_npy_dir, write_npy_dir
from fastopt.data.synth import BLOCK_EVENTS, GdeltProfile, gdelt_chunks, synthesize_gdelt
from fastopt.errors import DataError


def write_gdelt(path, profile, num_events, seed=0, chunk_events=BLOCK_EVENTS):
    return write_npy_dir(path, gdelt_chunks(profile, num_events, seed=seed, chunk_events=chunk_events),
                         num_events=num_events, num_nodes=profile.num_nodes, edge_dim=profile.edge_dim,
                         name="synth-gdelt")


def test_a_folder_written_in_chunks_is_the_graph_made_at_once(tmp_path):
    profile = GdeltProfile(num_nodes=1_000, edge_dim=5)
    n = 2 * BLOCK_EVENTS + 17
    write_gdelt(tmp_path / "g", profile, n, seed=2, chunk_events=1)
    graph, whole = load_dataset(tmp_path / "g"), synthesize_gdelt(profile, n, seed=2)
    assert is_npy_dir(tmp_path / "g") and graph.num_nodes == whole.num_nodes
    assert isinstance(graph.edge_feat, np.memmap)  # mapped, not read
    for name in ("src", "dst", "ts", "edge_feat"):
        assert np.array_equal(getattr(graph, name), getattr(whole, name)), name
    assert (graph.train_end, graph.val_end) == (whole.train_end, whole.val_end)
    assert sorted(p.name for p in (tmp_path / "g").iterdir()) == [
        "dst.npy", "edge_feat.npy", "graph.json", "src.npy", "ts.npy"]


def test_node_features_and_featureless_graphs_round_trip(tmp_path, small_graph):
    g = small_graph
    write_npy_dir(tmp_path / "s", [(g.src, g.dst, g.ts, None)], num_events=g.num_events,
                  num_nodes=g.num_nodes, edge_dim=0, name="s", node_feat=g.node_feat)
    back = load_npy_dir(tmp_path / "s")
    assert back.edge_feat is None and isinstance(back.node_feat, np.memmap)
    assert np.array_equal(back.node_feat, g.node_feat) and np.array_equal(back.dst, g.dst)


def test_a_nan_in_a_mapped_table_is_found(tmp_path):
    write_gdelt(tmp_path / "g", GdeltProfile(num_nodes=50, edge_dim=3), 1_000)
    feat = np.load(tmp_path / "g" / "edge_feat.npy", mmap_mode="r+")
    feat[777, 1] = np.nan
    feat.flush()
    del feat
    with pytest.raises(DataError, match=r"edge_feat contains NaN.*rows 0\.\.999"):
        load_dataset(tmp_path / "g")


def test_bad_outputs_are_refused_before_writing(tmp_path, monkeypatch):
    profile = GdeltProfile(num_nodes=50, edge_dim=2)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    with pytest.raises(DataError, match="exists and is not an empty folder"):
        write_gdelt(tmp_path / "full", profile, 100)
    with pytest.raises(DataError, match="num_events must be >= 1"):
        write_gdelt(tmp_path / "new", profile, 0)
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr("shutil.disk_usage", lambda path: Usage(1 << 30, 1 << 30, 1 << 20))
    with pytest.raises(DataError, match=r"need 31 MiB \(and 64 MiB to spare\), but .* has 1 MiB free; pass fewer"):
        write_gdelt(tmp_path / "new", profile, 1_000_000)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # nothing left behind
    (tmp_path / "empty").mkdir()
    write_gdelt(tmp_path / "empty", profile, 100)  # an empty folder is filled
    assert is_npy_dir(tmp_path / "empty")


def test_a_damaged_folder_is_refused(tmp_path):
    write_gdelt(tmp_path / "g", GdeltProfile(num_nodes=50, edge_dim=2), 100)
    np.save(tmp_path / "g" / "ts.npy", np.zeros(99))
    with pytest.raises(DataError, match="ts.npy holds float64 of shape \\(99,\\); the manifest asks"):
        load_dataset(tmp_path / "g")
    (tmp_path / "g" / "graph.json").write_text("{")
    with pytest.raises(DataError, match="not a readable graph manifest"):
        load_dataset(tmp_path / "g")


def test_the_command_writes_a_folder_or_an_npz(tmp_path, capsys):
    assert main(["data", "synth", "--like", "gdelt", "--events", "5000", "--nodes", "300",
                 "--edge-dim", "4", "--out", str(tmp_path / "g")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["data", "synth", "--like", "gdelt", "--events", "5000", "--nodes", "300",
                 "--edge-dim", "4", "--out", str(tmp_path / "g.npz")]) == 0
    folder, npz = load_dataset(tmp_path / "g"), load_dataset(tmp_path / "g.npz")
    assert np.array_equal(folder.edge_feat, npz.edge_feat) and np.array_equal(folder.dst, npz.dst)
    manifest = json.loads((tmp_path / "g" / "graph.json").read_text())
    assert manifest["made_by"]["repeat"] == 0.9 and manifest["num_events"] == 5000
    assert main(["data", "synth", "--like", "wikipedia", "--events", "2000", "--out", str(tmp_path / "w")]) == 0
    assert load_dataset(tmp_path / "w").bipartite
    for argv, match in ((["--like", "gdelt", "--events", "0"], "num_events must be >= 1"),
                        (["--like", "gdelt", "--events", "10"], "exists and is not an empty folder"),
                        (["--like", "wikipedia", "--events", "10", "--repeat", "0.5"], "--repeat set the GDELT")):
        assert main(["data", "synth", *argv, "--out", str(tmp_path / "g")]) == 2
        assert match in capsys.readouterr().err


# Run first in a probe process: kb(key) reads /proc/self/status; restart_peak() starts the peak
# (VmHWM) afresh from the present RSS, so that the imports' peak is not the measured run's.
MEMORY = r"""
import json, sys

def kb(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])

def restart_peak():
    try:
        open("/proc/self/clear_refs", "w").write("5")
    except OSError:
        pass
    return kb("VmRSS")
"""

def run_probe(code: str, *args) -> dict:
    """Run ``code`` in a fresh Python process with ``args`` and return the JSON it printed last."""
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# Writes a GDELT-like folder and prints its peak RSS growth (kB) while writing.
WRITE_PROBE = MEMORY + r"""
from fastopt.data.npydir import write_npy_dir
from fastopt.data.synth import GdeltProfile, gdelt_chunks

out, events, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
profile = GdeltProfile(edge_dim=width)
before = restart_peak()
write_npy_dir(out, gdelt_chunks(profile, events), num_events=events, num_nodes=profile.num_nodes,
              edge_dim=width, name="g")
print(json.dumps({"growth_kb": kb("VmHWM") - before}))
"""


def test_writing_holds_one_chunk_not_the_graph(tmp_path):
    """3 M events with 16-d features (264 MB of files, 23 blocks): the writer's peak RSS grows by
    well under half of that (one chunk, the sources' last partners and the temporaries)."""
    growth_kb = run_probe(WRITE_PROBE, tmp_path / "g", 3_000_000, 16)["growth_kb"]
    files_kb = sum(p.stat().st_size for p in (tmp_path / "g").iterdir()) // 1024
    assert growth_kb < files_kb / 2, (growth_kb, files_kb)


# Trains TGN for a bounded number of batches from a graph folder in a fresh process and prints
# its peak RSS growth (kB) from just before the load: with the feature table mapped ("mapped"),
# or read into RAM ("ram", the control: the same run holding a copy of the table).
PROBE = MEMORY + r"""
import numpy as np
import torch
from fastopt.config import Config
from fastopt.data import TemporalGraph, load_dataset
from fastopt.models import build_model
from fastopt.trainer import Trainer

folder, where, batches = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(1)
before = restart_peak()
graph = load_dataset(folder)
if where == "ram":  # read(), not through the mapping: the copy alone, no mapped pages
    graph = TemporalGraph(graph.src, graph.dst, graph.ts, graph.num_nodes, name=graph.name,
                          edge_feat=np.load(folder + "/edge_feat.npy"))
table = type(graph.edge_feat).__name__
cfg = Config()
cfg.train.device, cfg.train.batch_size = "cpu", 2000
cfg.sampler.threads = 1
torch.manual_seed(0)
trainer = Trainer(build_model("tgn", graph, memory_dim=8, dim=8, time_dim=8), graph, cfg, progress=False)
steps = 0
for loss in trainer.train_steps(0):
    steps += 1
    if steps == batches:
        break
print(json.dumps({"growth_kb": kb("VmHWM") - before, "steps": steps, "table": table,
                  "loss": float(loss)}))
"""


def test_training_from_a_mapped_graph_keeps_the_features_on_disk(tmp_path):
    """1 M events with 128-d features (512 MB): TGN trains 20 batches of 2,000 events (an epoch,
    350 batches, takes about a minute on a 2-core CI machine); its peak RSS grows by at least
    three quarters of the feature file less than that of the same run with the table in RAM: the
    table is never copied. The rows a run reads stay mapped (file-backed pages, counted in RSS
    though the kernel may reclaim them), so over a whole epoch the gap narrows (README,
    Datasets)."""
    profile = GdeltProfile(edge_dim=128)
    write_gdelt(tmp_path / "g", profile, 1_000_000)
    file_kb = (tmp_path / "g" / "edge_feat.npy").stat().st_size // 1024
    mapped = run_probe(PROBE, tmp_path / "g", "mapped", 20)
    ram = run_probe(PROBE, tmp_path / "g", "ram", 20)
    assert (mapped["table"], ram["table"]) == ("memmap", "ndarray")
    assert mapped["steps"] == 20 and mapped["loss"] == ram["loss"]
    assert ram["growth_kb"] - mapped["growth_kb"] > 0.75 * file_kb, (mapped, ram, file_kb)


def counting_scans(monkeypatch) -> list:
    """Patch the reader of the NaN scan: the returned list gets one entry per piece it reads."""
    import fastopt.data.graph as graph_module

    reads, read = [], graph_module._rows
    monkeypatch.setattr(graph_module, "_rows", lambda feat, lo, hi: reads.append((lo, hi)) or read(feat, lo, hi))
    return reads


def age(folder, seconds: float = 60.0) -> None:
    """Set the feature files' times back, as files written a while ago have them."""
    for file in folder.glob("*_feat.npy"):
        t = file.stat().st_mtime_ns - int(seconds * 1e9)
        os.utime(file, ns=(t, t))


def overwrite(file, row: int, col: int, value: float) -> None:
    """Write one float32 of a 2-d .npy table through an ordinary write (size unchanged)."""
    table = np.load(file, mmap_mode="r")
    offset = table.offset + (row * table.shape[1] + col) * 4
    del table
    with open(file, "r+b") as f:
        f.seek(offset)
        f.write(np.float32(value).tobytes())


def test_the_nan_scan_runs_once_per_version_of_the_feature_files(tmp_path, monkeypatch):
    folder = tmp_path / "g"
    write_gdelt(folder, GdeltProfile(num_nodes=50, edge_dim=3), 3_000)
    manifest = json.loads((folder / "graph.json").read_text())
    stat = (folder / "edge_feat.npy").stat()
    assert manifest["checked"] == {"edge_feat.npy": {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}}
    reads = counting_scans(monkeypatch)
    load_dataset(folder)
    assert reads == []  # the writer scanned the chunks: no load reads the features to scan them
    # A folder without the record (written before it existed) is scanned once, then recorded.
    del manifest["checked"]
    (folder / "graph.json").write_text(json.dumps(manifest))
    age(folder)
    load_dataset(folder)
    assert reads and reads[-1][1] == 3_000
    reads.clear()
    load_dataset(folder)
    assert reads == []
    assert sorted(p.name for p in folder.iterdir()) == [  # no temporary file left behind
        "dst.npy", "edge_feat.npy", "graph.json", "src.npy", "ts.npy"]
    # A file changed in place (same size, new time) is scanned again; a fresh change is not
    # recorded, since a second write within the timestamp granularity could keep its time.
    overwrite(folder / "edge_feat.npy", 5, 0, 1.5)
    for _ in range(2):
        load_dataset(folder)
        assert reads
        reads.clear()
    age(folder)
    load_dataset(folder)
    reads.clear()
    load_dataset(folder)
    assert reads == []
    overwrite(folder / "edge_feat.npy", 2_222, 2, np.inf)
    with pytest.raises(DataError, match=r"edge_feat contains NaN or infinite values \(in rows 0\.\.2999\)"):
        load_dataset(folder)


def test_node_features_are_recorded_and_a_nan_written_later_is_found(tmp_path, small_graph, monkeypatch):
    g = small_graph
    node_feat = np.random.default_rng(0).standard_normal((g.num_nodes, 4)).astype(np.float32)
    write_npy_dir(tmp_path / "s", [(g.src, g.dst, g.ts, None)], num_events=g.num_events,
                  num_nodes=g.num_nodes, edge_dim=0, name="s", node_feat=node_feat)
    assert set(json.loads((tmp_path / "s" / "graph.json").read_text())["checked"]) == {"node_feat.npy"}
    reads = counting_scans(monkeypatch)
    load_npy_dir(tmp_path / "s")
    assert reads == []
    overwrite(tmp_path / "s" / "node_feat.npy", 3, 1, np.nan)
    with pytest.raises(DataError, match="node_feat contains NaN"):
        load_npy_dir(tmp_path / "s")


def test_features_with_a_nan_are_written_unrecorded_and_refused_at_load(tmp_path):
    chunk = gdelt_chunks(GdeltProfile(num_nodes=50, edge_dim=2), 100)
    src, dst, ts, feat = (np.concatenate(c) for c in zip(*chunk))
    feat[40, 0] = np.nan
    write_npy_dir(tmp_path / "g", [(src, dst, ts, feat)], num_events=100, num_nodes=50, edge_dim=2, name="g")
    assert "checked" not in json.loads((tmp_path / "g" / "graph.json").read_text())
    with pytest.raises(DataError, match="edge_feat contains NaN"):
        load_dataset(tmp_path / "g")
