"""Tuning records: JSON round trip, keys, lookup (exact, nearest, none) and config="auto"."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from fastopt.config import Config, patch
from fastopt.models import build_model
from fastopt.trainer import Trainer, tuning_fingerprint
from fastopt.tuner import (TuningRecord, apply_tuned, dataset_signature, device_identity, find_record,
                           model_fingerprint)
from fastopt.tuner.records import SHIPPED_RECORDS, RecordError

SMALL = {"memory_dim": 8, "dim": 8, "time_dim": 8}


def record_for(model, graph, values, **changes) -> TuningRecord:
    fields = dict(device=device_identity("cpu"), model=tuning_fingerprint(model),
                  dataset=dataset_signature(graph), values=values, step_seconds=0.01,
                  default_step_seconds=0.02, versions={"fastopt": "0.1.0"}, created="2026-12-01T00:00:00Z")
    fields.update(changes)
    return TuningRecord(**fields)


@pytest.fixture
def tgn(small_graph):
    torch.manual_seed(0)
    return build_model("tgn", small_graph, **SMALL)


def test_round_trip(tmp_path, tgn, small_graph):
    record = record_for(tgn, small_graph, {"sampler.threads": 1, "sampler.hop_dedup": False})
    path = record.save(tmp_path)
    assert path.parent == tmp_path and path.name == record.file_name() and path.name.endswith(".json")
    assert TuningRecord.load(path) == record
    assert record.speedup == pytest.approx(2.0)
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed


def test_unreadable_records_name_the_file(tmp_path):
    with pytest.raises(RecordError, match="does not exist"):
        TuningRecord.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(RecordError, match="bad.json.*cannot be read as JSON"):
        TuningRecord.load(tmp_path / "bad.json")
    (tmp_path / "old.json").write_text(json.dumps({"format": 0}))
    with pytest.raises(RecordError, match="not a tuning record of format 1"):
        TuningRecord.load(tmp_path / "old.json")


class Net(nn.Module):
    def __init__(self, width: int, rename: bool = False) -> None:
        super().__init__()
        if rename:
            self.encoder = nn.Linear(4, width)
        else:
            self.first = nn.Linear(4, width)


def test_fingerprint_is_structure_not_names(tgn, small_graph):
    assert model_fingerprint(Net(8))["key"] == model_fingerprint(Net(8, rename=True))["key"]
    assert model_fingerprint(Net(8))["key"] != model_fingerprint(Net(16))["key"]
    wider = build_model("tgn", small_graph, memory_dim=8, dim=16, time_dim=8)
    assert model_fingerprint(wider)["key"] != model_fingerprint(tgn)["key"]
    more = build_model("tgn", small_graph, fanouts=[5], **SMALL)
    assert model_fingerprint(more)["fanouts"] == [5] and model_fingerprint(more)["key"] != model_fingerprint(tgn)["key"]


class Block(nn.Module):
    """A traceable model whose submodule and argument names can change."""

    def __init__(self, width: int, rename: bool = False, op=torch.relu) -> None:
        super().__init__()
        setattr(self, "project" if rename else "first", nn.Linear(4, width))
        self.name, self.op = ("project" if rename else "first"), op

    def forward(self, x):
        return self.op(getattr(self, self.name)(x)).sum(-1)


def test_traced_fingerprint_is_the_graph_not_the_names(tgn, small_graph):
    same, renamed = tuning_fingerprint(Block(8)), tuning_fingerprint(Block(8, rename=True))
    assert same["traced"] and same["key"] == renamed["key"]
    assert tuning_fingerprint(Block(16))["key"] != same["key"]  # a width
    assert tuning_fingerprint(Block(8, op=torch.tanh))["key"] != same["key"]  # an op, same parameters
    assert model_fingerprint(Block(8, op=torch.tanh))["key"] == model_fingerprint(Block(8))["key"]
    # the reference models trace in parts (their layers, predictor, time encodings)
    assert tuning_fingerprint(tgn)["traced"] and tuning_fingerprint(tgn)["key"] != model_fingerprint(tgn)["key"]
    wider = build_model("tgn", small_graph, memory_dim=8, dim=16, time_dim=8)
    assert tuning_fingerprint(wider)["key"] != tuning_fingerprint(tgn)["key"]
    # nothing traces (no forward): the parameter shapes, as before
    assert tuning_fingerprint(Net(8)) == model_fingerprint(Net(8)) and not model_fingerprint(Net(8))["traced"]
    assert tuning_fingerprint(Net(8))["key"] == tuning_fingerprint(Net(8, rename=True))["key"]


def test_lookup_exact_then_nearest_then_none(tmp_path, tgn, small_graph, wikipedia):
    here = dataset_signature(small_graph)
    far = dict(here, events=here["events"] * 100, nodes=here["nodes"] * 10)
    near = dict(here, events=here["events"] * 2)
    other_device = dict(device_identity("cpu"), name="another cpu")
    record_for(tgn, small_graph, {"sampler.threads": 1}, dataset=far).save(tmp_path / "far.json")
    record_for(tgn, small_graph, {"sampler.threads": 2}, dataset=near).save(tmp_path / "near.json")
    record_for(tgn, small_graph, {"sampler.threads": 3}, device=other_device).save(tmp_path / "other.json")
    cpu, fp = device_identity("cpu"), tuning_fingerprint(tgn)

    match = find_record(cpu, fp, here, [tmp_path])
    assert match.how == "nearest" and match.path.name == "near.json" and match.distance > 0

    record_for(tgn, small_graph, {"sampler.threads": 4}).save(tmp_path / "exact.json")
    match = find_record(cpu, fp, here, [tmp_path])
    assert match.how == "exact" and match.record.values == {"sampler.threads": 4}

    jodie = tuning_fingerprint(build_model("jodie", small_graph, **SMALL))
    assert find_record(cpu, jodie, here, [tmp_path]) is None  # another model family
    assert find_record(dict(cpu, name="a third cpu"), fp, here, [tmp_path]) is None
    assert find_record(cpu, fp, here, [tmp_path / "empty"]) is None


def test_apply_tuned_sets_tuned_knobs_only(tmp_path, tgn, small_graph):
    values = {"sampler.threads": 1, "pipeline.prefetch_depth": 4, "train.batch_size": 600,
              "train.lr": 0.5, "pipeline.stage_threads": 3}
    record_for(tgn, small_graph, values).save(tmp_path)
    config = Config()
    config.set("pipeline.stage_threads", 1)  # set by the user: the user's value stays
    tuned, match = apply_tuned(config, tuning_fingerprint(tgn), small_graph, "cpu", dirs=[tmp_path])
    assert match.applied == {"sampler.threads": 1, "pipeline.prefetch_depth": 4}
    assert set(match.kept) == {"train.batch_size", "train.lr", "pipeline.stage_threads"}
    assert tuned.sampler.threads == 1 and tuned.pipeline.prefetch_depth == 4
    assert tuned.train.batch_size == 200 and tuned.train.lr == config.train.lr
    assert tuned.pipeline.stage_threads == 1 and config.sampler.threads == 0  # the input is unchanged
    assert "exact match" in match.describe() and "sampler.threads=1" in match.describe()


def test_the_fingerprint_and_signature_are_computed_only_where_a_record_of_the_device_exists(
        tmp_path, tgn, small_graph, monkeypatch):
    import fastopt.tuner.records as records

    traced, signed = [], []
    real_signature = records.dataset_signature
    monkeypatch.setattr(records, "dataset_signature", lambda graph: signed.append(1) or real_signature(graph))

    def fingerprint():
        traced.append(1)
        return tuning_fingerprint(tgn)

    assert apply_tuned(Config(), fingerprint, small_graph, "cpu", dirs=[tmp_path])[1] is None
    assert not traced and not signed  # no records: nothing traced, no degrees counted
    record_for(tgn, small_graph, {"sampler.threads": 1}, device=dict(device_identity("cpu"), name="another cpu")
               ).save(tmp_path)
    assert apply_tuned(Config(), fingerprint, small_graph, "cpu", dirs=[tmp_path])[1] is None
    assert not traced and not signed  # a record of another device only
    record_for(tgn, small_graph, {"sampler.threads": 1}).save(tmp_path / "here")
    tuned, match = apply_tuned(Config(), fingerprint, small_graph, "cpu", dirs=[tmp_path / "here"])
    assert match.how == "exact" and tuned.sampler.threads == 1 and traced == [1] and signed == [1]
    assert find_record(device_identity("cpu"), fingerprint, None, [tmp_path / "here"]).how == "model"


def test_a_broken_record_is_skipped_with_a_warning(tmp_path, tgn, small_graph):
    (tmp_path / "broken.json").write_text("{")
    with pytest.warns(UserWarning, match="broken.json"):
        tuned, match = apply_tuned(Config(), tuning_fingerprint(tgn), small_graph, "cpu", dirs=[tmp_path])
    assert match is None and tuned.to_dict() == Config().to_dict()


def test_auto_config_applies_the_record_and_falls_back_without_one(tmp_path, tgn, small_graph, capsys):
    with patch(tuner__records_dir=str(tmp_path / "none-here")):
        trainer = Trainer(tgn, small_graph, "auto", progress="lines")
    assert trainer.tuned is None and trainer.config.sampler.threads == 0
    assert "no tuned record matches; defaults" in capsys.readouterr().out

    record_for(tgn, small_graph, {"sampler.threads": 1, "pipeline.prefetch_depth": 1}).save(tmp_path)
    with patch(tuner__records_dir=str(tmp_path), train__device="cpu"):
        trainer = Trainer(tgn, small_graph, "auto", progress="lines",
                          log_path=tmp_path / "log.jsonl")
        trainer.fit(1)
    assert trainer.tuned.how == "exact"
    assert trainer.config.sampler.threads == 1 and trainer.config.pipeline.prefetch_depth == 1
    assert "tuned record" in capsys.readouterr().out
    run = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])
    assert run["tuned"]["applied"] == {"sampler.threads": 1, "pipeline.prefetch_depth": 1}

    explicit = Trainer(tgn, small_graph, Config(), progress=False)  # a Config: no records read
    assert explicit.tuned is None and explicit.config.sampler.threads == 0


def test_the_package_ships_no_unmeasured_records():
    assert SHIPPED_RECORDS.is_dir() and (SHIPPED_RECORDS / "README.md").is_file()
    for path in SHIPPED_RECORDS.glob("*.json"):
        record = TuningRecord.load(path)
        assert record.default_step_seconds and record.study.get("trials")


def test_optimize_auto_applies_the_kernel_values_of_the_model_record(tmp_path, tgn, small_graph):
    import fastopt

    mapping = "temporal_attention@10x2x8:block_m=32"  # the attention of this TGN, per op
    values = {"kernels.op_overrides": mapping, "passes.cuda_graphs": "off", "sampler.threads": 1}
    with patch(tuner__records_dir=str(tmp_path)):
        plain = fastopt.optimize(tgn)
        assert plain.fastopt_report.tuning == "no tuned record matches this device and model; defaults"
        record_for(tgn, small_graph, values).save(tmp_path / "tgn.json")
        fast = fastopt.optimize(tgn)
        explicit = fastopt.optimize(tgn, config=Config())  # an explicit config reads no record
    report = fast.fastopt_report
    assert (f"config: tuned record tgn.json (model match; applied kernels.op_overrides={mapping}, "
            f"passes.cuda_graphs=off)") in str(report)
    runs_under = {m._fastopt_changes.get("kernels__op_overrides") for m in fast.modules()
                  if hasattr(m, "_fastopt_changes") and m._fastopt_changes}
    assert runs_under == {mapping}
    assert explicit.fastopt_report.tuning is None and "config:" not in str(explicit.fastopt_report)


def test_without_a_dataset_only_the_same_model_matches(tmp_path, tgn, small_graph):
    wider = build_model("tgn", small_graph, memory_dim=8, dim=16, time_dim=8)
    record_for(wider, small_graph, {"kernels.block_m": 16}).save(tmp_path / "wider.json")
    cpu = device_identity("cpu")
    fp = tuning_fingerprint(tgn)
    assert find_record(cpu, fp, None, [tmp_path]) is None
    assert find_record(cpu, fp, dataset_signature(small_graph), [tmp_path]).how == "nearest"
    older = record_for(tgn, small_graph, {"kernels.block_m": 32}, created="2026-11-01T00:00:00Z")
    newer = record_for(tgn, small_graph, {"kernels.block_m": 64}, dataset=dict(older.dataset, events=7))
    older.save(tmp_path / "older.json")
    newer.save(tmp_path / "newer.json")
    match = find_record(cpu, fp, None, [tmp_path])
    assert match.how == "model" and match.path.name == "newer.json"


def test_a_saved_record_is_readable_by_others(tmp_path, tgn, small_graph):
    """Written through a temporary file and renamed, with the usual permissions (a temporary file
    alone is private to its owner, and other users of a shared records folder would skip it)."""
    import os
    import stat

    path = record_for(tgn, small_graph, {"sampler.threads": 1}).save(tmp_path)
    assert stat.S_IMODE(os.stat(path).st_mode) & stat.S_IROTH
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


def test_bench_runs_the_tuned_record_beside_the_defaults(tmp_path, small_graph):
    """``fastopt bench``'s fastopt-tuned contender applies the matching record (and names it);
    fastopt beside it keeps the defaults."""
    from fastopt.benchmark import run_bench

    base = Config()
    base.train.device, base.train.batch_size, base.train.mrr_negatives = "cpu", 400, 0
    base.model.memory_dim = base.model.dim = base.model.time_dim = 8
    torch.manual_seed(base.train.seed)
    model = build_model("tgn", small_graph, base)
    record_for(model, small_graph, {"sampler.threads": 1}).save(tmp_path)
    base.tuner.records_dir = str(tmp_path)
    results = run_bench(small_graph, "tgn", base, ["fastopt", "fastopt-tuned"], epochs=1,
                        log=lambda line: None)
    by = {r.contender: r for r in results}
    assert by["fastopt"].note == ""
    assert by["fastopt-tuned"].note.startswith("tuned record") and "sampler.threads=1" in by["fastopt-tuned"].note
    assert 0.0 <= by["fastopt-tuned"].test_ap <= 1.0 and by["fastopt-tuned"].epoch_seconds
    base.tuner.records_dir = str(tmp_path / "none-here")
    (alone,) = run_bench(small_graph, "tgn", base, ["fastopt-tuned"], epochs=1, log=lambda line: None)
    assert alone.note == "no tuning record matches this run: the defaults"
