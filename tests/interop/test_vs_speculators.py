"""The CPU dry run of ``benchmarks/vs_speculators.py`` (docs/vs_speculators.md) in the interop
environment, the one interpreter holding both speculators 0.9.0 and what draftsmith's step needs:
the tiny geometry runs to its end, speculators' ``Eagle3DraftModel`` built by its own
``from_training_args`` from the synthetic verifier folder, and the output says how far its step got
on a CPU (torch refuses flex_attention with autograd there) and what was timed instead.

The checkout is importable as ``draftsmith`` through a folder holding one link ``draftsmith ->
<checkout>`` (the repository root is the package), as on the lent GPU machine. Skips without the
interop environment (``make interop``).
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# runs the benchmark's main() in the interop interpreter with the checkout importable as draftsmith
RUN = r'''
import sys
link_dir, root, *argv = sys.argv[1:]
sys.path[:0] = [link_dir, root]
from benchmarks.vs_speculators import main
sys.exit(main(argv))
'''


def _link(tmp_path: Path) -> Path:
    folder = tmp_path / "pkgs"
    folder.mkdir()
    (folder / "draftsmith").symlink_to(ROOT, target_is_directory=True)
    return folder


def _dry_run(in_speculators, tmp_path: Path, *extra: str) -> tuple[str, dict]:
    out = tmp_path / "vs.json"
    printed = in_speculators(RUN, str(_link(tmp_path)), str(ROOT), "--tiny", "--device", "cpu", "--steps", "1",
                             "--warmup", "0", "--workdir", str(tmp_path), "--out", str(out), *extra)
    return printed, json.loads(out.read_text())


def test_tiny_cpu_dry_run_completes(in_speculators, tmp_path):
    printed, result = _dry_run(in_speculators, tmp_path)
    sp, ours = result["speculators"], result["draftsmith"]
    assert sp["error"] is None and ours["error"] is None, (sp.get("error"), ours.get("error"))
    assert "ms_per_step" in sp and "ms_per_step" in ours, printed
    st = result["settings"]
    assert st["tokens"] == 256 and sum(st["document_lengths"]) == 256 and st["Vd"] == 256
    # the speculators model really came from the verifier folder (its weights' file was written and read)
    assert sp["verifier_folder"]["bytes"] > 2 * st["V"] * st["H"] * 4  # embedding + lm_head, fp32 (TINY_TARGET)
    assert sp["trainable_parameters"] > 0 and ours["trainable_parameters"] > 0
    assert sp["head_rows_per_step"] == st["ttt_steps"] * st["tokens"] >= ours["head_rows_per_step"]
    assert sp["how_far"] and sp["how_far"] in printed
    if sp["timed"].startswith("forward only"):  # torch 2.13 on a CPU: no flex backward
        assert result["degraded"] and "DEGRADED" in printed and sp["backward_error"]
        assert ours["timed"].startswith("forward only")
        whole = result["draftsmith_whole_step"]
        assert whole["error"] is None and whole["timed"].startswith("forward + backward")
    else:  # a torch with a CPU flex backward: the whole step on both sides
        assert result["degraded"] is None and ours["timed"].startswith("forward + backward")
    assert result["ratio"] is not None and result["ratio"]["ms_per_step"] > 0
    assert "ours / theirs" in printed and "not matched:" in printed


def test_speculators_side_with_its_data_pipeline_stubbed(in_speculators, tmp_path):
    """The lent GPU machine's path: speculators' Eagle3 imported without openai / datasets /
    hs_connectors (its data pipeline's packages), ``speculators.train.data`` stubbed."""
    printed, result = _dry_run(in_speculators, tmp_path, "--only", "speculators", "--stub-speculators-data")
    sp = result["speculators"]
    assert sp["error"] is None and "ms_per_step" in sp, printed
    assert sp["import"].startswith("with speculators.train.data stubbed")
    assert result["draftsmith"] is None and result["ratio"] is None
