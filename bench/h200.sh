#!/usr/bin/env bash
# One device call that installs fastopt and records the GPU benchmarks and tests:
#   FASTOPT_GIT_COMMIT=<commit> OUT=<dir> bash bench/h200.sh
# Name the commit literally: the tree copied onto a GPU machine may carry a stale .git, so
# $(git rev-parse HEAD) evaluated there can name an older commit than the one that runs.
# Logs and JSON go to $OUT (gputests.log, kernels.*, optimize.*); each step has its own time limit
# (TESTS_S, KERNELS_S, OPTIMIZE_S, BREAKDOWN_S, PROJECTIONS_S seconds) so that a slow step cannot
# take the others' results with it. MAPPINGS: the thread mappings bench/kernels.py also times.
# The GPU tests compile every kernel variant they cover (about 5 minutes at ff78491, more since):
# run STEPS=tests as a call of its own (TESTS: the test paths, default all). PROFILE=1 also writes torch.profiler tables of the eager and
# fastopt steps (profiles.tar.gz). STEPS picks the steps (default "tests kernels optimize"; also
# "breakdown" (bench/step_breakdown.py) and "projections" (bench/projections.py)): one device
# command may run 10 minutes, so split them over calls. The end-to-end steps: "bench" (fastopt
# bench for TGAT and TGN, CONTENDERS per model, then each model's fastopt again in a second process
# for the first epoch with the kernel cache warm; bench.log, bench-*.json), "accuracy"
# (bench/accuracy.py, 10 epochs x SEEDS x VARIANTS (eager fastopt); accuracy.{log,json})
# and "pyg" (bench/pyg_tgn.py; pyg.{log,json}; PYG_EPOCHS (5), SEEDS (0 1 2), PYG_CONTROL= to leave out
# the control runs); "pygconv": its layer check and timing only;
# "pygap": its layer timing and AP study only. "tune": fastopt tune for each of TUNE_MODELS
# (tgn tgat) on each of TUNE_DATASETS (wikipedia; email-eu-core, the other shipped graph; or a path
# carried in a git-ignored folder), TRIALS trials (40) in one SQLite file, records to $OUT/records (--max-device-memory
# MAX_MEMORY_GB when set), then fastopt bench of fastopt and fastopt-tuned side by side per pair
# (tune.log, tuned-*.json; --interleave); each study under TUNE_S seconds (900); LIMIT_STUDY: one of them again
# under a device-memory limit below its baseline's peak (see the step). The tuner needs optuna there:
# carry its wheels (device README) in ../.whl (or WHEELS): this script installs them apart. "scale": a
# GDELT-like graph of SCALE_EVENTS (50 M) events synthesized on the machine (SCALE_DIR, ~39 GB at
# 50 M), then fastopt bench of TGN at batch 4,000, features on the host through a device cache of
# SCALE_BUDGET (0.1) of their bytes (scale.{log,json}: events/s, bytes moved, peak host and device
# memory, test AP). "host": fastopt bench of tgl, fastopt and fastopt-host per model (features in
# host memory through SlimCache; host.log, host-*.json, each under HOST_S seconds) and
# bench/slimcache.py --device cuda (slimcache.{log,json}: each read path's wall-clock beside the
# naive path and all on the device, under SLIMCACHE_S). Bench epochs:
# BENCH_EPOCHS (4: the steady figure is the median of three, which one slow epoch cannot move).
# "host" also runs TGN's fastopt and fastopt-host under each of HOST_VARIANTS (env settings, e.g.
# "FASTOPT_PIPELINE_GIL_SWITCH_US=250 FASTOPT_PIPELINE_GIL_SWITCH_US=1000"); SKIP_SLIMCACHE=1 skips its slimcache run.
# HOST_MODELS: the host step's models (tgn tgat). INTERLEAVE=1: the host step's benches let the contenders' epochs take turns (--interleave).
# "hostprof": bench/epoch_profile.py --model tgn under each placement, device and host
# (profile-{device,host}.log: device idle gaps, CUDA API host time per thread; each under HOSTPROF_S seconds). TUNE_DB resumes the tune step's studies.
# "factor": TGAT's epoch with passes.factor_time_encoding off and auto, profiled (bench/epoch_profile.py;
# profile-tgat-factor-{off,auto}.log, each under FACTOR_S seconds, 150: the check against eager and the
# profiled epoch take over 80 s). "launch": bench/graph_launch.py for each model (graph-launch-*.{log,json}).
# "window": bench/tune_window.py per WINDOW_MODELS (see the step). "pipe": epochs as fit runs them
# per placement, with the threads' seconds (bench/epoch_profile.py --pipeline; PIPE_VARIANTS: env
# settings each run the same way, see the step).
# "readcost": bench/read_cost.py for TGN: each edge-feature read path's kernel time per batch
# (device table, zero-copy through a hot set of 0, 10 and 100 % of the rows; with the per-slot
# expansion too; readcost.{log,json}, under READCOST_S seconds).
# A call returns at most 8 files from OUT: give steps that write many their own call.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to the output folder}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/env.log" 2>&1
python3 -m pip install -q --no-build-isolation --no-deps -e . >> "$OUT/env.log" 2>&1 || { tail "$OUT/env.log"; exit 1; }
# WHEELS (default ../.whl, where a carried folder of wheels lands beside the tree): optuna and its
# dependencies, which the machine lacks, installed apart and put on PYTHONPATH (the tuner's tests
# and the tune step need them; without them tests/tuner fails to collect)
if compgen -G "${WHEELS:-../.whl}/*.whl" > /dev/null; then
    python3 -m pip install -q --no-deps --target /tmp/fastopt-wheels "${WHEELS:-../.whl}"/*.whl >> "$OUT/env.log" 2>&1
    export PYTHONPATH="/tmp/fastopt-wheels${PYTHONPATH:+:$PYTHONPATH}"
fi
STEPS=${STEPS:-tests kernels optimize}
# tests: TEST_WORKERS processes (6: the whole suite in about 150 s at 3caab7a); each failure is
# written to failures.txt as it happens (bench/pytest_failures.py), a cut run included
[[ " $STEPS " == *" tests "* ]] && PYTHONPATH="bench${PYTHONPATH:+:$PYTHONPATH}" timeout "${TESTS_S:-540}" \
    python3 -m pytest -q -m gpu ${TESTS:-tests} -n "${TEST_WORKERS:-6}" -p pytest_failures -p no:cacheprovider -ra \
    > "$OUT/gputests.log" 2>&1
[[ " $STEPS " == *" kernels "* ]] && timeout "${KERNELS_S:-170}" python3 bench/kernels.py --rows 18000 36000 --iters 20 --warmup 3 \
    --json "$OUT/kernels.json" --mappings ${MAPPINGS:-block_m=2 block_m=2,attention_softmax=online num_warps=2 gather_eviction=none} > "$OUT/kernels.log" 2>&1
[[ " $STEPS " == *" optimize "* ]] && timeout "${OPTIMIZE_S:-240}" python3 bench/optimize.py --models tgat,tgn --iters 30 --warmup 5 \
    --json "$OUT/optimize.json" ${PROFILE:+--profile /tmp/profiles} > "$OUT/optimize.log" 2>&1
[ -n "${PROFILE:-}" ] && tar czf "$OUT/profiles.tar.gz" -C /tmp profiles
[[ " $STEPS " == *" breakdown "* ]] && timeout "${BREAKDOWN_S:-90}" python3 bench/step_breakdown.py \
    --json "$OUT/breakdown.json" > "$OUT/breakdown.log" 2>&1
[[ " $STEPS " == *" projections "* ]] && timeout "${PROJECTIONS_S:-240}" python3 bench/projections.py \
    --json "$OUT/projections.json" > "$OUT/projections.log" 2>&1
if [[ " $STEPS " == *" bench "* ]]; then
    for m in tgat tgn; do
        c=${CONTENDERS:-eager,fastopt}; [ "$m" = tgn ] && c=${TGN_CONTENDERS:-eager,pyg,fastopt}
        timeout "${BENCH_S:-130}" fastopt bench --model $m --batch-size 600 --epochs "${BENCH_EPOCHS:-4}" --contenders "$c" \
            --no-progress --json "$OUT/bench-$m.json" >> "$OUT/bench.log" 2>&1
    done
    for m in tgn tgat; do  # a new process: kernel cache and shape plans warm
        timeout "${WARM_S:-40}" fastopt bench --model $m --batch-size 600 --epochs 2 --contenders fastopt \
            --no-progress --json "$OUT/bench-$m-warm.json" >> "$OUT/bench.log" 2>&1
    done
fi
if [[ " $STEPS " == *" tune "* ]]; then
    # TUNE_DB: a tune.db an earlier call returned (carried in a git-ignored folder): its studies
    # resume where they stopped, so that one study can span calls of 10 minutes
    [ -n "${TUNE_DB:-}" ] && cp "$TUNE_DB" "$OUT/tune.db"
    # TUNE_SYNTH=N: a GDELT-like graph of N events (186-d edge features, which then dominate the
    # device footprint) synthesized to /tmp/gdelt-tune first: name it in TUNE_DATASETS and in
    # LIMIT_DATASET (its studies are "<model>-gdelt-tune")
    if [ -n "${TUNE_SYNTH:-}" ]; then
        rm -rf /tmp/gdelt-tune /tmp/.gdelt-tune.*.tmp
        timeout "${SYNTH_S:-120}" fastopt data synth --like gdelt --events "$TUNE_SYNTH" --out /tmp/gdelt-tune \
            >> "$OUT/tune.log" 2>&1
    fi
    for d in ${TUNE_DATASETS:-wikipedia}; do
        for m in ${TUNE_MODELS:-tgn tgat}; do
            # the study's own --timeout (which cuts a running trial where the confirmation's time
            # begins) ends 30 s before this step's, for the start and the record; a study cut by
            # the step's timeout is exported from its storage all the same (fastopt export reads
            # unfinished studies)
            study="$m-$(basename "$d" | cut -d. -f1)"
            timeout "${TUNE_S:-900}" fastopt tune --dataset "$d" --model $m --batch-size 600 --edge-dim 172 \
                --trials "${TRIALS:-40}" --timeout "$(( ${TUNE_S:-900} - 30 ))" --storage "sqlite:///$OUT/tune.db" \
                --study-name "$study" --out "$OUT/records" ${MAX_MEMORY_GB:+--max-device-memory "$MAX_MEMORY_GB"} \
                --no-progress >> "$OUT/tune.log" 2>&1
            timeout 60 fastopt export --storage "sqlite:///$OUT/tune.db" --study-name "$study" --out "$OUT/records" \
                >> "$OUT/tune.log" 2>&1
            FASTOPT_TUNER_RECORDS_DIR="$OUT/records" timeout "${BENCH_S:-130}" fastopt bench --dataset "$d" --model $m \
                --batch-size 600 --edge-dim 172 --epochs "${BENCH_EPOCHS:-4}" --contenders fastopt,fastopt-tuned --interleave \
                --no-progress --json "$OUT/tuned-$m-$(basename "$d" | cut -d. -f1).json" >> "$OUT/tune.log" 2>&1
        done
    done
    if [ -n "${LIMIT_STUDY:-}" ]; then
        # study LIMIT_STUDY (one of the above, "model-dataset") again under a device-memory limit
        # LIMIT_BELOW_MB (24; TGN wikipedia's features on the host save about 50 MiB) below its
        # baseline trial's peak (the all-on-device footprint), with
        # LIMIT_TRIALS trials under LIMIT_S seconds; its record goes to records-limited (not shipped)
        # (LIMIT_GB: the limit itself, for a call that does not run the base study: e.g. the
        # baseline peak an earlier call's DB records, less LIMIT_BELOW_MB; LIMIT_DATASET: the
        # study's dataset where it is a path, e.g. /tmp/gdelt-tune)
        gb=${LIMIT_GB:-}
        [ -n "$gb" ] || gb=$(python3 - "$OUT/tune.db" "$LIMIT_STUDY" "${LIMIT_BELOW_MB:-24}" <<'PY'
import sys, optuna
study = optuna.load_study(study_name=sys.argv[2], storage=f"sqlite:///{sys.argv[1]}")
base = next(t for t in study.trials if t.user_attrs.get("role") == "baseline")
peak = base.user_attrs["peak_device_bytes"]  # reserved bytes since 66007ed (allocated before)
print(f"{(peak - int(sys.argv[3]) * 2**20) / 2**30:.4f}")
print(f"{sys.argv[2]}: baseline peak {peak / 2**30:.4f} GiB", file=sys.stderr)
PY
        )
        echo "limited study: $LIMIT_STUDY under ${gb} GB" | tee -a "$OUT/tune.log"
        timeout "${LIMIT_S:-200}" fastopt tune --dataset "${LIMIT_DATASET:-${LIMIT_STUDY#*-}}" --model "${LIMIT_STUDY%%-*}" --batch-size 600 \
            --edge-dim 172 --trials "${LIMIT_TRIALS:-16}" --timeout "$(( ${LIMIT_S:-200} - 30 ))" \
            --storage "sqlite:///$OUT/tune.db" --study-name "$LIMIT_STUDY-limited" --out "$OUT/records-limited" \
            --max-device-memory "$gb" --no-progress >> "$OUT/tune.log" 2>&1
        python3 - "$OUT/tune.db" "$LIMIT_STUDY" >> "$OUT/tune.log" 2>&1 <<'PY'
import sys, optuna
for name in (sys.argv[2], sys.argv[2] + "-limited"):
    if name not in optuna.get_all_study_names(f"sqlite:///{sys.argv[1]}"):
        continue
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{sys.argv[1]}")
    for t in study.trials:
        v = t.user_attrs.get("values", {})
        peak = t.user_attrs.get("peak_device_bytes")
        print(name, t.number, t.state.name, None if t.value is None else round(t.value, 4),
              None if peak is None else round(peak / 2**30, 4), v.get("cache.placement"),
              v.get("cache.budget_fraction"), (t.user_attrs.get("failure") or t.user_attrs.get("pruned") or "")[:90])
PY
    fi
    grep -E "^(fastopt|fastopt-tuned) |tuned record|no tuning record|best" "$OUT/tune.log"
fi
if [[ " $STEPS " == *" scale "* ]]; then
    # a GDELT-like graph of SCALE_EVENTS events (186-d features) written to SCALE_DIR, then TGN at
    # batch 4,000 with the features on the host and a device cache of SCALE_BUDGET of their bytes
    # (a synth cut by its time limit leaves its files in a hidden .NAME.*.tmp folder beside DIR)
    g=${SCALE_DIR:-/tmp/gdelt-scale}; rm -rf "$g" "$(dirname "$g")/.$(basename "$g")".*.tmp
    { df -h "$(dirname "$g")"; free -g; } > "$OUT/scale.log" 2>&1
    timeout "${SYNTH_S:-240}" fastopt data synth --like gdelt --events "${SCALE_EVENTS:-50000000}" --out "$g" \
        >> "$OUT/scale.log" 2>&1 &&
    FASTOPT_CACHE_PLACEMENT=host FASTOPT_CACHE_BUDGET_FRACTION=${SCALE_BUDGET:-0.1} timeout "${SCALE_S:-330}" \
        fastopt bench --dataset "$g" --model tgn --batch-size 4000 --epochs "${SCALE_EPOCHS:-2}" --contenders fastopt \
        --json "$OUT/scale.json" >> "$OUT/scale.log" 2>&1  # progress bars: a run cut short still shows its rate
    rm -rf "$g" "$(dirname "$g")/.$(basename "$g")".*.tmp
    tail -5 "$OUT/scale.log"
fi
if [[ " $STEPS " == *" pipe "* ]]; then
    # PIPE_EPOCHS (3) of PIPE_MODELS (tgn) as fit runs them, under each placement, nothing
    # profiled (bench/epoch_profile.py --pipeline): the staging threads' and the training
    # thread's seconds per epoch, where the host path's extra time is spent (pipe-*.log; the
    # steady epochs' lines printed). PIPE_VARIANTS: VAR=VALUE[,VAR=VALUE] settings, each run
    # the same way after the defaults (pipe-<model>-<placement>-vN.log)
    n=0
    for v in "" ${PIPE_VARIANTS:-}; do
        tag=${v:+-v$n}; n=$((n + 1))
        [ -n "$v" ] && echo "== pipe ${tag#-}: $v"
        for m in ${PIPE_MODELS:-tgn}; do
            for p in device host; do
                env ${v//,/ } FASTOPT_CACHE_PLACEMENT=$p timeout "${PIPE_S:-60}" python3 bench/epoch_profile.py \
                    --model $m --pipeline "${PIPE_EPOCHS:-3}" > "$OUT/pipe-$m-$p$tag.log" 2>&1
                grep -E "^epoch" "$OUT/pipe-$m-$p$tag.log" | tail -n +2 | sed "s/^/$m $p /" | cut -c1-400
            done
        done
    done
fi
if [[ " $STEPS " == *" hostprof "* ]]; then
    # one profiled TGN epoch per placement (device tables, then features on the host through
    # SlimCache): device idle time and its longest gaps, with when each began (profile-*.log)
    for p in device host; do
        FASTOPT_CACHE_PLACEMENT=$p timeout "${HOSTPROF_S:-60}" python3 bench/epoch_profile.py --model tgn \
            --rows 12 > "$OUT/profile-$p.log" 2>&1
        echo "== $p"; grep -E "^(warm-up|profiled)" "$OUT/profile-$p.log"; grep -A12 "^device idle" "$OUT/profile-$p.log"
        grep -A15 "^CUDA API" "$OUT/profile-$p.log"
    done
fi
if [[ " $STEPS " == *" readcost "* ]]; then
    timeout "${READCOST_S:-90}" python3 bench/read_cost.py --model tgn --budgets 0 0.1 1 \
        --json "$OUT/readcost.json" > "$OUT/readcost.log" 2>&1
    grep -vE "Warning|return TemporalSampler" "$OUT/readcost.log"
fi
if [[ " $STEPS " == *" factor "* ]]; then
    for f in off auto; do
        FASTOPT_PASSES_FACTOR_TIME_ENCODING=$f timeout "${FACTOR_S:-150}" python3 bench/epoch_profile.py --model tgat \
            --rows 30 > "$OUT/profile-tgat-factor-$f.log" 2>&1
        echo "== factor $f"; grep -E "^(warm-up|profiled|WRONG)" "$OUT/profile-tgat-factor-$f.log"
    done
fi
if [[ " $STEPS " == *" launch "* ]]; then
    for m in tgn tgat; do
        timeout 70 python3 bench/graph_launch.py --model $m --json "$OUT/graph-launch-$m.json" > "$OUT/graph-launch-$m.log" 2>&1
    done
fi
if [[ " $STEPS " == *" window "* ]]; then
    # the tuner's trial window against the trained epochs, per model (bench/tune_window.py;
    # window-M.{log,json}); WINDOW_NOPLAN=1 also without the shape plan (window-M-noplan.log,
    # with WINDOW_PROFILE cProfile rows of its first window)
    for m in ${WINDOW_MODELS:-tgat tgn}; do
        timeout "${WINDOW_S:-120}" python3 bench/tune_window.py --model $m --json "$OUT/window-$m.json" \
            > "$OUT/window-$m.log" 2>&1
        [ -n "${WINDOW_NOPLAN:-}" ] && timeout "${WINDOW_S:-120}" python3 bench/tune_window.py --model $m --no-plan \
            --profile "${WINDOW_PROFILE:-0}" > "$OUT/window-$m-noplan.log" 2>&1
        grep -hE "^(window|epoch|WRONG|tgn|tgat)" "$OUT/window-$m.log" "$OUT/window-$m-noplan.log" 2>/dev/null
    done
fi
[[ " $STEPS " == *" accuracy "* ]] && FASTOPT_SAMPLER_THREADS=2 timeout "${ACCURACY_S:-300}" python3 bench/accuracy.py \
    --datasets wikipedia --seeds ${SEEDS:-0 1 2} --variants ${VARIANTS:-eager fastopt} --jobs "${JOBS:-12}" \
    --json "$OUT/accuracy.json" -- --batch-size 600 --edge-dim 172 --mrr-negatives 0 > "$OUT/accuracy.log" 2>&1
[[ " $STEPS " == *" pyg "* ]] && timeout "${PYG_S:-480}" python3 bench/pyg_tgn.py --device cuda --epochs "${PYG_EPOCHS:-5}" \
    ${PYG_CONTROL---control} --seeds ${SEEDS:-0 1 2} --iters 200 --warmup 20 --json "$OUT/pyg.json" > "$OUT/pyg.log" 2>&1
# pygconv: the layer check and timing alone (pygconv.{log,json})
[[ " $STEPS " == *" pygconv "* ]] && timeout "${PYGCONV_S:-120}" python3 bench/pyg_tgn.py --device cuda --skip-epochs \
    --iters 200 --warmup 20 --json "$OUT/pygconv.json" > "$OUT/pygconv.log" 2>&1
# pygap: the layer check and timing, then the AP study: AP_SEEDS (24 seeds) x 3 contenders, 5 epochs,
# PYG_JOBS (8) processes at a time (pygap.{log,json}); AP_MERGE: earlier calls' pygap.json or logs to add
# (24 seeds take two calls of ~8 minutes at PYG_JOBS=12); AP_LABELS: the contenders to train (default
# all three: pyg fastopt pyg-control), each paired with PyG's runs here or merged; PYGAP_ITERS: layer timing steps
[[ " $STEPS " == *" pygap "* ]] && timeout "${PYGAP_S:-540}" python3 bench/pyg_tgn.py --device cuda --epochs 5 \
    --skip-epochs --iters "${PYGAP_ITERS:-200}" --warmup 20 --ap-seeds ${AP_SEEDS:-$(seq 0 23)} --jobs "${PYG_JOBS:-8}" ${AP_MERGE:+--ap-merge $AP_MERGE} \
    ${AP_LABELS:+--ap-labels $AP_LABELS} \
    --json "$OUT/pygap.json" > "$OUT/pygap.log" 2>&1
if [[ " $STEPS " == *" host "* ]]; then
    # features in host memory through SlimCache (a budget of cache.budget_fraction, 0.1 by default)
    # beside the device tables and TGL's path, per model; then the cache alone, per read path
    for m in ${HOST_MODELS:-tgn tgat}; do
        timeout "${HOST_S:-100}" fastopt bench --model $m --batch-size 600 --epochs "${BENCH_EPOCHS:-4}" \
            --contenders tgl,fastopt,fastopt-host ${INTERLEAVE:+--interleave} --no-progress --json "$OUT/host-$m.json" >> "$OUT/host.log" 2>&1
    done
    # HOST_VARIANTS: space-separated VAR=VALUE[,VAR=VALUE] settings; TGN's fastopt and fastopt-host
    # again under each, one bench per setting (host-tgn-vN.json), so that a knob is judged by the
    # same-run ratio
    n=0
    for v in ${HOST_VARIANTS:-}; do
        n=$((n + 1)); echo "== v$n: $v" >> "$OUT/host.log"
        env ${v//,/ } timeout "${HOST_S:-100}" fastopt bench --model tgn --batch-size 600 --epochs "${BENCH_EPOCHS:-4}" \
            --contenders fastopt,fastopt-host ${INTERLEAVE:+--interleave} --no-progress --json "$OUT/host-tgn-v$n.json" >> "$OUT/host.log" 2>&1
    done
    [ -n "${SKIP_SLIMCACHE:-}" ] || \
    timeout "${SLIMCACHE_S:-90}" python3 bench/slimcache.py --device cuda --datasets wikipedia --budgets 0.1 \
        --policies future static zero_copy --negatives destinations --layout fastopt \
        --json "$OUT/slimcache.json" > "$OUT/slimcache.log" 2>&1
    grep -E "^(==|tgl|fastopt|fastopt-host) " "$OUT/host.log"; grep -sE "edge_feat|WRONG" "$OUT/slimcache.log"
fi
[ -f "$OUT/bench.log" ] && grep -E "^(eager|tgl|pyg|compile|fastopt) " "$OUT/bench.log"
[ -f "$OUT/accuracy.log" ] && tail -16 "$OUT/accuracy.log"
[ -f "$OUT/pyg.log" ] && tail -12 "$OUT/pyg.log"
[ -f "$OUT/pygconv.log" ] && grep -E "^(TransformerConv|model)" "$OUT/pygconv.log"
[ -f "$OUT/pygap.log" ] && grep -E "^(TransformerConv|model| )" "$OUT/pygap.log"
[ -f "$OUT/kernels.log" ] && { grep -A30 "graph replay" "$OUT/kernels.log"
                               grep -B1 -A12 "copy bandwidth" "$OUT/kernels.log" | head -8; }
[ -f "$OUT/optimize.log" ] && tail -12 "$OUT/optimize.log"
[ -f "$OUT/breakdown.log" ] && tail -3 "$OUT/breakdown.log"
[ -f "$OUT/projections.log" ] && tail -12 "$OUT/projections.log"
[ -f "$OUT/gputests.log" ] && tail -4 "$OUT/gputests.log"
[ -f "$OUT/failures.txt" ] && grep "^===" "$OUT/failures.txt"
true
