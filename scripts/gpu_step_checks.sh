#!/usr/bin/env bash
# The GPU step's checks on one lent CUDA GPU, in ONE call that ends by a deadline (default 540 s
# after the start), results in $OUT (docs/gpu_checks.md; docs/training_step.md, docs/bench_step.md).
#
#   bash scripts/gpu_step_checks.sh                 # on the GPU machine (OUT set by the device tool)
#   bash scripts/gpu_step_checks.sh --dry-run       # the plan: steps, commands, timeouts, files
#   bash scripts/gpu_step_checks.sh --device cpu    # the same script end to end on a CPU (tiny recipes)
#   options: --tiny (the SmolLM2 recipes at 1 x 64 on the GPU too), --budget S (default 540)
#
# The machine starts bare with no network: python3 with torch, triton, transformers, accelerate and
# pytest, no draftsmith and no pydantic. Before the steps: the wheels of gpu_kit/wheels (`make
# gpu-kit`, carried as `gpu_kit`) go into a --target folder, and a folder holding one symbolic link
# `draftsmith -> <this checkout>` makes the checkout importable as draftsmith (the repository root
# is the package, whatever the checkout's folder is called); both go first on PYTHONPATH. Hub and
# transformers run offline; the Triton and inductor caches live in the run folder (shared by steps:
# a kernel compiled by the tests is a cache hit for the benchmark).
#
# Steps, in priority order; each runs under `timeout`, its limit min(its cap, time left - reserve),
# and is skipped when that is below its minimum:
#   kit  install the wheels, link the package
#   e    (in the background from the start, on the CPU, CUDA hidden: it needs no GPU) benchmarks.step
#        estimates of the steps c and d measure -> 4_bench_step.jsonl
#   a    environment: torch, triton, device, capability, the fused loss available and run once against
#        the chunked loss, torch.compile on the device -> 0_env.txt
#   b    pytest -m gpu tests/gpu/test_gpu_step.py -> 1_gpu_step_tests.txt
#   c    benchmarks.gpu --profile of the default step (packed rows, flex, fused loss, compiled
#        layers), gptoss120b then llama3_1_8b, one process each -> 2_default_step.json
#   d    the control: gptoss120b's step as measured at 9d88ba7 (466.0 ms on an H200: SDPA, unpacked,
#        chunked loss, eager layers, no sliding window, every position real) -> 3_control.json
# c and d log to 5_bench_gpu_log.txt; 6_timeline.txt has the plan, each step's limit, rc and seconds,
# and a summary beside the reference numbers. Exit 1 when a step of a-d failed or timed out.
set -uo pipefail

