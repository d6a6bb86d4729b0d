#!/usr/bin/env bash
# EAGLE-3 vs P-EAGLE vs DFlash on SmolLM2-135M-Instruct at equal data and equal training time
# (issue 16's comparison), on the machine it runs on. Every stage is a draftsmith command; this
# script only chains them and picks the step counts that give each method the same wall time.
#
#   scripts/compare_parallel_drafts.sh DEMO_DATA SD_DATA MT_BENCH OUT
#
# DEMO_DATA / SD_DATA: prepared RUN_DIR/data folders (`draftsmith prepare recipes/smollm2_135m.yaml`;
# the DFlash and P-EAGLE recipes share the EAGLE-3 recipe's data section, so one folder serves all).
# MT_BENCH: MT-bench question.jsonl. OUT: output folder (runs, exports, acceptance and serving JSON).
#
# Equal time: EAGLE-3 trains first (the demo recipe's 336 steps on the demo data, one epoch on the
# self-distilled set); every other method then gets the wall time EAGLE-3 took, through
# train.max_time_minutes (stop at the budget; warmup and cosine decay fit inside it).
#
# Stages (STAGES, default all, in this order): demo-train demo-accept sd-train sd-accept serve.
# Training and serving measure wall time: run them on an otherwise idle machine. Acceptance
# lengths do not depend on timing, so the accept stages can share the CPU with other work.
# Finished work (an export, an acceptance or serving JSON) is kept, so a stopped run continues.
# DEMO_METHODS / SD_METHODS / SERVE_METHODS pick the drafts; K_SWEEP the K values swept at
# concurrency 1 for the EAGLE-3 and P-EAGLE drafts (a DFlash draft serves only K = block_size - 1).
set -euo pipefail
DEMO_DATA=$(realpath -m "$1"); SD_DATA=$(realpath -m "$2"); MT_BENCH=$(realpath -m "$3"); OUT=$4
DS=${DRAFTSMITH:-draftsmith}
TARGET=${TARGET:-embedded:SmolLM2-135M-Instruct}
TARGET_DIR=${TARGET_DIR:-$HOME/.cache/draftsmith/targets/SmolLM2-135M-Instruct}  # acceptance takes a directory
PROMPTS_N=${PROMPTS_N:-80}; NEW_TOKENS=${NEW_TOKENS:-128}
mkdir -p "$OUT"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/driver.log"; }

# name recipe extra-sets...
declare -A RECIPE=([eagle3]=recipes/smollm2_135m.yaml [peagle]=recipes/smollm2_135m_peagle.yaml
                   [dflash_b8]=recipes/smollm2_135m_dflash.yaml [dflash_b4]=recipes/smollm2_135m_dflash.yaml
                   [dflash_l3]=recipes/smollm2_135m_dflash.yaml)
declare -A EXTRA=([eagle3]="" [peagle]=""
                  [dflash_b8]="--set draft.block_size=8 --set eval.num_speculative_tokens=7"
                  [dflash_b4]="--set draft.block_size=4 --set eval.num_speculative_tokens=3"
                  [dflash_l3]="--set draft.num_layers=3 --set draft.num_anchors=64 --set draft.block_size=8 --set eval.num_speculative_tokens=7")
declare -A K=([eagle3]=3 [peagle]=3 [dflash_b8]=7 [dflash_b4]=3 [dflash_l3]=7)
STAGES=${STAGES:-demo-train demo-accept sd-train sd-accept serve}
read -r -a DEMO_METHODS <<< "${DEMO_METHODS:-eagle3 peagle dflash_b8}"
read -r -a SD_METHODS <<< "${SD_METHODS:-eagle3 peagle dflash_b4 dflash_b8}"
read -r -a SERVE_METHODS <<< "${SERVE_METHODS:-${SD_METHODS[*]}}"
K_SWEEP=${K_SWEEP:-1,2,3,4}

seconds_of() { python -c "import json,glob,sys; p=sorted(glob.glob(sys.argv[1]+'/checkpoints/step-*/train_state.json'), key=lambda s:int(s.split('step-')[1].split('/')[0]))[-1]; s=json.load(open(p)); print(s['train_seconds']/s['step'] if sys.argv[2]=='per_step' else s['train_seconds'])" "$1" "$2"; }

