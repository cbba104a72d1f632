"""The search space lists only knobs that can change this run's speed."""

from __future__ import annotations

import importlib.util

import optuna
import pytest

import fastopt.config as fconfig
from fastopt.codegen.kernel_config import MAX_TILE, heuristic_config, next_power_of_2
from fastopt.config import OP_OVERRIDE_FIELDS, Config
from fastopt.errors import ConfigError
from fastopt.models import build_model
import fastopt.tuner.space as space_module
from fastopt.tuner import build_space
from fastopt.tuner.space import MAX_SEARCHED_ROW_TILE, knob_fields, op_choices

SMALL = {"tgn": {"memory_dim": 8, "dim": 8, "time_dim": 8}, "tgat": {"dim": 8, "time_dim": 8},
         "jodie": {"memory_dim": 8, "dim": 8, "time_dim": 8}, "apan": {"memory_dim": 8, "dim": 8, "time_dim": 8}}
CPU_PIPELINE = {"pipeline.prefetch_depth", "pipeline.stage_threads"}
CUDA_ONLY = {"cache.placement", "cache.budget_fraction", "cache.policy", "passes.cuda_graphs",
             "pipeline.step_graphs"}


def space_for(name, graph, device="cpu", config=None, **kwargs):
    config = config or Config()
    return build_space(build_model(name, graph, **SMALL[name]), graph, config, device, **kwargs)


SAMPLER = {"sampler.threads", "sampler.reorder", "sampler.pin_threads"}


@pytest.fixture
def two_cores(monkeypatch):
    """Spaces built as on CI's 2-core machine (thread counts and placement depend on the cores)."""
    monkeypatch.setattr(space_module, "_cores", lambda: 2)


@pytest.mark.parametrize("name,searched", [
    ("tgn", SAMPLER | CPU_PIPELINE),
    ("tgat", SAMPLER | {"sampler.hop_dedup"} | CPU_PIPELINE),  # two layers
    ("jodie", CPU_PIPELINE),  # samples no neighbors
    ("apan", CPU_PIPELINE),
])
def test_cpu_space_of_each_model(small_graph, name, searched, two_cores):
    space = space_for(name, small_graph)
    assert set(space.names) == searched
    assert not set(space.names) & CUDA_ONLY and not any(n.startswith("kernels.") for n in space.names)
    assert space.fixed == {}


def test_thread_placement_only_for_several_threads_that_can_be_paired(small_graph, monkeypatch):
    monkeypatch.setattr(space_module, "_cores", lambda: 1)
    assert "sampler.pin_threads" not in space_for("tgn", small_graph).names  # one core
    monkeypatch.setattr(space_module, "_cores", lambda: 4)
    space = space_for("tgn", small_graph)
    knobs = {k.name: k for k in space.knobs}
    assert knobs["sampler.reorder"].choices == ("none", "degree", "rcm")
    assert not knobs["sampler.pin_threads"].when({"sampler.threads": 1})
    assert knobs["sampler.pin_threads"].when({"sampler.threads": 0})  # one per core: four
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "networkx" else real(name, *a))
    assert "sampler.pin_threads" not in space_for("tgn", small_graph).names  # nothing pairs them


def test_cuda_space_adds_placement_graphs_and_kernels(small_graph):
    """Built for a CUDA device (nothing runs on it): cache knobs for the feature tables, CUDA
    graphs for the optimized model, the kernels' mapping where triton is installed."""
    space = space_for("tgn", small_graph, device="cuda")
    assert CUDA_ONLY <= set(space.names)
    kernels = {n for n in space.names if n.startswith("kernels.")}
    assert bool(kernels) == (importlib.util.find_spec("triton") is not None)
    eager = Config()
    eager.set("train.optimize", "off")
    space = space_for("tgn", small_graph, device="cuda", config=eager)
    assert "passes.cuda_graphs" not in space.names and not any(n.startswith("kernels.") for n in space.names)
    assert dict((k.name, k.choices) for k in space.knobs)["pipeline.step_graphs"] == ("auto", "on")