usage() { sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

DRY=0 DEVICE=cuda TINY=0 BUDGET=${GPU_CHECKS_BUDGET:-540}
while (($#)); do
    case $1 in
        --dry-run) DRY=1 ;;
        --device) DEVICE=${2:?--device needs cuda or cpu}; shift ;;
        --device=*) DEVICE=${1#--device=} ;;
        --tiny) TINY=1 ;;
        --budget) BUDGET=${2:?--budget needs seconds}; shift ;;
        --budget=*) BUDGET=${1#--budget=} ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_step_checks: unknown argument $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done
case $DEVICE in cuda|cuda:*) ;; cpu) TINY=1 ;; *) echo "gpu_step_checks: --device cuda or cpu, not $DEVICE" >&2; exit 2 ;; esac
[[ $BUDGET =~ ^[0-9]+$ ]] || { echo "gpu_step_checks: --budget must be whole seconds" >&2; exit 2; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
KIT=${KIT_DIR:-$REPO/gpu_kit}
OUT=${OUT:-$KIT/out}
PY=${PYTHON:-python3}
RESERVE=15   # seconds kept after the last step: merging the JSON files, the summary
GRACE=5      # timeout's --kill-after: a step that ignores SIGTERM is killed this much later
# the control: the recipe settings gained since the 9d88ba7 measurement, turned back off
# (benchmarks/step.py MEASURED_SETS where it exists; tests/unit/test_gpu_kit.py keeps them equal)
AS_MEASURED=(train.fused_loss=false train.compile=false train.packing=false draft.sliding_window=null)
AS_MEASURED_ARGS=$(printf -- ' --set %s' "${AS_MEASURED[@]}")

if ((TINY)); then
    DEFAULT_RECIPES=(smollm2_135m)
    CONTROL_RECIPE=smollm2_135m
    if [[ $DEVICE == cpu ]]; then BACKEND=sdpa; else BACKEND=flex; fi  # no flex backward on a CPU
    BENCH_SIZE="--tiny --device $DEVICE --steps 1 --warmup 1"
    STEP_SIZE="--batch-size 1 --max-length 64"
else
    DEFAULT_RECIPES=(gptoss120b llama3_1_8b)
    CONTROL_RECIPE=gptoss120b
    BACKEND=flex
    BENCH_SIZE="--device $DEVICE --steps 5 --warmup 2"
    STEP_SIZE=""
fi

if ((DRY)); then RUN=${GPU_KIT_RUN:-/tmp/draftsmith_gpu_kit.XXXXXX}
else
    RUN=${GPU_KIT_RUN:-$(mktemp -d "${TMPDIR:-/tmp}/draftsmith_gpu_kit.XXXXXX")}
    mkdir -p "$RUN" "$OUT"
fi
q() { printf '%q' "$1"; }
R=$(q "$RUN") O=$(q "$OUT") P=$(q "$PY")

# ---------------------------------------------------------------------------------------------
# the steps: name, cap (s), minimum worth starting (s), what it writes, the command
NAMES=() CAPS=() MINS=() WRITES=() CMDS=()
add() { NAMES+=("$1"); CAPS+=("$2"); MINS+=("$3"); WRITES+=("$4"); CMDS+=("$5"); }

add kit 20 1 "6_timeline.txt" \
    "$P -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --target $R/site $(q "$KIT")/wheels/*.whl >> $O/6_timeline.txt 2>&1"
add a_env 60 15 "0_env.txt" \
    "$P $R/bin/env_check.py --device $DEVICE > $O/0_env.txt 2>&1"
add b_tests 240 60 "1_gpu_step_tests.txt" \
    "$P -m pytest -v -rA -p no:cacheprovider --timeout=170 -m gpu tests/gpu/test_gpu_step.py > $O/1_gpu_step_tests.txt 2>&1"
c_cap=(150 120)
for i in "${!DEFAULT_RECIPES[@]}"; do
    r=${DEFAULT_RECIPES[$i]}
    add "c_default_$r" "${c_cap[$i]:-120}" 60 "2_default_step.json" \
        "echo '=== c: default step $r' >> $O/5_bench_gpu_log.txt; $P -m benchmarks.gpu --recipes $r --backends $BACKEND $BENCH_SIZE --no-capture --no-fake --profile --out $R/2_$r.json >> $O/5_bench_gpu_log.txt 2>&1"
done
add "d_control_$CONTROL_RECIPE" 75 30 "3_control.json" \
    "echo '=== d: control $CONTROL_RECIPE as measured at 9d88ba7' >> $O/5_bench_gpu_log.txt; $P -m benchmarks.gpu --recipes $CONTROL_RECIPE --backends sdpa --lengths full $BENCH_SIZE --no-capture --no-fake --no-flop-count --profile$AS_MEASURED_ARGS --out $R/3_control.json >> $O/5_bench_gpu_log.txt 2>&1"
# f: the last, if time is left: speculators 0.9's EAGLE-3 trainer step beside ours on the same shapes
add f_vs_speculators 90 45 "7_vs_speculators.json" \
    "echo '=== f: vs speculators (llama3_1_8b)' >> $O/5_bench_gpu_log.txt; $P -m benchmarks.vs_speculators --recipe llama3_1_8b --workdir $R --out $O/7_vs_speculators.json >> $O/5_bench_gpu_log.txt 2>&1"
# e: in the background, from the kit on; no GPU (CUDA hidden), one core, low priority
BG_NAME=e_bench_step BG_CAP=300 BG_MIN=30
BG_CMD="CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 nice -n 10 $P $R/bin/bench_step.py --out $O/4_bench_step.jsonl --control $CONTROL_RECIPE --default ${DEFAULT_RECIPES[*]}${STEP_SIZE:+ $STEP_SIZE} --as-measured ${AS_MEASURED[*]}"
FILES=(0_env.txt 1_gpu_step_tests.txt 2_default_step.json 3_control.json 4_bench_step.jsonl 5_bench_gpu_log.txt 6_timeline.txt 7_vs_speculators.json)

# ---------------------------------------------------------------------------------------------
plan() {
    echo "gpu_step_checks plan: device $DEVICE$( ((TINY)) && echo ', tiny recipes'), python $PY, budget $BUDGET s from the start, reserve $RESERVE s, kill grace $GRACE s"
    echo "checkout $REPO -> importable as draftsmith through $RUN/pkgs/draftsmith; kit $KIT/wheels -> $RUN/site; OUT $OUT"
    echo "each step's timeout = min(cap, budget - elapsed - reserve - grace); below its minimum it is skipped"
    local t=0 i to
    printf '%-28s %5s %5s %9s %9s  %s\n' step cap min timeout starts_by writes
    for i in "${!NAMES[@]}"; do
        to=$(( BUDGET - RESERVE - GRACE - t )); (( to > CAPS[i] )) && to=${CAPS[i]}
        if (( to < MINS[i] )); then
            printf '%-28s %5s %5s %9s %9s  %s\n' "${NAMES[i]}" "${CAPS[i]}" "${MINS[i]}" skipped "$t" "${WRITES[i]}"
        else
            printf '%-28s %5s %5s %9s %9s  %s\n' "${NAMES[i]}" "${CAPS[i]}" "${MINS[i]}" "$to" "$t" "${WRITES[i]}"
            t=$(( t + to + GRACE ))
        fi
        printf '    $ %s\n' "${CMDS[i]}"
    done
    to=$(( BUDGET - RESERVE - GRACE - CAPS[0] - GRACE )); (( to > BG_CAP )) && to=$BG_CAP
    printf '%-28s %5s %5s %9s %9s  %s\n' "$BG_NAME (background)" "$BG_CAP" "$BG_MIN" "$to" "${CAPS[0]}+$GRACE" 4_bench_step.jsonl
    printf '    $ %s\n' "$BG_CMD"
    echo "worst case, every step at its timeout: the steps end by $t s, the summary by $(( t + RESERVE )) s (budget $BUDGET s)"
    echo "total_worst_case_s=$(( t + RESERVE ))"
    echo "output_files=${#FILES[@]} (at most 8): ${FILES[*]}"
}

if ((DRY)); then plan; exit 0; fi

# ---------------------------------------------------------------------------------------------
# the run
SECONDS=0
TL=$OUT/6_timeline.txt
for f in "${FILES[@]}"; do rm -f "$OUT/$f"; done  # a skipped step leaves no stale file of an earlier run
: > "$TL"
log() { printf '[%3d s] %s\n' "$SECONDS" "$*" | tee -a "$TL"; }
plan >> "$TL"
cleanup() { [[ -z ${GPU_KIT_RUN:-} ]] && rm -rf "$RUN"; }
trap cleanup EXIT

mkdir -p "$RUN/bin" "$RUN/pkgs" "$RUN/site" "$RUN/cache/triton" "$RUN/cache/inductor" "$RUN/cache/hf"
ln -sfn "$REPO" "$RUN/pkgs/draftsmith"
export PYTHONPATH=$RUN/pkgs:$RUN/site${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HOME=$RUN/cache/hf
export TRITON_CACHE_DIR=$RUN/cache/triton TORCHINDUCTOR_CACHE_DIR=$RUN/cache/inductor
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

cat > "$RUN/bin/env_check.py" <<'PYEOF'
"""Step a: one line per fact about the machine and whether the GPU step's pieces run on it."""
import argparse, inspect, json, os, platform, shutil, subprocess, sys, time

p = argparse.ArgumentParser()
p.add_argument("--device", default="cuda")
dev_arg = p.parse_args().device
env = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
       "cpus": os.cpu_count(), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}


def check(name, fn):
    t0 = time.perf_counter()
    try:
        env[name] = fn()
    except Exception as exc:  # noqa: BLE001 - every fact is recorded, the next still runs
        env[name] = f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    env[name + "_s"] = round(time.perf_counter() - t0, 2)
    print(f"{name}: {env[name]}  ({env[name + '_s']} s)", flush=True)


def nvidia_smi():
    if not shutil.which("nvidia-smi"):
        return "not on PATH"
    return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                           "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()


def versions():
    import importlib.metadata as md
    out = {}
    for dist in ("torch", "triton", "transformers", "accelerate", "pydantic", "pydantic-core", "typing-extensions",
                 "numpy", "safetensors", "huggingface-hub", "tokenizers", "pyyaml", "pytest", "pytest-timeout"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    return out


def imports():
    import draftsmith, pydantic, typing_extensions
    return {"draftsmith": draftsmith.__file__, "pydantic": pydantic.__file__,
            "typing_extensions": typing_extensions.__file__}


check("nvidia_smi", nvidia_smi)
check("versions", versions)
check("imports", imports)
import torch  # noqa: E402

dev = torch.device(dev_arg)


def device():
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available()}
    if dev.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(dev)
        out.update(name=props.name, capability=list(torch.cuda.get_device_capability(dev)),
                   memory_gib=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count,
                   bf16=torch.cuda.is_bf16_supported())
    return out


def fused_loss():
    from draftsmith.train import losses
    from draftsmith.train.fused_loss import fused_linear_distill, fused_loss_available
    from draftsmith.train.losses import LossSpec, chunked_distill

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ok, why = fused_loss_available(dev, dtype)
    out = {"available": ok, "why_not": why}
    if not ok:
        return out
    g = torch.Generator(device=dev).manual_seed(0)
    M, N, H, V = 300, 200, 128, 32000
    x = torch.randn(M, H, device=dev, dtype=dtype, generator=g).requires_grad_()
    w = (0.05 * torch.randn(V, H, device=dev, dtype=dtype, generator=g)).requires_grad_()
    teacher = (3 * torch.randn(N, V, device=dev, generator=g)).to(dtype)
    idx = torch.randint(0, N, (M,), device=dev, generator=g)
    rw = torch.rand(M, device=dev, generator=g)
    logits_fn = lambda h: torch.nn.functional.linear(h, w)  # noqa: E731
    if "fused" in inspect.signature(chunked_distill).parameters:  # the setting passed to the loss
        ref = chunked_distill(x, logits_fn, teacher, idx, rw, LossSpec(), fused=False)
    else:  # the process-wide setting of older checkouts
        saved = losses.FUSED_LOSS
        try:
            losses.set_fused_loss(False)
            ref = chunked_distill(x, logits_fn, teacher, idx, rw, LossSpec())
        finally:
            losses.set_fused_loss(saved)
    gx_ref, gw_ref = torch.autograd.grad(ref.loss_sum, [x, w])
    t0 = time.perf_counter()
    got = fused_linear_distill(x, w, teacher, idx, rw, LossSpec())  # the Triton op, called directly
    gx, gw = torch.autograd.grad(got.loss_sum, [x, w])
    torch.cuda.synchronize(dev)
    out.update(first_call_s=round(time.perf_counter() - t0, 2),
               loss_rel_err=float((got.loss_sum - ref.loss_sum).abs().detach() / ref.loss_sum.abs().detach().clamp_min(1e-9)),
               grad_x_max_err=float((gx.float() - gx_ref.float()).abs().max()),
               grad_w_max_err=float((gw.float() - gw_ref.float()).abs().max()),
               hit_equal=bool(torch.equal(got.row_hit, ref.row_hit)))
    return out


def compile_works():
    def f(a, b):
        return torch.nn.functional.gelu(a @ b).sum(-1) * 2 + 1

    a = torch.randn(256, 256, device=dev)
    b = torch.randn(256, 256, device=dev)
    t0 = time.perf_counter()
    cf = torch.compile(f, fullgraph=True)
    got = cf(a, b)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    first = time.perf_counter() - t0
    torch.testing.assert_close(got, f(a, b), rtol=1e-2, atol=1e-2)
    return {"works": True, "first_call_s": round(first, 2)}


def flex():
    from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    return "importable"


check("device", device)
check("fused_loss", fused_loss)
check("torch_compile", compile_works)
check("flex_attention", flex)
env.update({k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TRITON_CACHE_DIR",
                                           "TORCHINDUCTOR_CACHE_DIR", "CUDA_VISIBLE_DEVICES")})
