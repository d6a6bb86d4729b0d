"""EAGLE-3 draft layers of the target's family (``draft.layer``: llama, qwen3, mla).

vLLM parity of the exported layers is tests/with_vllm/test_vllm_eagle3_layers_parity.py; here:
a training step trains every tensor of each layer, cached inference is the TTT step, the MLA
layer started from a DeepSeek-V2 target layer (transformers' own implementation) computes that
layer, the geometry comes from the target and the recipe, exports load back and warm-start, and
bad inputs give one line naming the key, the value and what works.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, LlamaConfig, Qwen3Config

from draftsmith.eval.export import export, load_export
from draftsmith.methods import method_of_export
from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.model import Eagle3DraftModel, Eagle3KVCache
from draftsmith.models.eagle3.warm_start import WarmStartError, load_init_weights, read_init_draft, warm_config
from draftsmith.recipe import RecipeError, load_recipe

from helpers.tiny import random_eagle3_model as model_of, write_draft_checkpoint

H, V, VD, T = 64, 256, 128, 10
MLA = dict(q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
        "mscale_all_dim": 1.0}


def config(layer: str, **kw) -> Eagle3Config:
    heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    if layer == "mla":
        heads = dict(num_attention_heads=4, num_key_value_heads=4, head_dim=24, **MLA)
    return Eagle3Config(hidden_size=H, intermediate_size=96, vocab_size=V, draft_vocab_size=VD, aux_layer_ids=[0, 1, 3],
                        max_position_embeddings=512, layer=layer, **heads, **kw)


LAYERS = {"llama": {}, "qwen3": {}, "mla": {}, "mla_yarn": dict(rope_scaling=YARN)}


@pytest.mark.parametrize("case", LAYERS)
def test_a_training_step_trains_every_tensor_of_the_layer(case):
    model = model_of(config(case.removesuffix("_yarn"), **LAYERS[case]))
    gen = torch.Generator().manual_seed(1)
    ids, aux = torch.randint(0, V, (2, T), generator=gen), torch.randn(2, T, 3 * H, generator=gen)
    labels = torch.randint(0, VD, (3, 2, T), generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def loss() -> torch.Tensor:
        logits = model(ids, aux, ttt_steps=3)  # 3 TTT steps, each (2, T, Vd)
        return sum(0.8**k * F.cross_entropy(lg.flatten(0, 1), labels[k].flatten()) for k, lg in enumerate(logits))

    first = loss()
    first.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    opt.step()
    for _ in range(4):
        opt.zero_grad()
        loss().backward()
        opt.step()
    assert loss() < first


@pytest.mark.parametrize("layer", ["qwen3", "mla"])
def test_cached_chained_inference_is_the_ttt_unroll(layer):
    """The reference decoder's chain (step 0 over the prompt, then one cached step per drafted token
    at the next position) computes TTT step 1 at the prompt's last position."""
    model = model_of(config(layer)).eval()
    gen = torch.Generator().manual_seed(2)
    ids, aux = torch.randint(0, V, (1, T), generator=gen), torch.randn(1, T, 3 * H, generator=gen)
    with torch.no_grad():
        ttt = model(ids, aux, ttt_steps=2)
        cache = Eagle3KVCache()
        g = model.fuse(aux)
        h0 = model.step_cached(ids[:, 1:T - 1], g[:, :T - 2], torch.arange(T - 2)[None], cache)
        h1 = model.step_cached(ids[:, T - 1:], model.next_hidden(h0[:, -1:]), torch.tensor([[T - 2]]), cache)
    torch.testing.assert_close(model.compute_logits(h0), ttt[0][:, :T - 2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.compute_logits(h1)[:, 0], ttt[1][:, T - 3], rtol=1e-5, atol=1e-5)


def tiny_deepseek(**kw) -> DeepseekV2Config:
    """A DeepSeek-V2 target: layer 0 dense, layer 1 mixture-of-experts."""
    return DeepseekV2Config(vocab_size=V, hidden_size=H, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, first_k_dense_replace=1,
                            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, max_position_embeddings=256,
                            rms_norm_eps=1e-6, **{**MLA, **kw})


def test_mla_layer_started_from_a_deepseek_layer_computes_that_layer():
    """transformers' DeepseekV2 decoder layer is the independent reference of our MLA attention
    (latent projections, per-head split, interleaved RoPE, softmax scale) and of the copy map."""
    cfg = tiny_deepseek()
    torch.manual_seed(0)
    target = DeepseekV2ForCausalLM(cfg).eval()
    with torch.no_grad():  # weights well away from transformers' 0.02 init, norms away from one
        for name, p in target.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    state = target.state_dict()
    dense = {k.removeprefix("model.layers.0."): v for k, v in state.items() if k.startswith("model.layers.0.")}
    draft = Eagle3DraftModel(Eagle3Config.from_target(cfg, VD, [0, 1, 1], norm_before_residual=False, layer="mla"))
    assert draft.init_layer_from_target(dense) == []  # every target tensor has its place
    seen = {}
    target.model.layers[0].register_forward_hook(
        lambda mod, args, kwargs, out: seen.update(x=kwargs.get("hidden_states", args[0] if args else None), y=out[0] if isinstance(out, tuple) else out),
        with_kwargs=True)
    ids = torch.arange(3, 19)[None]
    attn = draft.layers[0].self_attn
    with torch.no_grad():
        target(input_ids=ids)
        attn.q_a_proj.weight[:, :H] = 0  # the next token's embedding reads nothing
        attn.kv_a_proj_with_mqa.weight[:, :H] = 0
        out = draft.step(ids, seen["x"], torch.arange(16)[None], [])
    assert seen["y"].abs().max() > 1.0  # a real signal
    torch.testing.assert_close(out, seen["y"], rtol=1e-5, atol=1e-5)

    moe = {k.removeprefix("model.layers.1."): v for k, v in state.items() if k.startswith("model.layers.1.")}
    with pytest.raises(KeyError, match="a mixture-of-experts layer: start from one of the target's dense layers"):
        draft.init_layer_from_target(moe)


def test_qwen3_layer_takes_the_targets_q_and_k_norms():
    model = model_of(config("qwen3"))
    attn = model.layers[0].self_attn
    layer = {f"self_attn.{n}.weight": torch.randn(*s) for n, s in
             (("q_proj", (64, H)), ("k_proj", (32, H)), ("v_proj", (32, H)), ("o_proj", (H, 64)), ("q_norm", (16,)),
              ("k_norm", (16,)))}
    layer |= {f"mlp.{n}.weight": torch.randn(*s) for n, s in (("gate_proj", (96, H)), ("up_proj", (96, H)),
                                                               ("down_proj", (H, 96)))}
    layer |= {"input_layernorm.weight": torch.randn(H), "post_attention_layernorm.weight": torch.randn(H)}
    assert model.init_layer_from_target(layer) == []
    assert torch.equal(attn.q_norm.weight, layer["self_attn.q_norm.weight"])
    assert torch.equal(attn.k_proj.weight[:, H:], layer["self_attn.k_proj.weight"])
    # the Llama layer has no place for them, and says so
    assert model_of(config("llama")).init_layer_from_target(layer) == ["self_attn.k_norm.weight",
                                                                      "self_attn.q_norm.weight"]


def test_geometry_from_the_target_and_the_recipe():
    cfg = Eagle3Config.from_target(tiny_deepseek(rope_scaling=YARN), VD, [0, 1, 1], layer="mla", mla={"kv_lora_rank": 48})
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (24, 48, 16, 8, 12)
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.rope_scaling["rope_type"]) == (24, 4, "yarn")
    qwen = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32)
    assert Eagle3Config.from_target(qwen, VD, [0, 1, 1], layer="qwen3").head_dim == 32


