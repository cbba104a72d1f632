"""Padded lengths kept across runs (runtime/shape_plans.py) and the high water they seed."""

from __future__ import annotations

import types

import numpy as np

from fastopt.runtime.inputs import HighWater, bucket
from fastopt.runtime.shape_plans import load_lengths, plan_key, save_lengths


def _events(n=5000, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 300, n), rng.integers(300, 600, n), np.sort(rng.random(n) * 1e6)


def test_the_key_follows_the_events_and_the_settings():
    src, dst, ts = _events()
    key = plan_key(src, dst, ts, fanouts=[10, 10], batch_size=600)
    assert key == plan_key(src.copy(), dst.copy(), ts.copy(), batch_size=600, fanouts=[10, 10])
    assert key != plan_key(src, dst, ts, fanouts=[10, 10], batch_size=200)
    assert key != plan_key(src, dst, ts, fanouts=[10], batch_size=600)
    assert key != plan_key(src[:-1], dst[:-1], ts[:-1], fanouts=[10, 10], batch_size=600)
    other = src.copy()
    other[0] += 1  # the first event is always among those read
    assert key != plan_key(other, dst, ts, fanouts=[10, 10], batch_size=600)
    assert key == plan_key(src, dst, ts, fanouts=(np.int64(10), 10), batch_size=np.int64(600))


def test_saved_lengths_merge_upward_and_bad_files_read_as_none(tmp_path):
    assert load_lengths(tmp_path, "k") == {}
    assert save_lengths(tmp_path, "k", {"loader": {"nodes/1800": 3072}, "sampler": {"hop0/1800": 7168}})
    save_lengths(tmp_path, "k", {"loader": {"nodes/1800": 2048, "edges/1800": 20480}})
    assert load_lengths(tmp_path, "k") == {"loader": {"nodes/1800": 3072, "edges/1800": 20480},
                                           "sampler": {"hop0/1800": 7168}}
    (tmp_path / "bad.json").write_text("{not json")
    assert load_lengths(tmp_path, "bad") == {}
    assert save_lengths(tmp_path, "bad", {"loader": {"nodes/3": 256}})  # replaced, not merged with junk
    assert load_lengths(tmp_path, "bad") == {"loader": {"nodes/3": 256}}
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert save_lengths(blocker / "plans", "k", {"loader": {"nodes/3": 256}}) is None  # not a folder


def test_a_seeded_high_water_pads_to_the_seed_from_the_first_batch():
    hw = HighWater()
    hw.seed({"nodes/1800": 3072})
    assert hw("nodes/1800", 100) == 3072  # a small first batch already takes the final length
    assert hw("edges/1800", 100) == bucket(100)  # other kinds start as before
    assert hw("nodes/1800", 5000) == bucket(5000) and hw("nodes/1800", 10) == bucket(5000)
    hw.seed({"nodes/1800": 256})  # never lowers
    assert hw.lengths["nodes/1800"] == bucket(5000)


def test_the_cpu_trainer_keeps_no_plan(small_graph):
    from fastopt.config import Config
    from fastopt.models import build_model
    from fastopt.trainer import Trainer

    cfg = Config()
    cfg.train.device, cfg.train.mrr_negatives = "cpu", 0
    t = Trainer(build_model("tgat", small_graph, dim=8, time_dim=4, fanouts=(3, 2)), small_graph, cfg, progress=False)
    assert t._shape_plan is None and not t.plan_shapes()  # nothing is padded on the CPU
    assert not t.plan_shapes(hot_sets=True)  # nor read zero-copy
    # a loader reading rows zero-copy: a pass counting uses for the first epoch's hot sets
    calls = []
    t.loader = types.SimpleNamespace(zero_copy=True, presample=lambda *a, **kw: calls.append((a, kw)))
    assert t.plan_shapes(hot_sets=True) and not t.plan_shapes()
    assert calls == [(("train", 1), {"reserve": False, "foresee": True})]  # another epoch's draws


def test_a_shape_plan_seeds_its_high_waters_and_saves_them(tmp_path):
    from fastopt.runtime.shape_plans import ShapePlan

    fresh = ShapePlan(tmp_path, "k", {"loader": HighWater()})
    assert not fresh.found
    fresh.high_waters["loader"]("nodes/1800", 3000)
    fresh.save()
    seeded = ShapePlan(tmp_path, "k", {"loader": HighWater(), "sampler": HighWater()})
    assert seeded.found and seeded.high_waters["loader"]("nodes/1800", 5) == bucket(3000)
    assert seeded.high_waters["sampler"].lengths == {}
