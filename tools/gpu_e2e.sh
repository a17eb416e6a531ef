#!/usr/bin/env bash
# End-to-end GPU runs of the scale twins, our log-prob path vs Megatron's standard path.
#
# On a 1- or 2-GPU H200 machine, from the repository root, with the wheels carried in .whl/
# (megatron-core and cut-cross-entropy for python 3.12; see /work/.library/device/README.md):
#   bash tools/gpu_e2e.sh dense     # the dense twin: toy-task trajectory + 8k synthetic rollouts
#   bash tools/gpu_e2e.sh moe       # one GPU (TP1 EP1): the MoE twin's step split at 128
#                                   # digits next to the dense twin's at 256 digits (on-policy,
#                                   # 512 samples; MOE_EXPERTS "grouped" or "sequential grouped"
#                                   # for megatron-core's SequentialMLP before it), STEPS each
#   bash tools/gpu_e2e.sh moe_twin  # the MoE twin (2 GPUs): toy task + 4k synthetic rollouts
#   bash tools/gpu_e2e.sh moe_ep    # the MoE twin at EP1 (1 GPU), EP2 TP2+SP (2), EP4 TP1 and
#                                   # TP2+SP (4 GPUs), EP2 and EP4 TP1 again with the log-prob
#                                   # and update passes on CUDA graphs (the "g" rows): step
#                                   # split, generation tokens/s, ratios to EP1 (moe_ep.md;
#                                   # MOE_EP_LAYOUTS
#                                   # "tag:gpus:tp:sp[:dispatch[:micro-batch tokens[:settings
#                                   # ]]] ..."; MOE_EP_PROFILE_STEP=5: that step profiled
#                                   # on every rank and left out of the means, device-time tables
#                                   # in moe_ep_profiles.md; MOE_EP_WARMUP steps left out, 3:
#                                   # steps 1-2 answer in ~20 tokens, step 3 compiles for the
#                                   # 129-token shapes)
#   bash tools/gpu_e2e.sh maxctx    # longest packed micro-batch per log-prob path, one GPU
#   bash tools/gpu_e2e.sh step      # the dense twin's step on 2 GPUs (TP2+SP), toy task with
#                                   # 256-digit prompts: on-policy (1 mini-batch, old-log-prob
#                                   # pass skipped), the same with 8k micro-batches (mb1small),
#                                   # and 2 mini-batches; STEPS steps each, STEP_TAGS picks
#   bash tools/gpu_e2e.sh partial   # the dense twin on one GPU, toy task num_digits [8, 512]:
#                                   # rollout.partial off vs on (tools/bench_partial.py; STEPS_PARTIAL,
#                                   # 6 here; PARTIAL_MODES "off recompute"): bench_partial.md
#   bash tools/gpu_e2e.sh memory    # tools/memory_probe.py: memory per phase and step (before /
#                                   # after rollout, after log-prob, after update): MEMORY_RUNS
#                                   # of twin, twin_partial (1 GPU), 8b, 8b_partial (Qwen3-8B
#                                   # shape, TP4, 4 GPUs, MEMORY_LAYERS=4), each optionally
#                                   # with _baseline (without the fix): memory_probe.md
#   bash tools/gpu_e2e.sh async_sync # 4 GPUs: weight sync of the Qwen3-0.6B and -8B shapes,
#                                   # trainer TP2 -> one TP2 replica, then -> two TP1 replicas
#                                   # (tools/bench_weight_sync.py; SYNC_BUCKET_MIB "256 1024")
#   bash tools/gpu_e2e.sh async     # 4 GPUs: the dense twin colocated (TP2+SP x DP2) vs separate
#                                   # (TP2+SP trainer on GPUs 0-1 + 2 TP1 generation replicas on
#                                   # 2-3, max_staleness ASYNC_STALENESS=1), same samples per step,
#                                   # ASYNC_TASKS "256 8-512" (256 digits; num_digits [8, 512]),
#                                   # ASYNC_STEPS (6) each, ASYNC_PLACEMENTS (+ separate_dp2: a
#                                   # TP1 x DP2 trainer) (tools/bench_async.py): tokens/s, step
#                                   # split, weight-sync s and GiB/s, lag, ratios: bench_async.md;
#                                   # one task per call if 4 runs exceed a 10-minute limit
#   bash tools/gpu_e2e.sh scale8b   # 4 GPUs: issue 42's Qwen3-8B rows (TP4+SP, random weights,
#                                   # recompute auto): tools/gpu_scale8b.sh, $OUT/scale8b.md
#   bash tools/gpu_e2e.sh full8     # 8 GPUs (FULL8_GPUS=4: the stand-ins): issue 40's 30B-A3B
#                                   # and 8B rows: tools/gpu_full8.sh, $OUT/full8.md
#   bash tools/gpu_e2e.sh all       # dense, moe_twin, maxctx (may exceed a 10-minute limit)
# Each mode runs every path of PATHS ("fused megatron"); the trainer must expose
# lm_head.path (GRPOStep.logprob_path). Results under $OUT (at most 4 files):
#   summary.md    tables: tokens/s, peak memory, final reward/loss, longest context per path
#   results.jsonl one line per (run, step) and per max-context trial
#   e2e.log       every command's output;  env.txt  versions and GPUs
# Knobs (environment): STEPS (toy steps, 8), LONG_STEPS (synthetic steps, 4; step 1 is
# warm-up and left out of the means), PATHS, MAXCTX_LAYERS ("1 4": decoder layers of the
# Qwen3-8B-shaped model; the embedding and LM head are full size), MAXCTX_DOC (8192 tokens per
# packed document; 0 = one sequence), MAXCTX_RECOMPUTE ("full": full activation recompute, as
# long-context recipes use; the 36-layer Qwen3-8B then fits one H200 without optimizer state),
# RUN_TIMEOUT (seconds per trainer run; unset: none), WHEELS (.whl), E2E_CODE (a directory
# holding another source tree, e.g. `git archive BASE | tar -x -C .run/base`: installed on its
# own (gpu_env.sh install_tree, kernels/ included), the trainer runs that code with this
# checkout's recipes, for a before / after in one call; give each side its own OUT and WORK), TORCHRUN_ARGS (more torchrun options for every trainer
# run, e.g. "--numa-binding node": each rank on the CPUs near its GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=tools/gpu_env.sh
. tools/gpu_env.sh
# shellcheck source=tools/gpu_scale8b.sh
. tools/gpu_scale8b.sh
# shellcheck source=tools/gpu_full8.sh
. tools/gpu_full8.sh