print("json: " + json.dumps(env, default=str), flush=True)
PYEOF

cat > "$RUN/bin/bench_step.py" <<'PYEOF'
"""Step e: benchmarks.step's estimates of the default steps and of the control, one JSON line each."""
import argparse, contextlib, io, json, os, sys, time

sys.path.insert(0, os.getcwd())  # the checkout: benchmarks/ (a script's own folder is first otherwise)
p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--default", nargs="+", default=[])
p.add_argument("--control", required=True)
p.add_argument("--batch-size")
p.add_argument("--max-length")
p.add_argument("--as-measured", nargs="+", default=[])
a = p.parse_args()
from benchmarks import step  # noqa: E402

size = [f for k, v in (("--batch-size", a.batch_size), ("--max-length", a.max_length)) if v for f in (k, v)]
cases = [(f"default {r}", [r, *size, "--json"]) for r in a.default]
cases.append((f"control {a.control}", [a.control, *size, "--attention", "sdpa",
                                         *[x for s in a.as_measured for x in ("--set", s)], "--json"]))
with open(a.out, "a") as f:
    for case, argv in cases:
        t0 = time.perf_counter()
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                rc = step.main(argv)
            estimate, error = json.loads(buf.getvalue()), None
        except BaseException as exc:  # noqa: BLE001 - recorded; the next case still runs
            rc, estimate, error = getattr(exc, "code", 1), None, f"{type(exc).__name__}: {exc}"
        f.write(json.dumps({"case": case, "argv": argv, "rc": rc, "seconds": round(time.perf_counter() - t0, 1),
                            "error": error, "estimate": estimate}) + "\n")
        f.flush()
        print(f"bench step {case}: rc {rc} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
PYEOF

cat > "$RUN/bin/finish.py" <<'PYEOF'
"""After the steps: 2_default_step.json (one benchmarks.gpu result per recipe), 3_control.json, and a
summary beside the reference numbers (the 9d88ba7 measurement, benchmarks.step's estimates)."""
import json, os, sys
from pathlib import Path

run, out, control = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
recipes = sys.argv[4:]


def load(path):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {"missing": f"{path.name}: not written (the step failed, timed out or was skipped: 6_timeline.txt)"}
    except ValueError as exc:
        return {"missing": f"{path.name}: unreadable ({exc})"}


default = {r: load(run / f"2_{r}.json") for r in recipes}
(out / "2_default_step.json").write_text(json.dumps({"recipes": default}, indent=1))
ctl = load(run / "3_control.json")
reference = None
try:
    sys.path.insert(0, os.getcwd())
    from benchmarks.step import H200_MEASURED, H200_PROFILE
    reference = {"commit": "9d88ba7", "ms_per_step": H200_MEASURED.get((control, "sdpa", 2, 4096)),
                 "profile_ms_per_step": H200_PROFILE.get((control, "sdpa", 2, 4096))}
except Exception as exc:  # noqa: BLE001
    reference = {"error": f"{type(exc).__name__}: {exc}"}
ctl["reference_9d88ba7"] = reference
(out / "3_control.json").write_text(json.dumps(ctl, indent=1))

estimates = {}
try:
    for line in (out / "4_bench_step.jsonl").read_text().splitlines():
        row = json.loads(line)
        e = row.get("estimate") or {}
        estimates[row["case"]] = (e.get("est_ms") or {}).get("h200")
except (FileNotFoundError, ValueError):
    pass


def rows(result):
    return [r for r in result.get("rows", []) if isinstance(r, dict)]


print("summary (ms/step on this device; reference = 9d88ba7's H200 figure; estimate = benchmarks.step):")
for name, result in [*((f"default {r}", default[r]) for r in recipes), (f"control {control}", ctl)]:
    if "missing" in result:
        print(f"  {name}: {result['missing']}")
        continue
    for r in rows(result):
        if r.get("error"):
            print(f"  {name} ({r.get('attention_backend', '-')}): error {r['error']}")
            continue
        extra = {k: r[k] for k in ("fused_loss_ran", "compiled_regions", "compile_s", "graphs_after_first_step")
                 if k in r}
        prof = (r.get("profile") or {}).get("device_ms_per_step")
        print(f"  {name} ({r.get('attention_backend')}, {r.get('batch_size')} x {r.get('max_length')}): "
              f"{r.get('ms_per_step', float('nan')):.1f} ms/step, {r.get('useful_tokens_per_s', 0):,.0f} useful tok/s, "
              f"MFU {r.get('mfu')}, profiled kernel time {prof} ms/step, estimate {estimates.get(name)} ms"
              + (f", {extra}" if extra else ""))
print(f"  control reference at 9d88ba7: {reference}")
PYEOF

# run_step NAME CAP MIN CMD: under timeout min(CAP, time left - reserve - grace), or skipped
run_step() {
    local name=$1 cap=$2 min=$3 cmd=$4 left to t0 rc what
    left=$(( BUDGET - SECONDS - RESERVE - GRACE ))
    to=$(( cap < left ? cap : left ))
    if (( to < min )); then
        log "$name: skipped ($left s left before the reserve, needs $min s)"
        return 0
    fi
    log "$name: start, timeout $to s"
    t0=$SECONDS
    timeout -k "$GRACE" "$to" bash -c "$cmd"
    rc=$?
    case $rc in 0) what=ok ;; 124|137) what="TIMED OUT" ;; *) what=failed ;; esac
    log "$name: rc $rc ($what) after $(( SECONDS - t0 )) s of $to s"
    return "$rc"
}