def one_line(exc: BaseException) -> str:
    message = str(exc)
    assert "\n" not in message
    return message


def test_bad_layers_are_one_line_naming_key_value_and_what_works():
    llama = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(ValueError) as caught:
        Eagle3Config.from_target(llama, VD, [0, 1, 1], layer="mla")
    assert one_line(caught.value) == ("draft.layer=mla: the target (llama) has no multi-head latent attention (no "
                                      "kv_lora_rank in its config), and vLLM's deepseek_eagle3 drafts for "
                                      "DeepSeek-V2/V3-style targets; use draft.layer llama or qwen3")
    with pytest.raises(ValueError) as caught:  # DeepSeek-V2-Lite: no query LoRA
        Eagle3Config.from_target(tiny_deepseek(q_lora_rank=None), VD, [0, 1, 1], layer="mla")
    assert one_line(caught.value).startswith("draft.mla.q_lora_rank: the target has none (a full-rank q_proj) and "
                                             "vLLM 0.32's deepseek_eagle3 loads an MLA draft only with a low-rank query")
    assert Eagle3Config.from_target(tiny_deepseek(q_lora_rank=None), VD, [0, 1, 1], layer="mla",
                                    mla={"q_lora_rank": 16}).q_lora_rank == 16

    def problem(*overrides: str) -> str:
        with pytest.raises(RecipeError) as caught:
            load_recipe(None, ["draft.method=eagle3", *overrides])
        return one_line(caught.value)

    assert problem("draft.layer=gemma3").endswith(
        "draft.layer: 'gemma3' is no EAGLE-3 draft layer vLLM serves; known: llama (vLLM's llama_eagle3), "
        "qwen3 (vLLM's qwen3_eagle3), mla (vLLM's deepseek_eagle3)")
    assert "draft.norm_before_fc=true: vLLM's deepseek_eagle3 (draft.layer mla) has no input_norm before fc; set " \
           "draft.norm_before_fc false" in problem("draft.layer=mla", "draft.norm_before_fc=true")
    assert "draft.sliding_window=256: vLLM's deepseek_eagle3 (draft.layer mla) attends the whole context" in problem(
        "draft.layer=mla", "draft.sliding_window=256")
    assert "draft.mla is set but draft.layer is qwen3" in problem("draft.layer=qwen3", "draft.mla.kv_lora_rank=64")
    with pytest.raises(ValueError) as caught:  # an export's config: the key without the recipe's prefix
        config("qwen3", mlp_bias=True)
    assert one_line(caught.value) == "mlp_bias=true: vLLM's qwen3_eagle3 (layer qwen3) has no MLP biases; use layer llama"


