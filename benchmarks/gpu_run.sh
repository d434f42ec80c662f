#!/usr/bin/env bash
# Everything this project checks on a GPU machine, in one bounded run (issue 19, "GPU").
#
# Run from the repository root with $OUT set (the device tool sets it; elsewhere it defaults to
# ./gpu_out), after copying the wheels of what the machine lacks into .whl/ (see
# docs/benchmarks.md, "GPU"):
#
#     bash benchmarks/gpu_run.sh
#
# Steps, each bounded by `timeout` and by what is left of GPU_RUN_BUDGET (seconds, default 420);
# a failing step does not stop the later ones:
#   1. install .whl/*.whl into /tmp/site; nvidia-smi, versions, memory, file systems  -> env.log
#   2. the CUDA tests (tests/test_cuda.py, test_cuda_snapshot.py, test_cuda_paths.py)   -> tests.log
#   3. benchmarks/gpu_bench.py on a tmpfs (/dev/shm)                                    -> bench_shm.log, .json
#   4. benchmarks/exit_stress.py, a few runs per case, if it exists                     -> exit_stress.log
#   5. benchmarks/gpu_bench.py on a disk directory                                      -> bench_disk.log, .json
#   6. a summary: each step's exit status and time, then the tables                    -> summary.log
# At most 8 files come back from $OUT: these are 8.
#
# Knobs (environment): GPU_RUN_BUDGET, GPU_BENCH_GIB (per rank on tmpfs, default 4),
# GPU_BENCH_DISK_GIB (default 2), GPU_BENCH_REPEATS (default 2), GPU_BENCH_DISK_REPEATS (default 1),
# GPU_BENCH_RANKS (default 2), GPU_BENCH_DISK (default /var/tmp/ckpt_gpu_bench),
# EXIT_STRESS_ARGS (default "--runs 1 --cases save async_destroy async_exit": about 6 s a run there),
# GPU_BENCH_ARGS (extra arguments for both benchmark runs).

set -u
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
BUDGET=${GPU_RUN_BUDGET:-420}
GIB=${GPU_BENCH_GIB:-4}
DISK_GIB=${GPU_BENCH_DISK_GIB:-2}
REPEATS=${GPU_BENCH_REPEATS:-2}
DISK_REPEATS=${GPU_BENCH_DISK_REPEATS:-1}
RANKS=${GPU_BENCH_RANKS:-2}
DISK=${GPU_BENCH_DISK:-/var/tmp/ckpt_gpu_bench}
EXIT_ARGS=${EXIT_STRESS_ARGS:---runs 1 --cases save async_destroy async_exit}
EXTRA=${GPU_BENCH_ARGS:-}
SUMMARY="$OUT/summary.log"
: >"$SUMMARY"
T0=$SECONDS

# step NAME CAP_SECONDS COMMAND...: run COMMAND under `timeout`, bounded by CAP and by the budget
# left; its output (stdout and stderr) goes to the terminal and to $OUT/NAME.log
step() {
    local name=$1 cap=$2
    shift 2
    local left=$((BUDGET - (SECONDS - T0)))
    local limit=$((cap < left ? cap : left))
    if [ "$limit" -lt 20 ]; then
        echo "[$name] skipped: ${left}s of the ${BUDGET}s budget left" | tee -a "$SUMMARY"
        return 0
    fi
    local t=$SECONDS
    echo "=== [$name] (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    local why=""
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why=" (timed out)"
    echo "[$name] exit $rc$why after $((SECONDS - t))s" | tee -a "$SUMMARY"
}

# the largest state per rank (GiB, at most $2) whose checkpoints fit in directory $1 (1.4x the state)
fit_gib() {
    python3 -c "import shutil, sys; free = shutil.disk_usage(sys.argv[1]).free / 2**30; \
print(round(max(0.0, min(float(sys.argv[2]), free / (int(sys.argv[3]) * 1.4))), 2))" "$1" "$2" "$RANKS"
}

