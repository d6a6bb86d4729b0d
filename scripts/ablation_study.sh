#!/usr/bin/env bash
# Named training variants at equal data and equal training tokens, on the machine it runs on: the
# same recipe, data, seed and epochs for every variant, each variant's own --set options on top,
# then vLLM MT-bench acceptance of each export. Every stage is a draftsmith command; this script
# only chains them (scripts/loss_study.sh is this driver with one variant per draft.loss).
#
#   VARIANTS="base:'' noise:'--set draft.aux_noise_std=0.05' muon:'--set train.optimizer=muon'" \
#       scripts/ablation_study.sh DATA MT_BENCH OUT
#
# DATA: a prepared RUN_DIR/data folder (e.g. the self-distilled set: `draftsmith prepare
# recipes/smollm2_135m.yaml --set "data.sources=[{path: regen.jsonl}]" --set data.regenerate.enabled=false`).
# VARIANTS: space-separated NAME:'OPTIONS' (shell quoting, as in the example; OPTIONS may be empty).
# EPOCHS (default 1), RECIPE, EXTRA_SETS (--set options for every variant), PROMPTS_N (80),
# NEW_TOKENS (128), TEMPERATURES (0; e.g. 0,1: one engine measures each, acceptance.json's
# by_temperature) select the runs; SIM_DATA (a prepared data folder of held-out conversations) adds
# `draftsmith simulate` at TEMPERATURES on it (OUT/NAME/simulate.json). Finished work (an export, an acceptance JSON) is kept, so a
# stopped study continues; a variant whose training fails is logged and skipped (rerun to retry).
# Acceptance lengths do not depend on timing, so the study may share the machine; its training
# seconds and tok/s (OUT/NAME/train.log's last line) do.
set -euo pipefail
DATA=$(realpath -m "$1"); MT_BENCH=$(realpath -m "$2"); OUT=$3
DS=${DRAFTSMITH:-draftsmith}
RECIPE=${RECIPE:-recipes/smollm2_135m.yaml}
TARGET_DIR=${TARGET_DIR:-$HOME/.cache/draftsmith/targets/SmolLM2-135M-Instruct}
PROMPTS_N=${PROMPTS_N:-80}; NEW_TOKENS=${NEW_TOKENS:-128}; EPOCHS=${EPOCHS:-1}
eval "SPECS=(${VARIANTS:?set VARIANTS, e.g. VARIANTS=\"base:'' muon:'--set train.optimizer=muon'\"})"
# the data keys DATA was prepared with (its spec.json), so that training on it is not refused as another
# recipe's data (a variant's own --set comes after them)
DATA_SETS=()
while IFS= read -r line; do DATA_SETS+=(--set "$line"); done < <(python3 - "$DATA/spec.json" <<'PY'
import json, sys
spec = json.load(open(sys.argv[1]))
keys = {k: v for stage in spec.values() if isinstance(stage, dict) for k, v in stage.items()
        if k.startswith("data.") and not k.endswith(".content")}
for k, v in keys.items():
    print(f"{k}={json.dumps(v)}")
PY
)
mkdir -p "$OUT"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/driver.log"; }

names=()
for spec in "${SPECS[@]}"; do
    name=${spec%%:*}; eval "sets=(${spec#*:})"
    [[ "$spec" == *:* && "$name" =~ ^[A-Za-z0-9_.=-]+$ ]] || { log "bad variant '$spec' (want NAME:'OPTIONS')"; exit 2; }
    names+=("$name"); run="$OUT/$name"
    if [ ! -f "$run/export/config.json" ]; then
        mkdir -p "$run"; [ -e "$run/data" ] || ln -s "$DATA" "$run/data"
        log "train $name: $EPOCHS epochs ${sets[*]:-}"
        # shellcheck disable=SC2086
        if ! $DS train "$RECIPE" --run-dir "$run" --overwrite --no-prepare --set train.epochs="$EPOCHS" \
                --set train.checkpoint_every=100000 "${DATA_SETS[@]}" ${EXTRA_SETS:-} "${sets[@]}" > "$run/train.log" 2>&1 \
            || ! $DS export "$run" --out "$run/export" > "$run/export.log" 2>&1; then
            log "  FAILED (see $run/train.log, $run/export.log)"; continue
        fi
        log "  trained: $(grep '"tokens_per_s"' "$run/train.log" | tail -1)"
    fi
    if [ ! -s "$run/acceptance.json" ]; then
        log "acceptance $name"
        $DS acceptance --recipe "$RECIPE" --target "$TARGET_DIR" --draft "$run/export" --prompts "$MT_BENCH" \
            --max-prompts "$PROMPTS_N" --max-new-tokens "$NEW_TOKENS" --temperature "${TEMPERATURES:-0}" \
            --out "$run/acceptance.json" > "$run/acceptance.log" 2>&1 || log "  FAILED (see $run/acceptance.log)"
    fi
    if [ -n "${SIM_DATA:-}" ] && [ ! -s "$run/simulate.json" ]; then
        log "simulate $name"
        $DS simulate --draft "$run/export" --data "$SIM_DATA" --temperatures "${TEMPERATURES:-0}" \
            --out "$run/simulate.json" > "$run/simulate.log" 2>&1 || log "  FAILED (see $run/simulate.log)"
    fi
done
log "done: ${names[*]}"
