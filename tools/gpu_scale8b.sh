# shellcheck shell=bash
# `bash tools/gpu_e2e.sh scale8b`: issue 42's Qwen3-8B table on 4 GPUs (sourced by gpu_e2e.sh,
# which defines setup, train, synthetic, $WORK, $OUT, $LOG). The real 36-layer shape with random
# weights: recipes/qwen3_8b_long_sp.yaml with checkpoint.load=null, TP4 + SP, DP 1, fused path,
# model.recompute_granularity=$SCALE8B_RECOMPUTE (auto: the memory plan's choice, logged at
# start-up). Rows (SCALE8B_ROWS, default "a b"; "c" takes most of a 10-minute call alone):
#   a  on-policy, built-in engine: 512 x (264 prompt + 1024 response, ignore_eos), 16k
#      micro-batches, one mini-batch
#   b  rollouts from files: SCALE8B_FILE_PROMPTS (4) x 8 samples of 2048 + 30720 tokens, 32k
#      micro-batches, 4 mini-batches
#   c  on-policy, built-in engine: 256 x (256 + 3840) (NeMo-RL's 4k setting), 16k micro-batches
# SCALE8B_SET: extra settings for every row, space-separated key=value (e.g.
# "rollout.colocated.weights=replica"). SCALE8B_STEPS (3) steps each; step 1 is warm-up. Rows a
# and c: decode CUDA graphs on (the default allocator; SCALE8B_ALLOC_CONF sets another). $OUT/scale8b.md: the step split, tokens/s
# per GPU (step and update) and the update's MFU per GPU (model FLOPs: 6 x matmul weights per
# token + causal attention, over SCALE8B_PEAK_TFLOPS (989, H100/H200 bf16 dense)).

SCALE8B_BASE=(--set checkpoint.load=null --set training.steps="${SCALE8B_STEPS:-3}"
    --set model.recompute_granularity="${SCALE8B_RECOMPUTE:-auto}")
SCALE8B_ENGINE=(--set rollout.input_path=null --set rollout.task=reverse_digits
    --set rollout.sampling.ignore_eos=true --set training.mini_batches_per_step=1
    --set training.max_tokens_per_micro_batch=16384)

# scale8b_args ROW: the row's trainer arguments into SCALE8B_ARGS (row b writes its synthetic
# rollouts first); tools/gpu_full8.sh runs the same rows at other layouts.
scale8b_args() {
    case "$1" in
        a) SCALE8B_ARGS=("${SCALE8B_BASE[@]}" "${SCALE8B_ENGINE[@]}"
            --set rollout.reverse_digits.num_digits=262 --set rollout.max_prompt_length=264
            --set rollout.max_response_length=1024 --set rollout.num_prompts=64) ;;
        b)
            local data="$WORK/scale8b_rollouts" prompts=${SCALE8B_FILE_PROMPTS:-4}
            synthetic "$data" $((prompts * ${SCALE8B_STEPS:-3})) 8 2048 30720 || return 1
            SCALE8B_ARGS=("${SCALE8B_BASE[@]}" --set rollout.input_path="$data"
                --set rollout.num_prompts="$prompts" --set training.mini_batches_per_step=4) ;;
        c) SCALE8B_ARGS=("${SCALE8B_BASE[@]}" "${SCALE8B_ENGINE[@]}"
            --set rollout.reverse_digits.num_digits=254 --set rollout.max_prompt_length=256
            --set rollout.max_response_length=3840 --set rollout.num_prompts=32) ;;
        *) echo "unknown SCALE8B_ROWS entry $1"; return 1 ;;
    esac
}

scale8b_row() {
    local row=$1
    local LOG="$OUT/scale8b_$row.log"  # this row's output (train appends to $LOG)
    scale8b_args "$row" || return 1
    # The engine rows (a, c) run the product's default allocator: decode CUDA graphs do not
    # capture under gpu_e2e's expandable segments (issue 42's first table ran them so: graphs
    # off). SCALE8B_ALLOC_CONF overrides it for them; row b (rollout files) keeps gpu_e2e's.
    local alloc=$PYTORCH_CUDA_ALLOC_CONF
    [ "$row" != b ] && alloc=${SCALE8B_ALLOC_CONF-}
    echo "scale8b_$row: PYTORCH_CUDA_ALLOC_CONF='$alloc'" | tee -a "$LOG"
    local extra=() kv
    for kv in ${SCALE8B_SET:-}; do extra+=(--set "$kv"); done
    PYTORCH_CUDA_ALLOC_CONF=$alloc NPROC=4 train "scale8b_${row}_fused" qwen3_8b_long_sp fused \
        "${SCALE8B_ARGS[@]}" "${extra[@]}"
    local rc=$?
    echo "scale8b_$row: $(grep -h -m1 "recompute_granularity=auto" "$LOG")"
    return $rc
}

scale8b() {
    local status=0 row
    [ "$NGPU" -ge 4 ] || { echo "scale8b needs 4 GPUs ($NGPU here)"; return 1; }
    for row in ${SCALE8B_ROWS:-a b}; do
        scale8b_row "$row" || status=1
    done
    python3 tools/scale8b_table.py "$WORK" "$OUT/scale8b.md" --gpus 4 \
        --peak-tflops "${SCALE8B_PEAK_TFLOPS:-989}" 2>&1 | tee -a "$LOG" || status=1
    return $status
}
