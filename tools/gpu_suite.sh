#!/usr/bin/env bash
# GPU suite of the log-prob op: the gpu-marked tests and the benchmark, results under $OUT.
#
# On a machine with PyPI (once; the GPU machine has no network):
#   bash tools/gpu_suite.sh wheels     # megatron-core 0.19.2 + cut-cross-entropy for python 3.12
#                                      # into wheels/ (keep it out of git; carry it to the GPU)
# On the GPU machine, from the repository root, with wheels/ carried along:
#   bash tools/gpu_suite.sh            # = tests + bench (one GPU)
#   bash tools/gpu_suite.sh tests      # pytest -m gpu -q
#   bash tools/gpu_suite.sh bench      # tools/bench_logprobs.py, T=8192 and 32768
#   bash tools/gpu_suite.sh bench --main-grad   # same with an fp32 main_grad (own log)
#   bash tools/gpu_suite.sh tp         # the --tp benchmark on every visible GPU (2 or 4)
#   bash tools/gpu_suite.sh passes     # training passes on packed batches: bench_train_passes
#                                      # (before / after), profiles at L=8192 and 128, attention
#   bash tools/gpu_suite.sh mixed      # issue 42: packed-attention GPU tests, then the 0.6B and
#                                      # 8B-layer mixed-length rows, length buckets vs varlen_attn
#   bash tools/gpu_suite.sh mixed_moe  # the same row for the Qwen3-30B-A3B layer shape
#   bash tools/gpu_suite.sh tp8b       # the 8B layer shape at TP 1, 2, 4 (as many as visible
#                                      # GPUs allow), one torchrun each, MFU per GPU side by side
# Extra arguments after the mode go to the benchmark (e.g. `bench --T 8192`).
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=tools/gpu_env.sh
. tools/gpu_env.sh

MODE=${1:-all}
shift || true
WHEELS=${WHEELS:-wheels}
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
# Never use NVLink multicast on the shared hosts (see the device notes); unbuffered logs.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

download_wheels() {
    local plats=()
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
        manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
        plats+=(--platform "$p")
    done
    python3 -m pip download --python-version 3.12 --implementation cp "${plats[@]}" \
        --only-binary=:all: --no-deps -d "$WHEELS" \
        megatron-core==0.19.2 cut-cross-entropy==25.1.1
    ls -la "$WHEELS"
}

setup() {
    install_carried || return 1
    python3 - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)
n = torch.cuda.device_count()
print("gpus", n, [torch.cuda.get_device_name(i) for i in range(n)])
for name in ("megatron.core", "cut_cross_entropy", "megatron_grpo.kernels", "megatron_grpo.ops"):
    try:
        mod = __import__(name, fromlist=["_"])
        print(name, getattr(mod, "__version__", ""), "ok")
    except Exception as e:  # report, the suite still runs what it can
        print(name, "MISSING:", type(e).__name__, e)
a = torch.zeros(2, 2, device="cuda", dtype=torch.bfloat16)
try:
    print("torch.mm out_dtype=float32:", torch.mm(a, a, out_dtype=torch.float32).dtype)
except Exception as e:
    print("torch.mm out_dtype=float32: unsupported:", e)
EOF
}

run_tests() {
    # a test past GPU_TEST_STACKS_S seconds prints every thread's stack (pytest's faulthandler):
    # a hang in a collective names its place; -rA lists each test's outcome
    python3 -m pytest -m gpu -q -rA -p no:cacheprovider \
        -o faulthandler_timeout="${GPU_TEST_STACKS_S:-180}" tests 2>&1 | tee "$OUT/pytest_gpu.log"
    return "${PIPESTATUS[0]}"
}

run_bench() {
    local log=bench_single
    case " $* " in *" --main-grad "*) log=bench_single_main_grad ;; esac
    python3 tools/bench_logprobs.py --out "$OUT" "$@" 2>&1 | tee "$OUT/$log.log"
    return "${PIPESTATUS[0]}"
}