def test_knobs_under_other_knobs_are_suggested_only_when_they_matter(small_graph, two_cores):
    space = space_for("tgn", small_graph, device="cuda")
    base = {"pipeline.prefetch_depth": 2, "sampler.threads": 0, "pipeline.stage_threads": 0,
            "pipeline.gil_switch_us": 0, "cache.placement": "device", "passes.cuda_graphs": "auto", "pipeline.step_graphs": "auto",
            "sampler.reorder": "none", "sampler.pin_threads": False}
    base.update({k.name: k.choices[0] for k in space.knobs if k.name.startswith("kernels.")})
    on_device = space.suggest(optuna.trial.FixedTrial(base))
    assert "cache.budget_fraction" not in on_device and "cache.policy" not in on_device
    host = space.suggest(optuna.trial.FixedTrial({**base, "cache.placement": "host", "cache.budget_fraction": 0.25,
                                                  "cache.host_reads": "staged", "cache.policy": "lru"}))
    assert host["cache.budget_fraction"] == 0.25 and host["cache.policy"] == "lru"
    # zero-copy reads keep a static hot set: no policy to choose
    zero_copy = space.suggest(optuna.trial.FixedTrial({**base, "cache.placement": "host", "cache.budget_fraction": 0.25,
                                                       "cache.host_reads": "zero_copy", "cache.hot_set_phases": 4,
                                                       "cache.read_overlap": True}))
    assert zero_copy["cache.host_reads"] == "zero_copy" and "cache.policy" not in zero_copy
    # and its hot sets an epoch, and the side-stream read for a model that waits for its edges (TGN)
    assert zero_copy["cache.hot_set_phases"] == 4 and zero_copy["cache.read_overlap"] is True
    assert "cache.hot_set_phases" not in host and "cache.read_overlap" not in host
    assert "cache.read_overlap" not in space_for("tgat", small_graph, device="cuda").names
    no_cache = space.suggest(optuna.trial.FixedTrial({**base, "cache.placement": "host",
                                                      "cache.budget_fraction": 0.0}))
    assert "cache.policy" not in no_cache and "cache.host_reads" not in no_cache
    shallow = space.suggest(optuna.trial.FixedTrial({**base, "pipeline.prefetch_depth": 1}))
    assert "pipeline.stage_threads" not in shallow and shallow["pipeline.gil_switch_us"] == 0
    in_loop = space.suggest(optuna.trial.FixedTrial({**base, "pipeline.prefetch_depth": 0}))
    assert "pipeline.gil_switch_us" not in in_loop  # no staging threads to take the GIL from


def test_the_baseline_is_the_config_and_comes_first(small_graph):
    config = Config()
    config.set("sampler.threads", 1)
    config.set("pipeline.prefetch_depth", 3)  # not among the usual choices: added, first
    space = space_for("tgat", small_graph, config=config)
    assert space.baseline() == {"sampler.threads": 1, "sampler.reorder": "none",  # no placement: 1 thread
                                "sampler.hop_dedup": config.sampler.hop_dedup,
                                "pipeline.prefetch_depth": 3, "pipeline.stage_threads": 0}
    assert all(len(set(k.choices)) == len(k.choices) for k in space.knobs)
    applied = space.apply(config, space.baseline())
    assert applied.to_dict() == config.to_dict()


def test_neighbors_change_one_knob_each_every_knob_before_any_twice(small_graph, two_cores):
    space = space_for("tgn", small_graph, device="cuda")
    base = space.baseline()
    every = space.neighbors(10_000)
    knobs = {k.name: k for k in space.knobs}
    varied = []
    for params in every:
        changed = [n for n in params if n in base and params[n] != base[n]]
        newly = [n for n in params if n not in base]
        assert len(changed) == 1, params  # one knob of the baseline changed
        varied.append(changed[0])
        # a knob the change makes matter takes its first choice; the rest are the baseline's
        assert all(params[n] == knobs[n].choices[0] for n in newly)
        matter = {}  # a valid trial: every knob that matters given the others, and no other
        for knob in space.knobs:
            if knob.when(matter):
                matter[knob.name] = params[knob.name]
        assert matter == params
        assert space.suggest(optuna.trial.FixedTrial(params))  # one the space accepts
    # none runs as the baseline or another one does: on 2 cores, sampler threads 2 are the
    # baseline's one per core; staging threads 2 are CUDA's default, and 3 run as 2 at depth 2
    keys = {space._runs_as(p) for p in every} | {space._runs_as(base)}
    assert len(keys) == len(every) + 1
    assert not any(p.get("sampler.threads") == 2 or (p.get("pipeline.stage_threads") in (2, 3) and
                                                      p["pipeline.prefetch_depth"] == 2) for p in every)
    assert {2, 3} <= set(knobs["pipeline.stage_threads"].choices) and base["pipeline.prefetch_depth"] == 2
    assert any(p.get("pipeline.stage_threads") == 1 for p in every)
    # every knob varied, once each in the space's order before any knob twice
    firsts = list(dict.fromkeys(varied))
    assert varied[:len(firsts)] == firsts == [n for n in base if len(knobs[n].choices) > 1]
    host = next(p for p in every if p.get("cache.placement") == "host")
    assert host["cache.budget_fraction"] == knobs["cache.budget_fraction"].choices[0]
    assert space.neighbors(3) == every[:3] and space.neighbors(0) == []


