# shellcheck shell=bash
# `bash tools/gpu_e2e.sh full8`: issue 40's runs of the full recipes on one 8-GPU host (sourced by
# gpu_e2e.sh after tools/gpu_scale8b.sh: setup, train, synthetic, scale8b_args, $WORK, $OUT,
# $LOG). Random weights (checkpoint.load=null), fused path, FULL8_STEPS (3) steps each, step 1
# warm-up. Rows (FULL8_ROWS, default all four; a 10-minute call fits about two):
#   moe_file    recipes/qwen3_30b_a3b_moe.yaml at EP 8 (TP2+SP, DP4), the recipe's settings
#               (full recompute, 16k micro-batches, 4 mini-batches) on synthetic rollouts:
#               FULL8_MOE_PROMPTS (4) x 8 samples of 2048 + 14336 tokens a step; as many of the
#               48 layers as the dry run's plan fits in the GPU (tools/full8_plan.py
#               --fit-layers: 85% of torch's device memory, as recompute auto plans), or
#               FULL8_LAYERS
#   moe_engine  the same model on-policy, built-in engine, toy task: 512 x (264 + 1024),
#               ignore_eos, one mini-batch (scale8b row a's settings); decode in CUDA graphs,
#               so the allocator runs with PYTORCH_CUDA_ALLOC_CONF=$FULL8_ENGINE_ALLOC_CONF ("")
#   8b_a, 8b_b  recipes/qwen3_8b_long_sp.yaml at TP4+SP x DP2: scale8b's rows a (on-policy
#               512 x (264 + 1024)) and b (32k synthetic rollouts), the same commands
# FULL8_GPUS=4 runs the 4-GPU stand-ins on a 4-GPU host: the MoE rows at EP 4 (TP2+SP, DP2)
# with the layers that fit there, the 8B rows at TP2+SP x DP2 (FULL8_8B_TP: the 8B rows' TP).
# Per row: $OUT/full8_<row>.log (the dry run's plan, then the run); $OUT/full8.md
# (tools/full8_table.py): step split, tok/s/GPU, update MFU (active FLOPs for MoE) over
# FULL8_PEAK_TFLOPS (989), the peak GiB per rank against the dry run's planned peak.

FULL8_ROWS=${FULL8_ROWS:-moe_file moe_engine 8b_a 8b_b}
FULL8_GPUS=${FULL8_GPUS:-8}
FULL8_STEPS=${FULL8_STEPS:-3}

# full8_device_gib: GPU memory per rank (GiB), what recompute auto sizes against (trainer.py).
full8_device_gib() {
    python3 -c 'import torch; print(f"{torch.cuda.mem_get_info()[1] / 2**30:.2f}")'
}

# full8_run ROW RECIPE ARGS...: the dry run of the row's config, then the run, into
# $OUT/full8_<row>.log.
full8_run() {
    local row=$1 recipe=$2
    shift 2
    local LOG="$OUT/full8_$row.log"  # train appends to $LOG
    echo "== full8_$row: dry run" >>"$LOG"
    python3 -m megatron_grpo.train --config "recipes/$recipe.yaml" --dry-run \
        --world-size "$FULL8_GPUS" --device-memory-gib "$FULL8_GIB" "$@" >>"$LOG" 2>&1 || {
        echo "full8_$row: the dry run failed (see $LOG)" | tee -a "$OUT/e2e.log"
        return 1
    }
    NPROC=$FULL8_GPUS train "full8_${row}_fused" "$recipe" fused "$@"
    local rc=$?
    echo "full8_$row: exit $rc" >>"$OUT/e2e.log"
    return $rc
}

# full8_moe_layers ARGS...: FULL8_LAYERS, else the most layers the plan fits (stdout).
full8_moe_layers() {
    if [ -n "${FULL8_LAYERS:-}" ]; then
        echo "$FULL8_LAYERS"
        return 0
    fi
    local args=() a
    for a in "$@"; do
        [ "$a" = --set ] || args+=(--set "$a")
    done
    python3 tools/full8_plan.py --config recipes/qwen3_30b_a3b_moe.yaml --fit-layers \
        --world-size "$FULL8_GPUS" --device-memory-gib "$FULL8_GIB" "${args[@]}" 2>>"$LOG"
}

full8_row() {
    local row=$1 tp=${FULL8_8B_TP:-$((FULL8_GPUS >= 8 ? 4 : 2))}
    local prompts=${FULL8_MOE_PROMPTS:-4} data="$WORK/full8_moe_rollouts"
    local moe=(--set checkpoint.load=null --set training.steps="$FULL8_STEPS"
        --set parallel.expert_model_parallel_size="$FULL8_GPUS")
    case "$row" in
        moe_file | moe_engine)
            local layers
            layers=$(full8_moe_layers "${moe[@]}" --set rollout.num_prompts="$prompts") ||
                { echo "full8: no layer count fits (see $LOG)" | tee -a "$LOG"; return 1; }
            echo "full8: $layers of 48 layers on $FULL8_GPUS GPUs of $FULL8_GIB GiB" |
                tee -a "$LOG"
            moe+=(--set model.num_layers="$layers") ;;
    esac
    case "$row" in
        moe_file)
            synthetic "$data" $((prompts * FULL8_STEPS)) 8 2048 14336 || return 1
            full8_run moe_file qwen3_30b_a3b_moe "${moe[@]}" --set rollout.input_path="$data" \
                --set rollout.num_prompts="$prompts" ;;
        moe_engine)
            PYTORCH_CUDA_ALLOC_CONF="${FULL8_ENGINE_ALLOC_CONF-}" full8_run moe_engine \
                qwen3_30b_a3b_moe "${moe[@]}" "${SCALE8B_ENGINE[@]}" \
                --set rollout.reverse_digits.num_digits=262 --set rollout.max_prompt_length=264 \
                --set rollout.max_response_length=1024 --set rollout.num_prompts=64
            echo "full8_moe_engine: $(grep -h -m1 "CUDA graphs" "$OUT/full8_moe_engine.log")" |
                tee -a "$LOG" ;;
        8b_a | 8b_b)
            SCALE8B_STEPS=$FULL8_STEPS scale8b_args "${row#8b_}" || return 1
            full8_run "$row" qwen3_8b_long_sp "${SCALE8B_ARGS[@]}" \
                --set training.steps="$FULL8_STEPS" --set parallel.tensor_model_parallel_size="$tp" ;;
        *) echo "unknown FULL8_ROWS entry $row"; return 1 ;;
    esac
}

full8() {
    local status=0 row
    case "$FULL8_GPUS" in
        4 | 8) ;;
        *) echo "FULL8_GPUS must be 8 or 4, got $FULL8_GPUS"; return 1 ;;
    esac
    if [ "$NGPU" -lt "$FULL8_GPUS" ]; then
        echo "full8 needs $FULL8_GPUS GPUs ($NGPU here; FULL8_GPUS=4: the 4-GPU stand-ins)"
        return 1
    fi
    FULL8_GIB=$(full8_device_gib) || return 1
    for row in $FULL8_ROWS; do
        full8_row "$row" || status=1
    done
    python3 tools/full8_table.py "$WORK" "$OUT/full8.md" --gpus "$FULL8_GPUS" \
        --device-memory-gib "$FULL8_GIB" --peak-tflops "${FULL8_PEAK_TFLOPS:-989}" 2>&1 |
        tee -a "$LOG" || status=1
    return $status
}