env_step() {
    if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            && echo "installed into /tmp/site: $(ls .whl | tr '\n' ' ')"
    else
        echo "no .whl/*.whl here: using what the machine has"
    fi
    nvidia-smi
    python3 -W ignore - <<'EOF'
import importlib, importlib.metadata as md, os, sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| GPU", torch.cuda.get_device_name() if torch.cuda.is_available() else "none", "| cores", os.cpu_count())
for dist, name in (("ckpt_integration", "ckpt_integration"), ("lightning", "lightning"), ("numpy", "numpy"),
                   ("omegaconf", "omegaconf"), ("hydra-core", "hydra"), ("zlib-ng", "zlib_ng"), ("xxhash", "xxhash"),
                   ("megatron-core", "megatron.core"), ("safetensors", "safetensors")):
    try:
        m = importlib.import_module(name)
        try:
            v = md.version(dist)
        except md.PackageNotFoundError:
            v = getattr(m, "__version__", "?")
        print(f"  {dist} {v} ({os.path.dirname(m.__file__)})")
    except Exception as e:
        print(f"  {dist}: NOT importable ({type(e).__name__}: {e})")
EOF
    free -g
    df -hT /dev/shm /tmp /var/tmp "$PWD" 2>/dev/null
}

export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export -f env_step
step env 60 bash -c env_step

step tests 150 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py tests/test_cuda_snapshot.py tests/test_cuda_paths.py

# tmpfs target: /dev/shm, or a tmpfs of our own where /dev/shm is too small (a container's 64 MiB)
SHM=/dev/shm
SHM_GIB=$(fit_gib "$SHM" "$GIB")
if [ "$(python3 -c "import sys; print(int(float(sys.argv[1]) < min(1.0, float(sys.argv[2]))))" "$SHM_GIB" "$GIB")" = 1 ]; then
    mkdir -p /tmp/ckpt_shm && mount -t tmpfs -o size=$((GIB * RANKS * 2 + 2))g tmpfs /tmp/ckpt_shm 2>/dev/null \
        && SHM=/tmp/ckpt_shm && SHM_GIB=$(fit_gib "$SHM" "$GIB")
    echo "/dev/shm too small; tmpfs target $SHM with ${SHM_GIB} GiB per rank" | tee -a "$SUMMARY"
fi
step bench_shm 240 python3 benchmarks/gpu_bench.py --gib-per-rank "$SHM_GIB" --ranks "$RANKS" --repeats "$REPEATS" \
    --dir "$SHM" --json "$OUT/gpu_bench_shm.json" $EXTRA

if [ -f benchmarks/exit_stress.py ]; then
    # shellcheck disable=SC2086  # EXIT_ARGS is a list of arguments
    step exit_stress 60 python3 benchmarks/exit_stress.py $EXIT_ARGS
else
    echo "[exit_stress] skipped: benchmarks/exit_stress.py is not in this tree" | tee -a "$SUMMARY"
fi

mkdir -p "$DISK"
step bench_disk 240 python3 benchmarks/gpu_bench.py --gib-per-rank "$(fit_gib "$DISK" "$DISK_GIB")" --ranks "$RANKS" \
    --repeats "$DISK_REPEATS" --dir "" --disk-dir "$DISK" --json "$OUT/gpu_bench_disk.json" $EXTRA
rm -rf "$DISK"

{
    echo
    echo "=================== summary (total $((SECONDS - T0))s of a ${BUDGET}s budget)"
    cat "$SUMMARY"
    grep -E "^python |NVIDIA|NOT importable" "$OUT/env.log" 2>/dev/null | head -5
    grep -E "^(FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed|skipped|error)" "$OUT/tests.log" 2>/dev/null | tail -15
    tail -5 "$OUT/exit_stress.log" 2>/dev/null
    for f in bench_shm bench_disk; do
        echo
        sed -n '/^GPU checkpoint benchmark:/,$p' "$OUT/$f.log" 2>/dev/null | grep -v -E "^\s*(\S+Warning|warnings\.warn)"
    done
} | tee "$OUT/summary.tmp"
cat "$OUT/summary.tmp" >"$SUMMARY" && rm -f "$OUT/summary.tmp"