MODE=${1:-all}
WHEELS=${WHEELS:-.whl}
OUT=${OUT:-$PWD/gpu_out}
WORK=${WORK:-/tmp/gpu_e2e}
STEPS=${STEPS:-8}
LONG_STEPS=${LONG_STEPS:-4}
PATHS=${PATHS:-fused megatron}
MAXCTX_LAYERS=${MAXCTX_LAYERS:-1 4}
MAXCTX_DOC=${MAXCTX_DOC:-8192}
MAXCTX_RECOMPUTE=${MAXCTX_RECOMPUTE:-}
mkdir -p "$OUT" "$WORK"
LOG="$OUT/e2e.log"
RESULTS="$OUT/results.jsonl"
# Never use NVLink multicast on the shared hosts (see the device notes); unbuffered logs; less
# fragmentation for the max-context search.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF-expandable_segments:True}

setup() {
    install_carried || return 1
    if [ -n "${E2E_CODE:-}" ]; then
        E2E_SITE=$(install_tree "$E2E_CODE") || return 1
        echo "E2E_CODE: $E2E_CODE installed in $E2E_SITE" | tee -a "$LOG"
    fi
    python3 - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import torch
import megatron.core
print("torch", torch.__version__, "cuda", torch.version.cuda, "megatron-core",
      getattr(megatron.core, "__version__", "?"))
print("gpus", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
EOF
    NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
    [ "$NGPU" -ge 1 ] || { echo "no GPU"; return 1; }
}

# Sample nvidia-smi's memory.used (MiB, all GPUs) while a command runs: the peak is what the
# process reserved (allocator cache included), a bound on torch's max_memory_allocated.
with_memory_sampling() {
    local tag=$1
    shift
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 \
        >"$WORK/$tag.smi" 2>/dev/null &
    local smi=$!
    "$@" >>"$LOG" 2>&1
    local rc=$?
    kill "$smi" 2>/dev/null
    wait "$smi" 2>/dev/null
    echo "$tag: exit $rc" | tee -a "$LOG"
    return $rc
}

# train TAG RECIPE PATH [--set overrides...]: a trainer run under torchrun on every GPU used.
train() {
    local tag=$1 recipe=$2 path=$3
    shift 3
    local nproc=$((NGPU >= 2 ? 2 : 1))
    nproc=${NPROC:-$nproc}
    local layout=()
    if [ "$nproc" -eq 1 ]; then
        layout=(--set parallel.tensor_model_parallel_size=1 --set parallel.sequence_parallel=false
            --set parallel.expert_model_parallel_size=1)
    fi
    rm -rf "${WORK:?}/$tag"
    echo "== $tag: $recipe, logprob_path=$path, $nproc GPU(s)" | tee -a "$LOG"
    # RUN_TIMEOUT (seconds): a run past it gets SIGTERM (torchrun stops its ranks), then the
    # mode's next run starts; a hung run no longer takes the rest of the call
    local limit=()
    [ -n "${RUN_TIMEOUT:-}" ] && limit=(timeout -k 30 "$RUN_TIMEOUT")
    # E2E_CODE: the trainer imports that tree's megatron_grpo and kernels, not this checkout's
    # (-m would put the working directory first on sys.path; PYTHONSAFEPATH keeps it off)
    local code=()
    [ -n "${E2E_CODE:-}" ] &&
        code=(env PYTHONSAFEPATH=1 "PYTHONPATH=$E2E_SITE${PYTHONPATH:+:$PYTHONPATH}")
    local torchrun_extra=()
    read -ra torchrun_extra <<<"${TORCHRUN_ARGS:-}"
    with_memory_sampling "$tag" "${limit[@]}" "${code[@]}" python3 -m torch.distributed.run \
        --standalone --nproc-per-node "$nproc" "${torchrun_extra[@]}" -m megatron_grpo.train \
        --config "recipes/$recipe.yaml" \
        --set lm_head.path="$path" --set logging.dir="$WORK/$tag" \
        --set logging.progress_bar=false --set checkpoint.dir=null "${layout[@]}" "$@"
}

# synthetic ROLLOUT_DIR GROUPS GROUP_SIZE PROMPT_LEN RESPONSE_LEN: random Qwen3-vocabulary
# rollouts (rewards 0/1, generator log-probs near a uniform policy's) in the rollout-file format.
synthetic() {
    python3 - "$@" <<'EOF'
import json, math, random, sys
from pathlib import Path
out, groups, size, p_len, r_len = sys.argv[1], *map(int, sys.argv[2:6])
vocab, rng = 151936, random.Random(0)
Path(out).mkdir(parents=True, exist_ok=True)
with open(Path(out) / "rollouts.jsonl", "w") as f:
    for gid in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(p_len)]
        for _ in range(size):
            resp = [rng.randrange(vocab) for _ in range(r_len)]
            lp = [round(-math.log(vocab) + rng.gauss(0, 0.1), 4) for _ in resp]
            row = dict(prompt_ids=prompt, response_ids=resp, group_id=gid, rollout_logprobs=lp,
                       reward=float(rng.random() < 0.5))
            f.write(json.dumps(row) + "\n")
EOF
}

