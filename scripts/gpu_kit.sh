#!/usr/bin/env bash
# `make gpu-kit`: download the wheels the lent GPU machine lacks for scripts/gpu_step_checks.sh into
# gpu_kit/wheels (git-ignored), for CPython 3.12 on manylinux x86_64, and print the kit's size beside
# the 64 MiB that may travel with the working tree (docs/gpu_checks.md).
#
# That machine has no network and no draftsmith install; what it has is listed in
# tests/unit/test_gpu_kit.py (LENT_MACHINE), which also checks that every third-party import the
# checks reach is there or in WHEELS below, and that each wheel's own requirements are covered.
#
#   bash scripts/gpu_kit.sh            # or: make gpu-kit
#   KIT_DIR=/elsewhere bash scripts/gpu_kit.sh
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KIT_DIR=${KIT_DIR:-$REPO/gpu_kit}
WHEEL_DIR=$KIT_DIR/wheels
LIMIT_MIB=64  # what travels: the working tree plus the carried paths, together (the device tool's limit)

# One wheel a line: "name==version"  # why the lent machine needs it. Pinned to what the CPU .venv
# runs the same code with; --no-deps, so every requirement of a wheel here must be on the machine or
# in this list (tests/unit/test_gpu_kit.py checks both against the downloaded wheels' METADATA).
WHEELS=(
    "pydantic==2.14.4"          # recipe.py, layout.py, draft_section.py, models/*/recipe.py, eval/profile.py: module-level `from pydantic import ...` (the recipe schema every check loads)
    "pydantic-core==2.50.5"     # pydantic 2.14.4 pins it exactly (Requires-Dist); compiled: the cp312 manylinux2014 wheel
    "annotated-types==0.8.0"    # pydantic's Requires-Dist (annotated-types>=0.6.0)
    "typing-inspection==0.4.5"  # pydantic's Requires-Dist (typing-inspection>=0.4.4)
    "speculators==0.9.0"        # benchmarks/vs_speculators.py (the last, optional step): speculators' Eagle3DraftModel beside ours; imported with its data-pipeline module stubbed, so none of its datasets / openai / hs-connectors requirements are needed (docs/vs_speculators.md)
    "loguru==0.7.3"             # speculators' logging, imported with its models
    "typing-extensions==4.16.0" # pydantic, pydantic-core and typing-inspection require >=4.16.0; the image has typing-extensions at a version nobody recorded (torch needs only >=4.10): this one shadows it (pure Python, backward-compatible)
)

PY=${PYTHON:-}
if [[ -z $PY ]]; then
    if [[ -x $REPO/.venv/bin/python ]]; then PY=$REPO/.venv/bin/python; else PY=python3; fi
fi

mkdir -p "$WHEEL_DIR"
# a fresh folder each time: a stale second version of a package would stop the install there
tmp=$(mktemp -d "$KIT_DIR/.download.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$tmp" "${WHEELS[@]}"
rm -f "$WHEEL_DIR"/*.whl
mv "$tmp"/*.whl "$WHEEL_DIR"/

n=$(find "$WHEEL_DIR" -maxdepth 1 -name '*.whl' | wc -l)
if [[ $n -ne ${#WHEELS[@]} ]]; then
    echo "gpu_kit: expected ${#WHEELS[@]} wheels, got $n in $WHEEL_DIR" >&2
    exit 1
fi
kit_bytes=$(du -sb "$KIT_DIR" | cut -f1)  # all of it travels with carry: ["gpu_kit"]
tree_bytes=$(cd "$REPO" && git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
mib() { awk -v b="$1" 'BEGIN { printf "%.2f", b / 1048576 }'; }
ls -l "$WHEEL_DIR"
echo "gpu_kit: $n wheels; ${KIT_DIR#"$REPO"/}/ holds $(mib "$kit_bytes") MiB; working tree that travels $(mib "$tree_bytes") MiB;" \
     "together $(mib $((kit_bytes + tree_bytes))) of $LIMIT_MIB MiB"
if (( kit_bytes + tree_bytes > LIMIT_MIB * 1048576 )); then
    echo "gpu_kit: over the $LIMIT_MIB MiB the device tool carries" >&2
    exit 1
fi
