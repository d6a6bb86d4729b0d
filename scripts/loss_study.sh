#!/usr/bin/env bash
# EAGLE-3 losses at equal data and equal training tokens (issue 17's loss study), on the machine it
# runs on: the same recipe, data, seed and step count for every draft.loss, then vLLM MT-bench
# acceptance of each export. Every stage is a draftsmith command; this script only chains them.
#
#   scripts/loss_study.sh DATA MT_BENCH OUT
#
# DATA: a prepared RUN_DIR/data folder (e.g. the self-distilled set: `draftsmith prepare
# recipes/smollm2_135m.yaml --set "data.sources=[{path: regen.jsonl}]" --set data.regenerate.enabled=false`).
# LOSSES (default: all six), EPOCHS (default 1), RECIPE, EXTRA_SETS (more --set options) select the runs.
# Finished work (an export, an acceptance JSON) is kept, so a stopped study continues; acceptance
# lengths do not depend on timing, so the study may share the machine.
set -euo pipefail
DATA=$(realpath -m "$1"); MT_BENCH=$(realpath -m "$2"); OUT=$3
DS=${DRAFTSMITH:-draftsmith}
RECIPE=${RECIPE:-recipes/smollm2_135m.yaml}
TARGET_DIR=${TARGET_DIR:-$HOME/.cache/draftsmith/targets/SmolLM2-135M-Instruct}
PROMPTS_N=${PROMPTS_N:-80}; NEW_TOKENS=${NEW_TOKENS:-128}; EPOCHS=${EPOCHS:-1}
read -r -a LOSSES <<< "${LOSSES:-forward_kl reverse_kl jsd tv lk_alpha lk_lambda}"
mkdir -p "$OUT"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/driver.log"; }

for loss in "${LOSSES[@]}"; do
    run="$OUT/$loss"
    if [ ! -f "$run/export/config.json" ]; then
        mkdir -p "$run"; [ -e "$run/data" ] || ln -s "$DATA" "$run/data"
        log "train $loss: $EPOCHS epochs"
        # shellcheck disable=SC2086
        $DS train "$RECIPE" --run-dir "$run" --overwrite --no-prepare --set draft.loss="$loss" \
            --set train.epochs="$EPOCHS" --set train.checkpoint_every=100000 ${EXTRA_SETS:-} > "$run/train.log" 2>&1
        $DS export "$run" --out "$run/export" > "$run/export.log" 2>&1
        log "  trained: $(grep -o '"seconds": [0-9.]*' "$run/train.log" | tail -1)"
    fi
    if [ ! -s "$run/acceptance.json" ]; then
        log "acceptance $loss"
        $DS acceptance --recipe "$RECIPE" --target "$TARGET_DIR" --draft "$run/export" --prompts "$MT_BENCH" \
            --max-prompts "$PROMPTS_N" --max-new-tokens "$NEW_TOKENS" --temperature 0 \
            --out "$run/acceptance.json" > "$run/acceptance.log" 2>&1 || log "  FAILED (see $run/acceptance.log)"
    fi
done
log "done: ${LOSSES[*]}"