@pytest.mark.parametrize("layer,legacy", [("qwen3", False), ("qwen3", True), ("mla", False)])
def test_export_loads_back_and_warm_starts(tmp_path, layer, legacy):
    model = model_of(config(layer)).eval()
    embed = model.embed_tokens.clone()
    write_draft_checkpoint(model, tmp_path / "ckpt", "eagle3", {"name_or_path": "tiny"}, ttt_steps=3)
    out = export(tmp_path / "ckpt", tmp_path / "export", legacy=legacy, embed_tokens=embed)
    raw = json.loads((out / "config.json").read_text())
    assert method_of_export(raw).name == "eagle3"
    expected = {("qwen3", False): ("Eagle3DraftModel", "qwen3"), ("qwen3", True): ("Eagle3Qwen3ForCausalLM", "qwen3"),
                ("mla", False): ("Eagle3DeepseekV2ForCausalLM", "deepseek_v2")}[layer, legacy]
    assert (raw["architectures"][0], (raw.get("transformer_layer_config") or raw)["model_type"]) == expected
    gen = torch.Generator().manual_seed(3)
    ids, aux = torch.randint(0, V, (1, T), generator=gen), torch.randn(1, T, 3 * H, generator=gen)
    loaded = load_export(out)
    assert loaded.config == model.config
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, aux, ttt_steps=2), model(ids, aux, ttt_steps=2), rtol=0, atol=0)

    init = read_init_draft(out)  # draft.init_from: the same tensors in a fresh model
    warm = Eagle3DraftModel(warm_config(init, config(layer)))
    warm.init_from_target(embed)
    warm.set_vocab_mapping(torch.arange(VD), torch.arange(V) % 2 == 0)
    assert load_init_weights(warm, init)["lm_head_rows"] == VD
    with torch.no_grad():
        torch.testing.assert_close(warm.eval()(ids, aux, ttt_steps=2), model(ids, aux, ttt_steps=2), rtol=0, atol=0)


