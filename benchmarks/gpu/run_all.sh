#!/usr/bin/env bash
# The GPU check and benchmark of grpo_fast in one command that ends inside 9 minutes.
#
#   bash benchmarks/gpu/run_all.sh            # CUDA: checks first, then every timing; results in $OUT
#   bash benchmarks/gpu/run_all.sh --dry-run  # CPU: the same code paths on tiny shapes (Triton interpreter)
#
# Made for the GPU machine's image as it is: `python3` only (there is no `python`), the
# project from PYTHONPATH (nothing is installed), no network. Liger-Kernel comes from a
# carried wheel folder .whl/ when there is one (benchmarks/gpu/README.md), else its rows
# say "not available"; so do TRL and its dependencies, else the trainer step's TRL rows say
# "skipped". Each stage has a time budget and the run a deadline: a stage over
# its budget is cut and reported, and the next one still runs. At most 8 files in $OUT:
#   run_all.log  stages.json  kernels_check.json  kernels_time.json  kernels_sweep.json
#   fused_linear_gpu.json  trainer_step_gpu.json  pytest_benchmark.json
# (a dry run names the JSON *_dryrun.json and writes to a temporary folder unless OUT is set).
set -uo pipefail
cd "$(dirname "$0")/../.."

DRY=""
if [ "${1:-}" = "--dry-run" ]; then DRY="--dry-run"; fi
OUT="${OUT:-$([ -n "$DRY" ] && mktemp -d || echo benchmarks/results)}"
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec > >(tee -a "$OUT/run_all.log") 2>&1

TOTAL_S=${TOTAL_S:-530}  # 8 min 50 s: the whole run, inside the device call's 10-minute limit
START=$(date +%s)
DEADLINE=$((START + TOTAL_S))
STAGES=()
status=0

