#!/usr/bin/env bash
# EAGLE-3 losses at equal data and equal training tokens (issue 17's loss study), on the machine it
# runs on: the same recipe, data, seed and step count for every draft.loss, then vLLM MT-bench
# acceptance of each export. scripts/ablation_study.sh with one variant per loss (OUT/LOSS).
#
#   scripts/loss_study.sh DATA MT_BENCH OUT
#
# DATA: a prepared RUN_DIR/data folder (e.g. the self-distilled set: `draftsmith prepare
# recipes/smollm2_135m.yaml --set "data.sources=[{path: regen.jsonl}]" --set data.regenerate.enabled=false`).
# LOSSES (default: all six), EPOCHS (default 1), RECIPE, EXTRA_SETS (more --set options) select the runs.
# Finished work (an export, an acceptance JSON) is kept, so a stopped study continues; acceptance
# lengths do not depend on timing, so the study may share the machine.
set -euo pipefail
read -r -a LOSSES <<< "${LOSSES:-forward_kl reverse_kl jsd tv lk_alpha lk_lambda}"
VARIANTS=""
for loss in "${LOSSES[@]}"; do VARIANTS+="$loss:'--set draft.loss=$loss' "; done
VARIANTS=$VARIANTS exec "$(dirname "$0")/ablation_study.sh" "$@"