def test_knobs_named_first_go_through_their_choices_before_the_rounds(small_graph, two_cores):
    """Under a device-memory limit the study varies the tables' placement first (``first``): the
    baseline may not fit. The other variations follow in the rounds' order, none repeated."""
    space = space_for("tgn", small_graph, device="cuda")
    base, every = space.baseline(), space.neighbors(10_000)
    early = space.neighbors(10_000, first=("cache.placement", "not.a_knob"))
    placement = [p for p in every if p["cache.placement"] != base["cache.placement"]]
    assert [p["cache.placement"] for p in early[:2]] == ["device", "host"] and early[:2] == placement
    assert early[2:] == [p for p in every if p not in placement]
    assert space.neighbors(1, first=("cache.placement",)) == early[:1]
    assert space.neighbors(5, first=()) == every[:5]


def test_a_new_study_runs_the_baseline_then_its_neighbors(small_graph, two_cores, tmp_path, monkeypatch):
    """What the study enqueues: the baseline, then ``tuner.neighbor_share`` of the other trials
    as one-knob variations, in :meth:`SearchSpace.neighbors` order."""
    from fastopt.tuner import study as study_module

    with pytest.raises(ConfigError, match="neighbor_share"):
        bad = Config()
        bad.set("tuner.neighbor_share", 1.5)
        bad.validate()
    config = Config()
    config.set("tuner.neighbor_share", 0.5)
    seen = []

    class NewStudy:  # what the study's creator sees: it stores the context, then enqueues
        def __init__(self):
            self.user_attrs = {}

        def set_user_attr(self, key, value):
            self.user_attrs[key] = value

        def enqueue_trial(self, params, user_attrs):
            seen.append((params, user_attrs[study_module.ROLE], user_attrs.get(study_module.CHANGED)))

    def created(storage, name, seed, on_create, pruner):
        on_create(NewStudy())
        raise RuntimeError("stop once the trials are enqueued")

    monkeypatch.setattr(study_module, "open_study", created)
    with pytest.raises(RuntimeError, match="stop once"):
        study_module.tune(small_graph, "tgn", config, trials=9, storage=str(tmp_path / "s.db"),
                          say=lambda _: None)
    space = space_for("tgn", small_graph)
    base = space.baseline()
    assert seen[0] == (base, "baseline", None)
    assert [(p, role) for p, role, _ in seen[1:]] == [(p, "neighbor") for p in space.neighbors(4)]  # half of 8
    for params, _, changed in seen[1:]:  # named in the trial's line: the knob and its value
        (name,) = [k for k in params if k in base and params[k] != base[k]]
        assert changed == f"{name}={params[name]}"
    seen.clear()  # under a device-memory limit (on a CUDA space): the tables' placement first
    monkeypatch.setattr(study_module, "build_space", lambda *a, **k: space_for("tgn", small_graph, device="cuda"))
    with pytest.raises(RuntimeError, match="stop once"):
        study_module.tune(small_graph, "tgn", config, trials=9, storage=str(tmp_path / "m.db"),
                          max_device_memory=1 << 30, say=lambda _: None)
    cuda = space_for("tgn", small_graph, device="cuda")
    assert [p for p, _, _ in seen[1:]] == cuda.neighbors(4, first=("cache.placement",))
    assert [c for _, _, c in seen[1:3]] == ["cache.placement=device", "cache.placement=host"]


def test_batch_size_only_from_the_list_the_user_allows(small_graph):
    assert "train.batch_size" not in space_for("tgn", small_graph).names
    space = space_for("tgn", small_graph, batch_sizes=[600, 200, 600])
    assert dict((k.name, k.choices) for k in space.knobs)["train.batch_size"] == (200, 600)
    other = space_for("tgn", small_graph, batch_sizes=[100, 300])
    assert dict((k.name, k.choices) for k in other.knobs)["train.batch_size"] == (100, 300)
    single = space_for("tgn", small_graph, batch_sizes=[300])
    assert "train.batch_size" not in single.names and single.fixed == {"train.batch_size": 300}
    assert single.apply(Config(), {}).train.batch_size == 300
    with pytest.raises(ConfigError, match="batch sizes to tune over must be >= 1"):
        space_for("tgn", small_graph, batch_sizes=[200, 0])