train() {  # data name steps|seconds N: a step count, or a wall-time budget in seconds
    local data=$1 name=$2 kind=$3 n=$4
    local run="$OUT/$data/$name"
    [ -f "$run/export/$name/config.json" ] && { log "train $data/$name: done before, kept"; return 0; }
    mkdir -p "$run"; [ -e "$run/data" ] || ln -s "$( [ "$data" = demo ] && echo "$DEMO_DATA" || echo "$SD_DATA")" "$run/data"
    local budget="--set train.max_steps=$n"
    [ "$kind" = seconds ] && budget="--set train.max_steps=1000000 --set train.max_time_minutes=$(python -c "print($n / 60)")"
    log "train $data/$name: $kind $n"
    # shellcheck disable=SC2086
    $DS train "${RECIPE[$name]}" --run-dir "$run" --overwrite --no-prepare $budget \
        --set train.checkpoint_every=100000 ${EXTRA[$name]} > "$run/train.log" 2>&1
    log "  done: $(seconds_of "$run" total) s"
    $DS export "$run" --out "$run/export/$name" > "$run/export.log" 2>&1
}

accept() {  # data name temperature
    local run="$OUT/$1/$2"
    local t=$3
    [ -s "$run/acceptance_t$t.json" ] && return 0
    log "acceptance $1/$2 T=$t"
    $DS acceptance --recipe "${RECIPE[$2]}" --target "$TARGET_DIR" --draft "$run/export/$2" --prompts "$MT_BENCH" \
        --max-prompts "$PROMPTS_N" --max-new-tokens "$NEW_TOKENS" --k "${K[$2]}" --temperature "$t" \
        --out "$run/acceptance_t$t.json" > "$run/acceptance_t$t.log" 2>&1 || log "  FAILED (see $run/acceptance_t$t.log)"
}

stage() { [[ " $STAGES " == *" $1 "* ]]; }

# 1. demo data: EAGLE-3 with the demo recipe (336 steps), then every other method for the same
# wall time (train.max_time_minutes: training stops at the budget, warmup + cosine fit inside it)
if stage demo-train; then
    train demo eagle3 steps "${DEMO_EAGLE3_STEPS:-336}"
    demo_budget=$(seconds_of "$OUT/demo/eagle3" total)
    for m in "${DEMO_METHODS[@]}"; do [ "$m" = eagle3 ] || train demo "$m" seconds "$demo_budget"; done
fi
if stage demo-accept; then
    for m in "${DEMO_METHODS[@]}"; do accept demo "$m" 0; accept demo "$m" 0.7; done
fi

# 2. self-distilled data: EAGLE-3 one epoch, the others the same wall time
if stage sd-train; then
    sd_rows=$(python -c "import datasets,sys; print(len(datasets.load_from_disk(sys.argv[1])))" "$SD_DATA/tokenized")
    batch=$(python -c "import sys; from draftsmith.recipe import load_recipe; print(load_recipe(sys.argv[1]).train.batch_size)" "${RECIPE[eagle3]}")
    train sd eagle3 steps $(( (sd_rows + batch - 1) / batch ))
    sd_budget=$(seconds_of "$OUT/sd/eagle3" total)
    for m in "${SD_METHODS[@]}"; do [ "$m" = eagle3 ] || train sd "$m" seconds "$sd_budget"; done
fi
if stage sd-accept; then
    for m in "${SD_METHODS[@]}"; do accept sd "$m" 0; accept sd "$m" 0.7; done
fi

# 3. serving (self-distilled drafts): output tok/s vs no speculation at concurrency 1 and 4
if stage serve; then
    for m in "${SERVE_METHODS[@]}"; do
        [ -s "$OUT/serve/$m/results.json" ] && continue
        sweep=$K_SWEEP; [[ $m == dflash* ]] && sweep=""
        log "serve-bench $m"
        $DS serve-bench --recipe "${RECIPE[$m]}" --target "$TARGET" --draft "$OUT/sd/$m/export/$m" --prompts "$MT_BENCH" \
            --concurrency 1,4 --num-prompts-per-level 8 --max-new-tokens "$NEW_TOKENS" --k "${K[$m]}" \
            --k-sweep "$sweep" --your-concurrency 1 --temperatures 0 --no-ngram --out-dir "$OUT/serve/$m" \
            > "$OUT/serve_$m.log" 2>&1 || log "  FAILED (see $OUT/serve_$m.log)"
    done
fi
log "done: $STAGES"