def test_a_speculators_layer_of_another_family_is_still_refused(tmp_path):
    model = model_of(config("qwen3"))
    write_draft_checkpoint(model, tmp_path / "ckpt", "eagle3", {"name_or_path": "tiny"}, ttt_steps=3)
    out = export(tmp_path / "ckpt", tmp_path / "export")
    raw = json.loads((out / "config.json").read_text())
    raw["transformer_layer_config"]["model_type"] = "gemma3"
    (out / "config.json").write_text(json.dumps(raw))
    with pytest.raises(WarmStartError) as caught:
        read_init_draft(out)
    assert one_line(caught.value).endswith("transformer_layer_config.model_type 'gemma3': draftsmith's eagle3 draft is "
                                           "built from Llama or Qwen3 decoder layers")


# ------------------------------------------------------------------------------------------
# The MLA layer at GPU shapes: a fused attention kernel, and the dry run's geometry


def test_mla_attention_takes_the_fused_kernel_and_equals_the_unpadded_attention():
    """q / k (24 wide) and v (12) differ in width: the values are zero-padded to 24 so that SDPA takes
    its fused kernel (on this CPU, flash; on CUDA, the memory-efficient one) instead of the math path,
    which materialises every head's scores; the output is the same attention."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from draftsmith.models.eagle3.mla import pad_values

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    model = model_of(config("mla", norm_before_residual=False))
    ids, hidden = torch.randint(0, V, (2, T)), torch.randn(2, T, 3 * H)
    with Ops() as ops:
        loss = model(ids, hidden, ttt_steps=2)[0].float().square().mean()
        loss.backward()
    assert any(n.startswith("_scaled_dot_product_flash_attention_for_cpu") for n in ops.names)
    assert not any("softmax" in n for n in ops.names), "the math path materialised the attention scores"
    q, k, v = torch.randn(1, 4, T, 24), torch.randn(1, 4, 2 * T, 24), torch.randn(1, 4, 2 * T, 12)
    mask = torch.ones(T, 2 * T, dtype=torch.bool).tril(diagonal=T)
    padded = F.scaled_dot_product_attention(q, k, pad_values(v, 24), attn_mask=mask)
    torch.testing.assert_close(padded[..., :12], F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert padded[..., 12:].abs().max() == 0


def test_the_dry_run_counts_the_mla_layer_as_built():
    from draftsmith.models.common import LayerGeometry
    from draftsmith.models.eagle3.training import parameter_estimate

    target = tiny_deepseek()
    geometry = LayerGeometry.from_target(target, VD, [0, 1, 1])
    assert geometry.mla == MLA and "mla" not in geometry.fields()
    recipe = load_recipe(None, ["draft.layer=mla", "draft.norm_before_fc=false"])
    counts, _ = parameter_estimate(recipe, geometry, V)
    draft = Eagle3DraftModel(Eagle3Config.from_target(target, VD, [0, 1, 1], layer="mla",
                                                      norm_before_residual=recipe.draft.norm_before_residual))
    built = {n: p.numel() for n, p in draft.named_parameters()}
    assert counts["attention"] == sum(v for n, v in built.items() if ".self_attn." in n and "layernorm" not in n)
    trainable = sum(v for k, v in counts.items() if not k.startswith("frozen_"))
    assert trainable == sum(p.numel() for n, p in draft.named_parameters() if p.requires_grad)
    assert LayerGeometry.from_target(Qwen3Config(vocab_size=V, hidden_size=H, num_attention_heads=4), VD, [0, 1, 1]).mla is None