if ls .whl/*.whl >/dev/null 2>&1; then
    if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
        export PYTHONPATH="$PYTHONPATH:/tmp/site"
        echo "installed the carried wheels into /tmp/site: $(ls .whl)"
    else
        echo "NOTE: the carried wheels in .whl/ did not install; Liger-Kernel and TRL rows will be skipped"
    fi
else
    echo "NOTE: no .whl/ folder carried: Liger-Kernel and TRL are not installed here, their rows will be skipped"
fi
python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv

write_stages() {
    local IFS=,
    printf '{"dry_run": %s, "total_budget_s": %d, "elapsed_s": %d, "stages": [%s]}\n' \
        "$([ -n "$DRY" ] && echo true || echo false)" "$TOTAL_S" "$(($(date +%s) - START))" "${STAGES[*]}" \
        >"$OUT/stages.json"
}

# stage NAME BUDGET_S COMMAND...: runs COMMAND under `timeout`, within the run's deadline.
# The command gets --budget-s (a little less than its budget) when it takes one, so that it
# stops starting new rows and saves its JSON before it would be cut.
stage() {
    local name=$1 budget=$2
    shift 2
    local left=$((DEADLINE - $(date +%s) - 5))
    if [ "$budget" -gt "$left" ]; then budget=$left; fi
    if [ "$budget" -lt 15 ]; then
        echo "=== $name: skipped, the run's deadline leaves ${left} s"
        STAGES+=("{\"stage\": \"$name\", \"result\": \"skipped: deadline\", \"seconds\": 0}")
        status=1
        write_stages
        return
    fi
    echo "=== $name (budget ${budget} s)"
    local t0 rc result
    t0=$(date +%s)
    timeout --signal=TERM --kill-after=10 "$budget" "$@"
    rc=$?
    case $rc in
        0) result="ok" ;;
        124 | 137) result="cut at its ${budget} s budget" ;;
        *) result="failed (exit $rc)" ;;
    esac
    if [ "$rc" -ne 0 ]; then status=1; fi
    echo "=== $name: $result after $(($(date +%s) - t0)) s"
    STAGES+=("{\"stage\": \"$name\", \"result\": \"$result\", \"seconds\": $(($(date +%s) - t0)), \"budget_s\": $budget}")
    write_stages
}

kernels() {  # kernels STAGE BUDGET
    stage "kernels $1" "$2" python3 benchmarks/gpu/bench_kernels.py --stage "$1" $DRY --out "$OUT" --budget-s $(($2 - 20))
}

suffix=$([ -n "$DRY" ] && echo dryrun || echo gpu)
kernels check 80
kernels time 140
kernels sweep 80
stage "fused linear" 60 python3 benchmarks/gpu/bench_fused_linear.py $DRY --out "$OUT/fused_linear_$suffix.json"
# The loss paths, then grpo_fast against TRL (with vLLM where the image has it; TRL from the
# carried wheels): each engine's row in trainer_step_*.json, or why it was skipped.
stage "trainer step" 100 python3 benchmarks/gpu/bench_trainer_step.py $DRY --steps 2 --budget-s 90 \
    --out "$OUT/trainer_step_$suffix.json"
# torch.compile is timed by the time stage; compiling it again here would not fit (nor, in a
# dry run, prove anything the CUDA run does).
if [ -n "$DRY" ]; then
    bench_args=(--bench-device cpu --bench-shape tiny --benchmark-min-rounds 1 --benchmark-max-time 0.001 --benchmark-warmup off)
else
    bench_args=(--bench-device cuda --bench-shape full --benchmark-min-rounds 3 --benchmark-max-time 0.1)
fi
bench_args+=(-k "not compiled")
stage "pytest-benchmark" 50 python3 -m pytest benchmarks/ --benchmark-only -q -p no:cacheprovider \
    --benchmark-json "$OUT/pytest_benchmark${DRY:+_dryrun}.json" "${bench_args[@]}"
# GRPO against PPO in memory at Qwen2.5-0.5B's shape (all 24 layers, vocabulary 151936; PPO
# about 17 GB): each configuration in a fresh process, its peak torch.cuda.max_memory_allocated.
# The table and every configuration's JSON line go to run_all.log (no file: 8 at most).
if [ -n "$DRY" ]; then memory_args=(--preset tiny --device cpu --repeats 1); else memory_args=(--preset qwen2.5-0.5b); fi
stage "memory" 90 python3 -m grpo_fast.bench.memory "${memory_args[@]}" \
    --configs ppo grpo_eager grpo_fused grpo_fused_linear
# Long completions (issue 50): the checkpointing and the MLP tiles on CUDA, against one process's
# gradient (float64, bit for bit; tests/test_checkpoint_runs.py and test_mlp_tiles.py, their cuda
# cases), then Qwen2.5-0.5B's shape, G = 4, prompts of 256, at 2K and 8K completion tokens: HF's
# checkpointing against one layer input in three, the MLPs in tiles of 1,024 and the kept inputs
# offloaded to pinned host memory, each point a fresh process, its peak allocated bytes and step.
# Tables to run_all.log (no file: 8 at most); the CPU side of it is the suite's.
if [ -z "$DRY" ]; then
    stage "long context" 120 bash -c 'GRPO_FAST_TEST_CUDA=1 python3 -m pytest tests/test_checkpoint_runs.py \
        tests/test_mlp_tiles.py -q -p no:cacheprovider -k cuda \
        && python3 benchmarks/bench_long_context.py --device cuda --models qwen2.5-0.5b --trainers grpo_fast \
            --checkpointing on --lengths 2048 8192 --time-cap-s 60 --json /tmp/long_gpu_on.json \
        && python3 benchmarks/bench_long_context.py --device cuda --models qwen2.5-0.5b --trainers grpo_fast \
            --checkpointing every3 --mlp-tile-tokens 1024 --offload on --lengths 2048 8192 --time-cap-s 60 \
            --include /tmp/long_gpu_on.json --json /tmp/long_gpu.json'
fi
# When the image has vLLM: the demo trained with --generator vllm (rollouts, in-memory weight sync,
# sampling correction); its summary and last metrics line go to run_all.log (no file: 8 at most).
if [ -z "$DRY" ] && python3 -c "import vllm" >/dev/null 2>&1; then
    stage "vllm rollouts" 90 bash -c 'python3 -m grpo_fast train --generator vllm --steps 40 --no-progress \
        --vllm-gpu-memory-utilization 0.2 --output-dir /tmp/vllm_run && tail -n 1 /tmp/vllm_run/metrics.jsonl'
fi
# Last, in what the budgets above leave (at least 20 s): the CUDA side of the torchrun trainer.
stage "torchrun" 60 bash benchmarks/gpu/check_torchrun.sh

echo "=== done in $(($(date +%s) - START)) s; results in $OUT: $(ls "$OUT" | tr '\n' ' ')"
if [ "$(ls "$OUT" | wc -l)" -gt 8 ]; then
    echo "WARNING: more than 8 files in $OUT: the device tool brings back only 8"
    status=1
fi
exit "$status"