run_tp() {
    local n
    n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
    if [ "$n" -lt 2 ]; then
        echo "tp: needs at least 2 GPUs, found $n"
        return 1
    fi
    python3 -m torch.distributed.run --standalone --nproc-per-node "$n" \
        tools/bench_logprobs.py --tp --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_tp$n.log"
    return "${PIPESTATUS[0]}"
}

run_passes() {
    # before (megatron-core's RoPE loop, torch norms / SwiGLU), RoPE only, everything
    python3 tools/bench_train_passes.py --rope megatron/torch,auto/torch,auto --out "$OUT/passes" \
        "$@" 2>&1 | tee "$OUT/bench_train_passes.log"
    local s=${PIPESTATUS[0]}
    for len in 8192 128; do
        python3 tools/bench_train_passes.py --rope auto --doc-lens "$len" --profile \
            --profile-len "$len" --top 30 --iters 2 --out "$OUT/profile_$len" 2>&1 |
            tee "$OUT/profile_$len.log" || s=1
        rm -f "$OUT/profile_$len"/trace_*  # the logs hold the tables; traces are large
    done
    python3 tools/bench_packed_attention.py --methods default,cudnn,flash,varlen \
        --out "$OUT/attention" 2>&1 | tee "$OUT/bench_attention.log" || s=1
    return "$s"
}

# buckets (one SDPA per power-of-two length) against one varlen_attn call per layer
MIXED_VARIANTS=auto/auto/plan_free/buckets,auto/auto/plan_free/varlen

run_mixed() {
    python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_packed_varlen.py \
        tests/test_packed_attention.py 2>&1 | tee "$OUT/pytest_mixed.log"
    local s=${PIPESTATUS[0]}
    python3 tools/bench_train_passes.py --tokens 32768 --micro-batches 2 --doc-lens 8192 \
        --mixed 20-1000 --rope "$MIXED_VARIANTS" --warmup 1 --iters 3 --out "$OUT/mixed_0_6b" \
        "$@" 2>&1 | tee "$OUT/mixed_0_6b.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || s=1
    python3 tools/bench_train_passes.py --dense8b --tokens 32768 --micro-batches 2 \
        --doc-lens 8192 --mixed 100-4000 --rope "$MIXED_VARIANTS" --warmup 1 --iters 3 \
        --out "$OUT/mixed_8b" "$@" 2>&1 | tee "$OUT/mixed_8b.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || s=1
    return "$s"
}

run_mixed_moe() {
    python3 tools/bench_train_passes.py --moe --doc-lens 8192 --mixed 100-4000 \
        --rope "$MIXED_VARIANTS" --warmup 1 --iters 3 --out "$OUT/mixed_a3b" "$@" 2>&1 |
        tee "$OUT/mixed_a3b.log"
    return "${PIPESTATUS[0]}"
}

run_tp8b() {
    local n sizes=1
    n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
    [ "$n" -ge 2 ] && sizes=1,2
    [ "$n" -ge 4 ] && sizes=1,2,4
    python3 tools/bench_train_passes.py --dense8b --tp "$sizes" --tokens 32768 \
        --micro-batches 2 --doc-lens 8192 --mixed 100-4000 --warmup 1 --iters 3 \
        --out "$OUT/tp8b" "$@" 2>&1 | tee "$OUT/tp8b.log"
    return "${PIPESTATUS[0]}"
}

status=0
case "$MODE" in
    wheels) download_wheels || status=1 ;;
    tests) { setup && run_tests; } || status=1 ;;
    bench) { setup && run_bench "$@"; } || status=1 ;;
    tp) { setup && run_tp "$@"; } || status=1 ;;
    passes) { setup && run_passes "$@"; } || status=1 ;;
    mixed) { setup && run_mixed "$@"; } || status=1 ;;
    mixed_moe) { setup && run_mixed_moe "$@"; } || status=1 ;;
    tp8b) { setup && run_tp8b "$@"; } || status=1 ;;
    all)
        setup || exit 1
        run_tests || status=1
        run_bench "$@" || status=1
        ;;
    *)
        echo "usage: $0 [all|tests|bench|tp|passes|mixed|mixed_moe|tp8b|wheels] [benchmark args]"
        exit 2
        ;;
esac
echo "gpu_suite $MODE: exit $status; results in $OUT"
exit "$status"