# twin NAME RECIPE SEQ_LEN PROMPTS: toy-task runs, then synthetic long-rollout runs per path.
twin() {
    local name=$1 recipe=$2 seq=$3 prompts=$4 status=0 p
    for p in $PATHS; do
        train "${name}_toy_$p" "$recipe" "$p" --set training.steps="$STEPS" || status=1
    done
    local data="$WORK/${name}_rollouts"
    synthetic "$data" $((prompts * LONG_STEPS)) 8 256 $((seq - 256)) || return 1
    for p in $PATHS; do
        train "${name}_long_$p" "$recipe" "$p" --set model.vocab_size=151936 \
            --set rollout.input_path="$data" --set rollout.num_prompts="$prompts" \
            --set rollout.group_size=8 --set rollout.max_prompt_length=256 \
            --set rollout.max_response_length=$((seq - 256)) \
            --set training.steps="$LONG_STEPS" || status=1
    done
    return $status
}

# step: the dense twin's step split (rollout / log-prob / update) at 256 digits, fused path:
# on-policy (1 mini-batch: the old-log-prob pass is skipped), the same with the reference pass
# over merged micro-batches of up to 64k tokens and 32k-token update micro-batches ("big"),
# and 2 mini-batches.
step_split() {
    local status=0 tag
    local digits=(--set rollout.reverse_digits.num_digits=256 --set rollout.max_prompt_length=260
        --set rollout.max_response_length=257 --set training.steps="$STEPS")
    # mb1: on-policy (one optimizer step), the recipe's micro-batches; mb1small: the same with
    # 8k-token update micro-batches and unmerged log-prob passes (the recipe before 2026-11-26);
    # mb2: two optimizer steps per rollout batch (the old-log-prob pass runs)
    for tag in ${STEP_TAGS:-mb1 mb1small mb2}; do
        local extra=(--set training.mini_batches_per_step="${tag:2:1}")
        if [ "$tag" = mb1small ]; then
            extra+=(--set training.logprob_max_tokens_per_micro_batch=null
                --set training.max_tokens_per_micro_batch=8192)
        fi
        train "step_${tag}_fused" qwen3_8b_long_sp_twin fused "${digits[@]}" "${extra[@]}" ||
            status=1
    done
    return $status
}