def test_a_refused_value_names_the_field(small_graph):
    space = space_for("tgn", small_graph)
    with pytest.raises(ConfigError, match="pipeline.prefetch_depth must be >= 0"):
        space.apply(Config(), {"pipeline.prefetch_depth": -1})


def test_every_candidate_is_a_config_field():
    fields = {f"{group}.{name}" for group, values in Config().to_dict().items() for name in values}
    assert set(knob_fields()) <= fields


# the fused ops of each reference model at the SMALL widths, by op@KxHxd: TGN's attention reads
# 8-wide heads (memory and features), TGAT's and APAN's 4-wide (dim 8, 2 heads); every model
# encodes time (JODIE its mail times only). TGAT's and APAN's key/value encodings are factored out
# of their projections (passes.factor_time_encoding, on by default) and run inside the factored
# attentions, which the report lists as shared_attention sites: one time_encode site fewer per
# attention, the same op and shape
FUSED_OPS = {"tgn": {"temporal_attention@10x2x8": 1, "time_encode@64x1x8": 3},
             "tgat": {"temporal_attention@10x2x4": 2, "time_encode@64x1x8": 2},  # both layers: one shape
             "jodie": {"time_encode@64x1x8": 1},
             "apan": {"temporal_attention@10x2x4": 1, "time_encode@64x1x8": 1}}
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="the kernels' mapping is searched where triton is installed")


@needs_triton
@pytest.mark.parametrize("name", list(SMALL))
def test_cuda_space_searches_the_mapping_per_fused_op(small_graph, name, two_cores):
    """Built for a CUDA device: a knob per mapping field of each fused op at its shape, with
    values that shape can run; the global mapping knobs are not searched."""
    space = space_for(name, small_graph, device="cuda")
    ops = {op.key: op for op in space.context.ops}
    assert {key: len(op.where) for key, op in ops.items()} == FUSED_OPS[name]
    per_op = [k for k in space.knobs if k.name.startswith("kernels.op_overrides[")]
    assert len(per_op) == sum(len(op_choices(op)) for op in ops.values())
    for op in ops.values():
        mine = {k.name.rsplit(".", 1)[1]: k for k in per_op if k.name.startswith(f"kernels.op_overrides[{op.key}].")}
        assert set(mine) == set(op_choices(op)) and set(mine) <= set(OP_OVERRIDE_FIELDS[op.op])
        for field, knob in mine.items():
            assert knob.choices[0] == ("auto" if field == "gather_eviction" else 0)  # the heuristic
            for value in knob.choices[1:]:
                cfg = space.apply(Config(), {knob.name: value})
                with fconfig.patch(kernels__op_overrides=cfg.kernels.op_overrides):
                    mapping = heuristic_config(*op.problem, op=op.op, row_tiles=op.op == "temporal_attention")
                assert getattr(mapping, field) == ("" if value == "none" else value), (knob.name, value)
        if op.op == "temporal_attention":
            heads, dim = op.problem[1:]
            lanes = next_power_of_2(next_power_of_2(heads) * dim)
            assert max(mine["block_m"].choices) * lanes <= max(MAX_SEARCHED_ROW_TILE, lanes)
            assert max(mine["heads_per_program"].choices) == next_power_of_2(heads)
    assert ("kernels.attention_softmax" in space.names) == any(o.op == "temporal_attention" for o in ops.values())
    assert not {"kernels.block_m", "kernels.rows_per_program", "kernels.num_warps"} & set(space.names)


@needs_triton
@pytest.mark.parametrize("name,factorable", [("tgat", True), ("apan", True), ("tgn", False), ("jodie", False)])
def test_time_encoding_factoring_is_searched_where_the_pass_finds_one(small_graph, name, factorable, two_cores):
    """TGAT's and APAN's keys/values carry a time encoding (factorable); TGN's attention goes
    through nn.MultiheadAttention and JODIE has none. Where the kernels run only: on the CPU the
    references would run either way. Finding out leaves the model as it was."""
    model = build_model(name, small_graph, **SMALL[name])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert space_module.time_encoding_factorable(model, small_graph, Config()) == factorable
    assert all(v.equal(before[k]) for k, v in model.state_dict().items()) and not hasattr(model, "fastopt_report")
    space = build_space(model, small_graph, Config(), "cuda")
    knobs = {k.name: k.choices for k in space.knobs}
    assert ("passes.factor_time_encoding" in knobs) == factorable
    if factorable:
        assert knobs["passes.factor_time_encoding"] == ("auto", "off")  # the default first
        assert space.apply(Config(), {"passes.factor_time_encoding": "off"}).passes.factor_time_encoding == "off"
    assert "passes.factor_time_encoding" not in space_for(name, small_graph).names  # CPU