log "start: $(date -u +%FT%TZ) on ${HOSTNAME:-?}; $("$PY" --version 2>&1)"
# kit: on the interpreter the wheels are for (cp312); elsewhere (a CPU checkout's .venv) its own packages
if [[ $("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) == 3.12 ]]; then
    if compgen -G "$KIT/wheels/*.whl" > /dev/null; then
        run_step "${NAMES[0]}" "${CAPS[0]}" "${MINS[0]}" "${CMDS[0]}"
    else
        log "kit: NO WHEELS in $KIT/wheels: run \`make gpu-kit\` here and carry gpu_kit (docs/gpu_checks.md); going on"
    fi
else
    log "kit: skipped: $PY is not Python 3.12 (the kit's cp312 wheels); using its own packages"
fi
log "draftsmith from: $("$PY" -c 'import draftsmith, pydantic; print(draftsmith.__file__, "; pydantic", pydantic.VERSION)' 2>&1 | tail -1)"

# e in the background, its limit fixed now
bg_to=$(( BUDGET - SECONDS - RESERVE - GRACE )); (( bg_to > BG_CAP )) && bg_to=$BG_CAP
: > "$OUT/4_bench_step.jsonl"
if (( bg_to >= BG_MIN )); then
    log "$BG_NAME: start in the background, timeout $bg_to s"
    ( t0=$SECONDS; timeout -k "$GRACE" "$bg_to" bash -c "$BG_CMD" 2> "$RUN/bench_step.err"; rc=$?
      log "$BG_NAME: rc $rc after $(( SECONDS - t0 )) s of $bg_to s (background)" ) &
    BG_PID=$!
else
    log "$BG_NAME: skipped ($bg_to s left)"
    BG_PID=
fi

FAILS=()
for i in $(seq 1 $(( ${#NAMES[@]} - 1 ))); do
    # f (the optional comparison) failing does not fail the run
    run_step "${NAMES[i]}" "${CAPS[i]}" "${MINS[i]}" "${CMDS[i]}" || [[ ${NAMES[i]} == f_* ]] || FAILS+=("${NAMES[i]}")
done

[[ -n $BG_PID ]] && wait "$BG_PID"
[[ -s $RUN/bench_step.err ]] && { echo "--- $BG_NAME stderr (tail)"; tail -n 20 "$RUN/bench_step.err"; } >> "$TL"
timeout -k 2 "$(( RESERVE - 3 ))" "$PY" "$RUN/bin/finish.py" "$RUN" "$OUT" "$CONTROL_RECIPE" "${DEFAULT_RECIPES[@]}" 2>&1 | tee -a "$TL"
n=$(find "$OUT" -type f | wc -l)
log "done: $n files in $OUT (at most 8 come back): $(cd "$OUT" && ls | tr '\n' ' ')"
if ((${#FAILS[@]})); then log "failed or timed out: ${FAILS[*]}"; exit 1; fi