# moe: the step split of the MoE twin (128-digit prompts) and the dense twin (256 digits) on
# one GPU at TP1 EP1, on-policy, 512 samples per step, fused path; MOE_EXPERTS picks the expert
# implementations of the MoE runs (model.moe_grouped_gemm: sequential = false).
moe_split() {
    local status=0 e
    local common=(--set training.steps="$STEPS" --set training.mini_batches_per_step=1)
    for e in ${MOE_EXPERTS:-grouped}; do
        local grouped=true
        [ "$e" = sequential ] && grouped=false
        NPROC=1 train "moe1gpu_${e}_fused" qwen3_30b_a3b_moe_twin fused "${common[@]}" \
            --set rollout.reverse_digits.num_digits=128 --set rollout.max_prompt_length=132 \
            --set rollout.max_response_length=129 --set model.moe_grouped_gemm="$grouped" ||
            status=1
    done
    NPROC=1 train "dense1gpu_fused" qwen3_8b_long_sp_twin fused "${common[@]}" \
        --set rollout.reverse_digits.num_digits=256 --set rollout.max_prompt_length=260 \
        --set rollout.max_response_length=257 || status=1
    return $status
}

# moe_ep: the MoE twin's step split at expert parallelism (128-digit prompts, on-policy, 512
# samples per step, fused path): EP1 on one GPU, EP2 (TP2+SP, the recipe's layout) on 2 GPUs,
# EP4 with TP1 and with TP2+SP on 4 GPUs; a layout needing more GPUs than the host has is
# skipped, a failing one does not stop the others. Decode graphs need the allocator's
# expandable segments off (rollout/graphs.py), so these runs unset them. Each run's log:
# $OUT/moe_ep_<tag>.log (its "CUDA graphs" start-up line included); $OUT/moe_ep.md: the step
# split, tokens/s and the ratios to EP1.
moe_ep() {
    local status=0 spec tag nproc tp sp
    local common=(--set training.steps="$STEPS" --set training.mini_batches_per_step=1
        --set rollout.reverse_digits.num_digits=128 --set rollout.max_prompt_length=132
        --set rollout.max_response_length=129)
    # the training passes' graphs: on under auto at EP > 1 where the dispatch can be captured
    # (gathered); the "e" rows run them eager, the "g" row captures them at EP 4 TP 1
    local graphs=training.update_cuda_graphs=true,training.logprob_cuda_graphs=true
    local eager=training.update_cuda_graphs=false,training.logprob_cuda_graphs=false
    local layouts="ep1:1:1:false ep2_tp2sp:2:2:true:gathered ep2e_tp2sp:2:2:true:gathered::$eager
        ep4_tp1:4:1:false ep4g_tp1:4:1:false:gathered::$graphs ep4_tp2sp:4:2:true"
    layouts=${MOE_EP_LAYOUTS:-$layouts}
    for spec in $layouts; do
        # tag:gpus:tp:sp[:dispatch[:mb[:engine]]]: dispatch = model.layer_kernels.moe_dispatch
        # (auto: the gathered dispatch in decode, megatron-core's all-to-all in training;
        # gathered: both, the twin recipe's choice for EP 2 inside TP 2);
        # mb = training.max_tokens_per_micro_batch (default: the recipe's);
        # engine = settings, rollout.engine keys (ep_decode_steps=1,kv_cache_memory=allocator)
        # or full dotted paths (model.layer_kernels.moe_sort=argsort)
        IFS=: read -r tag nproc tp sp dispatch mb engine <<<"$spec"
        local engine_set=() setting
        IFS=, read -ra settings <<<"${engine:-}"
        for setting in "${settings[@]}"; do  # a dotted key is a full path
            [[ ${setting%%=*} == *.* ]] || setting="rollout.engine.$setting"
            engine_set+=(--set "$setting")
        done
        if [ "$nproc" -gt "$NGPU" ]; then
            echo "== moe_ep_$tag: skipped ($nproc GPUs, $NGPU here)" | tee -a "$LOG"
            continue
        fi
        local profile=()  # MOE_EP_PROFILE_STEP: that step under torch.profiler on every rank
        if [ -n "${MOE_EP_PROFILE_STEP:-}" ]; then
            profile=(--set logging.profile_step_start="$MOE_EP_PROFILE_STEP"
                --set "logging.profile_ranks=[$(seq -s, 0 $((nproc - 1)))]")
        fi
        PYTORCH_CUDA_ALLOC_CONF="" LOG="$OUT/moe_ep_$tag.log" NPROC=$nproc \
            train "moe_ep_${tag}_fused" qwen3_30b_a3b_moe_twin fused "${common[@]}" \
            --set parallel.tensor_model_parallel_size="$tp" --set parallel.sequence_parallel="$sp" \
            --set parallel.expert_model_parallel_size="$nproc" \
            --set parallel.expert_tensor_parallel_size=1 "${profile[@]}" \
            --set model.layer_kernels.moe_dispatch="${dispatch:-auto}" \
            ${mb:+--set training.max_tokens_per_micro_batch="$mb"} "${engine_set[@]}" || status=1
        for table in "$WORK/moe_ep_${tag}_fused"/profile/*.md; do  # the tables, not the traces
            [ -f "$table" ] && { echo "## $tag: $(basename "$table")"; cat "$table"; } \
                >>"$OUT/moe_ep_profiles.md"
        done
        echo "moe_ep_$tag: $(grep -h -m1 "CUDA graphs" "$OUT/moe_ep_$tag.log")" | tee -a "$LOG"
    done
    python3 - "$WORK" "$OUT/moe_ep.md" "${MOE_EP_PROFILE_STEP:-0}" "${MOE_EP_WARMUP:-3}" \
        <<'EOF' | tee -a "$LOG"
import json, sys
from pathlib import Path
import yaml
work, out = Path(sys.argv[1]), Path(sys.argv[2])
keys = ("step", "rollout", "logprob", "update")
rows, bases = [], {}  # bases: micro-batch tokens -> that size's EP1 row
for run in sorted(work.glob("moe_ep_*_fused"), key=lambda p: p.stat().st_mtime):
    f = run / "metrics.jsonl"
    # after the warm-up steps, without the profiled one (the profiler costs host time)
    lines = f.read_text().splitlines() if f.exists() else []
    warm, prof = int(sys.argv[4]), int(sys.argv[3])
    steps = [json.loads(l) for i, l in enumerate(lines, 1) if i > warm and i != prof]
    def mean(k):
        v = [s[k] for s in steps if s.get(k) is not None]
        return sum(v) / len(v) if v else None
    cfg = yaml.safe_load((run / "config.yaml").read_text()) if (run / "config.yaml").exists() else {}
    mb = cfg.get("training", {}).get("max_tokens_per_micro_batch")
    ep = cfg.get("parallel", {}).get("expert_model_parallel_size")
    r = dict(tag=run.name[len("moe_ep_"):-len("_fused")], steps=len(steps), mb=mb,
             **{k: mean(f"perf/{k}_seconds") for k in keys},
             tps=mean("perf/tokens_per_s"), gen=mean("perf/generation_tokens_per_s"),
             last=steps[-1].get("perf/tokens_per_s") if steps else None,
             captures=[int(s.get("rollout/graph_captures", 0)) for s in steps],
             trained=[int(s.get("perf/logprob_graph_captures", 0)
                          + s.get("perf/update_graph_captures", 0)) for s in steps])
    rows.append(r)
    if ep == 1:
        bases.setdefault(mb, r)
fmt = lambda v, p=2: "n/a" if v is None else f"{v:.{p}f}"
def ratio(r, k):  # to the EP1 row of the same micro-batch size
    b = bases.get(r["mb"])
    return "n/a" if not (b and b[k] and r[k]) else f"{r[k] / b[k]:.2f}x"
lines = ["| layout | micro-batch tokens | steps (after warm-up) | decode graph captures "
         "| log-prob + update graph captures | step s | rollout s | log-prob s | update s "
         "| step tok/s | vs EP1 | last step tok/s | vs EP1 | generation tok/s | vs EP1 |",
         "|---" * 15 + "|"]
for r in rows:
    lines.append(f"| {r['tag']} | {r['mb']} | {r['steps']} | {r['captures']} | {r['trained']} | "
                 + " | ".join(fmt(r[k]) for k in keys)
                 + f" | {fmt(r['tps'], 0)} | {ratio(r, 'tps')} | {fmt(r['last'], 0)} | "
                 + f"{ratio(r, 'last')} | {fmt(r['gen'], 0)} | {ratio(r, 'gen')} |")
text = "## MoE twin at expert parallelism\n\n" + "\n".join(lines) + "\n"
out.write_text(text)
print(text)
EOF
    return $status
}

# maxctx: per path and layer count, the longest packed micro-batch (tokens) whose forward +
# backward fits one GPU: doubling from 16k, then 3 bisections; plus fwd+bwd tokens/s at 16k.
maxctx() {
    local status=0 p n
    for n in $MAXCTX_LAYERS; do
        for p in $PATHS; do
            echo "== maxctx: $p, $n layer(s), documents of $MAXCTX_DOC" | tee -a "$LOG"
            python3 - "$p" "$n" "$MAXCTX_DOC" "$RESULTS" "$MAXCTX_RECOMPUTE" >>"$LOG" 2>&1 <<'EOF' || status=1
import gc, json, math, sys, time
import torch
from megatron_grpo.loss import GRPOLossConfig
from megatron_grpo.megatron import (GRPOStep, ModelConfig, ParallelConfig, build_model,
                                    get_forward_backward_func, initialize_parallel, pack_sequences)
path, layers, doc, results = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
recompute = sys.argv[5] == "full"  # full activation recompute: layer inputs only are kept
V = 151936
cfg = ModelConfig(  # Qwen3-8B's shape with `layers` decoder layers
    vocab_size=V, num_layers=layers, hidden_size=4096, num_attention_heads=32,
    num_query_groups=8, kv_channels=128, ffn_hidden_size=12288, qk_layernorm=True,
    layernorm_epsilon=1e-6, rotary_base=1000000, max_sequence_length=1 << 21,
    params_dtype="bfloat16",
    **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
       if recompute else {}))
initialize_parallel(ParallelConfig(), seed=1)
chunks = build_model(cfg, ParallelConfig())
step = GRPOStep(GRPOLossConfig(), vocab_size=V, logprob_path=path)  # token-level: fused = fused
schedule = get_forward_backward_func()

def batch(tokens):
    g = torch.Generator().manual_seed(tokens)
    lens = [doc] * (tokens // doc) + ([tokens % doc] if tokens % doc else []) if doc else [tokens]
    seqs = [torch.randint(0, V, (n,), generator=g) for n in lens]
    masks = [torch.arange(n) >= min(256, n // 8) for n in lens]  # short prompt, long response
    old = [torch.full((n,), -math.log(V)) for n in lens]
    adv = [1.0 if i % 2 else -1.0 for i in range(len(lens))]
    return pack_sequences(seqs, masks, advantages=adv, old_logprobs=old)

def run(tokens):
    b = batch(tokens)
    for c in chunks:
        c.zero_grad_buffer()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        schedule(forward_step_func=step.forward_step, data_iterator=iter([b]), model=chunks[0],
                 num_microbatches=1, seq_length=tokens, micro_batch_size=1, forward_only=False)
        torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        return None
    peak = torch.cuda.max_memory_allocated() / 2**30
    return dict(seconds=time.perf_counter() - t0, peak_gib=peak)

def trial(tokens):
    r = run(tokens)
    gc.collect()
    torch.cuda.empty_cache()
    row = dict(kind="maxctx_trial", path=path, layers=layers, doc=doc, recompute=recompute,
               tokens=tokens,
               fits=r is not None, **(r or {}))
    print(json.dumps(row), flush=True)
    with open(results, "a") as f:
        f.write(json.dumps(row) + "\n")
    return r

run(4096)  # warm-up
speed = [trial(16384) for _ in range(3)]
lo, hi, tokens = 0, None, 16384
while hi is None and tokens <= (1 << 21):
    if trial(tokens):
        lo, tokens = tokens, tokens * 2
    else:
        hi = tokens
for _ in range(3 if hi else 0):
    mid = (lo + hi) // 2 // 1024 * 1024
    if trial(mid):
        lo = mid
    else:
        hi = mid
secs = [s["seconds"] for s in speed if s]
row = dict(kind="maxctx", path=path, layers=layers, doc=doc, recompute=recompute, max_tokens=lo,
           first_oom=hi,
           tokens_per_s_16k=16384 / min(secs) if secs else None)
print(json.dumps(row), flush=True)
with open(results, "a") as f:
    f.write(json.dumps(row) + "\n")
EOF
        done
    done
    return $status
}

# Collect every run's JSONL + sampled memory into results.jsonl and the tables of summary.md.
summarize() {
    python3 - "$WORK" "$RESULTS" "$OUT/summary.md" <<'EOF'
import json, sys
from pathlib import Path
work, results, summary = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
old = [json.loads(l) for l in results.read_text().splitlines()] if results.exists() else []
rows = [r for r in old if r.get("kind", "").startswith("maxctx")]
table = ["| run | log-prob path | steps | tokens/s (mean, step >= 2) | peak GiB (torch) | "
         "peak MiB/GPU (nvidia-smi) | reward first -> last | loss first -> last | "
         "s per step: step / rollout / logprob / update (mean, step >= 2) | "
         "generation tokens/s (mean, step >= 2) |",
         "|---|---|---|---|---|---|---|---|---|---|"]
def first_last(steps, key):
    v = [s[key] for s in steps if s.get(key) is not None]
    return f"{v[0]:.3f} -> {v[-1]:.3f}" if v else "n/a"

def split(steps):
    keys = ("step", "rollout", "logprob", "update")
    means = []
    for k in keys:
        v = [s[f"perf/{k}_seconds"] for s in steps if s.get(f"perf/{k}_seconds") is not None]
        means.append(f"{sum(v) / len(v):.2f}" if v else "-")
    return " / ".join(means)

for run in sorted(p for p in work.iterdir() if (p / "metrics.jsonl").exists()):
    steps = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    rows += [dict(kind="train_step", run=run.name, **s) for s in steps]
    name, _, path = run.name.rpartition("_")
    later = [s["perf/tokens_per_s"] for s in steps[1:] if s.get("perf/tokens_per_s")]
    tps = f"{sum(later) / len(later):.0f}" if later else "n/a"
    peak = [v for s in steps for k, v in s.items() if k.startswith("perf/peak") and v]
    smi = work / f"{run.name}.smi"
    used = [int(x) for x in smi.read_text().split() if x.isdigit()] if smi.exists() else []
    cells = [name, path, len(steps), tps, f"{max(peak):.1f}" if peak else "not logged",
             max(used) if used else "n/a", first_last(steps, "reward/mean"),
             first_last(steps, "loss/loss"), split(steps[1:])]
    gen = [s["perf/generation_tokens_per_s"] for s in steps[1:]
           if s.get("perf/generation_tokens_per_s")]
    cells.append(f"{sum(gen) / len(gen):.0f}" if gen else "n/a")
    table.append("| " + " | ".join(map(str, cells)) + " |")
ctx = ["| log-prob path | decoder layers | tokens per document | longest fitting micro-batch "
       "| first OOM | fwd+bwd tokens/s at 16k |", "|---|---|---|---|---|---|"]
for r in rows:
    if r.get("kind") == "maxctx":
        tps = f"{r['tokens_per_s_16k']:.0f}" if r.get("tokens_per_s_16k") else "n/a"
        ctx.append(f"| {r['path']} | {r['layers']} | {r['doc'] or 'one sequence'} | "
                   f"{r['max_tokens']} | {r['first_oom']} | {tps} |")
results.write_text("".join(json.dumps(r) + "\n" for r in rows))
text = "## Twin runs\n\n" + "\n".join(table) + "\n\n## Longest context on one GPU\n\n"
summary.write_text(text + "\n".join(ctx) + "\n")
print(summary.read_text())
EOF
}

status=0
case "$MODE" in
    dense) { setup && twin dense qwen3_8b_long_sp_twin 8192 4; } || status=1 ;;
    moe) { setup && moe_split; } || status=1 ;;
    moe_twin) { setup && twin moe qwen3_30b_a3b_moe_twin 4096 8; } || status=1 ;;
    moe_ep) { setup && moe_ep; } || status=1 ;;
    maxctx) { setup && maxctx; } || status=1 ;;
    step) { setup && step_split; } || status=1 ;;
    scale8b) { setup && scale8b; } || status=1 ;;
    full8) { setup && full8; } || status=1 ;;
    partial)
        { setup && python3 tools/bench_partial.py --steps "${STEPS_PARTIAL:-6}" \
            --modes "${PARTIAL_MODES:-off recompute}" --work "$WORK" --out "$OUT" 2>&1 |
            tee -a "$LOG"; } || status=1
        echo "gpu_e2e partial: exit $status; results in $OUT"
        exit "$status"
        ;;
    memory)
        # tools/memory_probe.py: memory per phase and step; MEMORY_RUNS picks the runs (each a
        # few minutes: two or three fit one 10-minute call): twin, twin_partial (1 GPU), 8b,
        # 8b_partial (Qwen3-8B shape at TP4 on 4 GPUs, MEMORY_LAYERS of 36 layers), a
        # "_baseline" suffix for the same run without the fix. The default allocator: decode
        # graphs do not capture under expandable segments.
        setup || exit 1
        if [ -n "${MEMORY_ALLOC_CONF:-}" ]; then
            export PYTORCH_CUDA_ALLOC_CONF=$MEMORY_ALLOC_CONF
        else
            unset PYTORCH_CUDA_ALLOC_CONF
        fi
        for run in ${MEMORY_RUNS:-twin_partial twin_partial_baseline}; do
            args=(--out "$OUT" --work "$WORK" --steps "${MEMORY_STEPS:-3}")
            case "$run" in *partial*) args+=(--partial) ;; esac
            case "$run" in *baseline) args+=(--baseline) ;; esac
            case "$run" in
                twin*) cmd=(python3 tools/memory_probe.py --preset twin) ;;
                8b*) cmd=(python3 -m torch.distributed.run --standalone --nproc-per-node 4
                    tools/memory_probe.py --preset 8b --layers "${MEMORY_LAYERS:-4}") ;;
                *) echo "unknown MEMORY_RUNS entry $run"; status=1; continue ;;
            esac
            echo "== memory: $run" | tee -a "$LOG"
            "${cmd[@]}" "${args[@]}" 2>&1 | tee -a "$LOG" || status=1
        done
        echo "gpu_e2e memory: exit $status; tables in $OUT/memory_probe.md"
        exit "$status"
        ;;
    async_sync)
        setup || exit 1
        for rtp in 2 1; do
            python3 -m torch.distributed.run --standalone --nproc-per-node 4 \
                tools/bench_weight_sync.py --replica-tp "$rtp" \
                --bucket-mib ${SYNC_BUCKET_MIB:-256 1024} --out "$OUT" 2>&1 | tee -a "$LOG" ||
                status=1
        done
        echo "gpu_e2e async_sync: exit $status; results in $OUT"
        exit "$status"
        ;;
    async)
        setup || exit 1
        # Decode graphs do not capture under expandable segments (rollout/engine/graphs.py):
        # both placements run with the default allocator, graphs on.
        unset PYTORCH_CUDA_ALLOC_CONF
        # shellcheck disable=SC2086
        # a run past ASYNC_RUN_TIMEOUT seconds leaves every rank's Python stacks in its log
        python3 tools/bench_async.py --tasks ${ASYNC_TASKS:-256 8-512} \
            --steps "${ASYNC_STEPS:-6}" --staleness "${ASYNC_STALENESS:-1}" --work "$WORK" \
            --placements ${ASYNC_PLACEMENTS:-colocated separate} \
            --run-timeout "${ASYNC_RUN_TIMEOUT:-150}" --out "$OUT" 2>&1 | tee -a "$LOG" || status=1
        echo "gpu_e2e async: exit $status; results in $OUT/bench_async.md"
        exit "$status"
        ;;
    all)
        setup || exit 1
        twin dense qwen3_8b_long_sp_twin 8192 4 || status=1
        twin moe qwen3_30b_a3b_moe_twin 4096 8 || status=1
        maxctx || status=1
        ;;
    *)
        echo "usage: $0 [dense|moe|moe_twin|moe_ep|maxctx|step|scale8b|full8|partial|memory|async_sync|async|all]"
        exit 2
        ;;
esac
summarize || status=1
echo "gpu_e2e $MODE: exit $status; results in $OUT"
exit "$status"