@needs_triton
def test_per_op_values_become_one_op_overrides_value(small_graph, two_cores):
    config = Config()
    config.set("kernels.op_overrides", "temporal_attention@10x2x8:num_warps=4; masked_aggregate@3x1x8:block_k=2")
    space = build_space(build_model("tgn", small_graph, **SMALL["tgn"]), small_graph, config, "cuda")
    knobs = {k.name: k for k in space.knobs}
    warps = "kernels.op_overrides[temporal_attention@10x2x8].num_warps"
    assert knobs[warps].choices[0] == 4  # the config's own entry is the baseline
    baseline = space.baseline()
    assert space.values(baseline)["kernels.op_overrides"] == config.kernels.op_overrides  # unchanged
    assert space.apply(config, baseline).to_dict() == config.to_dict()
    params = {**baseline, warps: 2, "kernels.op_overrides[temporal_attention@10x2x8].block_m": 1,
              "kernels.op_overrides[time_encode@64x1x8].num_stages": 3}
    values = space.suggest(optuna.trial.FixedTrial(params))
    assert not any(name.startswith("kernels.op_overrides[") for name in values)
    assert fconfig.parse_op_overrides(values["kernels.op_overrides"]) == {
        ("temporal_attention", (10, 2, 8)): {"num_warps": 2, "block_m": 1},
        ("time_encode", (64, 1, 8)): {"num_stages": 3},
        ("masked_aggregate", (3, 1, 8)): {"block_k": 2}}  # an entry of an op not found stays
    params[warps] = 0  # the heuristic: the field leaves the entry
    entries = fconfig.parse_op_overrides(space.values(params)["kernels.op_overrides"])
    assert entries[("temporal_attention", (10, 2, 8))] == {"block_m": 1}
    again = space_for("tgn", small_graph, device="cuda")  # another config, the same ops
    assert {op.key for op in again.context.ops} == {op.key for op in space.context.ops}
    other = build_space(build_model("tgn", small_graph, memory_dim=16, dim=16, time_dim=16), small_graph,
                        Config(), "cuda")
    assert {op.key for op in other.context.ops} == {"temporal_attention@10x2x16", "time_encode@64x1x16"}


def test_finding_the_fused_ops_leaves_the_model_as_it_was(small_graph):
    model = build_model("tgat", small_graph, **SMALL["tgat"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ops = space_module.fused_ops(model, small_graph, Config())
    assert [op.key for op in ops] == ["temporal_attention@10x2x4", "time_encode@64x1x8"]
    assert all(v.equal(before[k]) for k, v in model.state_dict().items())
    assert not hasattr(model, "fastopt_report")
    config = Config()
    config.set("passes.fuse_time_encoding", "off")  # the CUDA run would not fuse it: no knobs for it
    assert [op.key for op in space_module.fused_ops(model, small_graph, config)] == ["temporal_attention@10x2x4"]


@pytest.mark.parametrize("op,field,lanes", [
    (space_module.FusedOp("temporal_attention", (10, 3, 100)), "block_m", 512),  # 4 heads' lanes
    (space_module.FusedOp("masked_aggregate", (7, 1, 172)), "block_k", 256),
    (space_module.FusedOp("time_encode", (64, 1, 172)), "block_k", 256),
    (space_module.FusedOp("time_encode", (64, 1, 2000)), "block_k", 2048),
])
def test_tile_choices_stay_within_the_register_tile(op, field, lanes):
    choices = op_choices(op)[field]
    assert choices and max(choices) * lanes <= (MAX_SEARCHED_ROW_TILE if field == "block_m" else MAX_TILE)
    assert all(c & (c - 1) == 0 for c in choices)
    if op.op == "temporal_attention":
        assert op_choices(op)["heads_per_program"] == (1, 2, 4)  # up to H = 3, a power of two


@pytest.mark.parametrize("problem,top", [((10, 2, 100), 8), ((10, 2, 50), 16), ((10, 1, 4000), 1)])
def test_attention_row_tiles_searched_stop_where_h200_studies_never_finished_one(problem, top):
    """TGN's (d=100) and TGAT's (d=50) attention: row tiles up to 2,048 elements; a row wider
    than that keeps one row a tile."""
    assert op_choices(space_module.FusedOp("temporal_attention", problem))["block_m"] == tuple(
        1 << i for i in range(top.bit_length()))
