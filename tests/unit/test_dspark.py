"""DSpark draft: shapes, the block layout (every slot a next-token prediction), the Markov-corrected
logits, the loss against a computation written out by hand, export tensor set and config, bad
input, and a short training run on the tiny target whose export decodes exactly like plain greedy
decoding through the reference decoder's DSpark proposer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.models.dspark.proposer import DSparkProposer
from draftsmith.eval.export import export
from draftsmith.layout import ExportError
from draftsmith.methods import get_method, method_of_export
from draftsmith.models.dflash.model import DFlashKVCache
from draftsmith.models.dspark.config import DSparkConfig
from draftsmith.models.dspark.format import expected_dspark_weights, load_dspark
from draftsmith.models.dflash.training import sample_anchors
from draftsmith.models.dspark.training import DSparkLossSpec, dspark_loss, dspark_slot_weights
from draftsmith.train.losses import LossSpec, TargetDraftHead

from helpers.tiny import dspark_tiny_config, random_dspark_model, write_draft_checkpoint

TARGET = {"name_or_path": "tiny", "path": "tiny", "architectures": ["LlamaForCausalLM"]}


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def hand_logits(model, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """``lm_head(norm(h)) + W2 @ W1[prev]`` with plain matmuls (vLLM: ``compute_draft_logits`` +
    ``markov_bias(markov_embed(prev))``)."""
    c = model.config
    base = rms(h, model.norm.weight, c.rms_norm_eps) @ model.lm_head.weight.T
    return base + model.markov_head.markov_w1.weight[prev] @ model.markov_head.markov_w2.weight.T


def case(cfg, B=2, T=14, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    aux = torch.randn(B, T, len(cfg.aux_layer_ids) * cfg.target_hidden_size, generator=g)
    final = torch.randn(B, T, cfg.target_hidden_size, generator=g)
    mask = torch.ones(B, T)
    mask[B - 1, 10:] = 0
    return ids, aux, final, mask


# ------------------------------------------------------------------------------------------
# Shapes and the block layout


@pytest.mark.parametrize("with_markov", [True, False])
def test_shapes_of_the_heads_the_forward_and_the_export(with_markov):
    cfg = dspark_tiny_config(confidence_head_with_markov=with_markov)
    model = random_dspark_model(cfg)
    H, r = cfg.hidden_size, cfg.markov_rank
    assert model.markov_head.markov_w1.weight.shape == (cfg.vocab_size, r)
    assert model.markov_head.markov_w2.weight.shape == (cfg.draft_vocab_size, r)
    assert model.confidence_head.proj.weight.shape == (1, H + r if with_markov else H)
    ids, aux, _, mask = case(cfg)
    anchors, valid = sample_anchors(mask, 3, torch.Generator().manual_seed(0))
    assert model(ids, aux, anchors, valid).shape == (2, 3, cfg.block_size, cfg.draft_vocab_size)
    want = expected_dspark_weights(cfg)
    assert want["confidence_head.proj.weight"] == (1, H + r if with_markov else H)
    assert want["confidence_head.proj.bias"] == (1,) and want["markov_head.markov_w2.weight"] == (cfg.draft_vocab_size, r)
    plain = expected_dspark_weights(dspark_tiny_config(confidence_head=False))
    assert not any(k.startswith("confidence_head") for k in plain)
    assert DSparkConfig(**dspark_tiny_config(confidence_head=False).to_dict()).confidence_head is False


def test_every_slot_predicts_the_next_token_with_the_markov_bias_of_the_true_previous_token():
    # Training forward on one anchor a == the inference block [x_a, M, M, M] at positions a..a+3
    # over the context 0..a-1, slot k corrected with W2 @ W1[x_{a+k}].
    cfg = dspark_tiny_config()
    model = random_dspark_model(cfg)
    ids, aux, _, _ = case(cfg, B=1)
    a, Bk = 6, cfg.block_size
    anchors, valid = torch.tensor([[a]]), torch.tensor([[True]])
    with torch.no_grad():
        logits = model(ids, aux, anchors, valid)[0, 0]  # (Bk, Vd)
        cache = DFlashKVCache()
        model.append_context(cache, aux[0, :a], torch.arange(a))
        h = model.propose_hidden(cache, int(ids[0, a]), a, Bk)  # (Bk, H)
    assert h.shape == (Bk, cfg.hidden_size)
    torch.testing.assert_close(logits, hand_logits(model, h, ids[0, a:a + Bk]), rtol=1e-4, atol=1e-4)
    # the bias is not zero and depends on the previous token
    other = hand_logits(model, h, (ids[0, a:a + Bk] + 1) % cfg.vocab_size)
    assert (logits - other).abs().max() > 0.1


@pytest.mark.parametrize("with_markov", [True, False])
def test_dry_run_parameter_estimate_counts_the_models_parameters(with_markov):
    from draftsmith.models.common import LayerGeometry
    from draftsmith.models.dspark.training import parameter_estimate
    from draftsmith.recipe import load_recipe

    recipe = load_recipe(None, ["draft.method=dspark", "draft.markov_rank=6", "draft.num_layers=2",
                                f"draft.confidence_head_with_markov={str(with_markov).lower()}"])
    geometry = LayerGeometry(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=8, vocab_size=50, target_hidden_size=24, rms_norm_eps=1e-5, hidden_act="silu",
                             rope_theta=10000.0, rope_scaling=None, max_position_embeddings=4096, draft_vocab_size=20,
                             aux_layer_ids=(1, 2, 3))
    counts, _ = parameter_estimate(recipe, geometry, 50)
    model = random_dspark_model(dspark_tiny_config(aux_layer_ids=[1, 2, 3], confidence_head_with_markov=with_markov))
    assert sum(v for k, v in counts.items() if not k.startswith("frozen_")) == sum(p.numel() for p in model.parameters())
    assert counts["confidence_head"] == 32 + (6 if with_markov else 0) + 1


# ------------------------------------------------------------------------------------------
# The loss


def test_slot_weights_are_exp_minus_k_over_gamma_from_the_anchor_slot():
    torch.testing.assert_close(dspark_slot_weights(4, 4.0), torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5),
                                                                          math.exp(-0.75)]))


@pytest.mark.parametrize("kind,tau", [("tv", 1.0), ("forward_kl", 1.0), ("forward_kl", 0.5)])
def test_dspark_loss_equals_the_loss_written_out_by_hand(kind, tau):
    """tau (draft.distill_temperature) sharpens the target in the distillation term only: the
    confidence head's target stays the real acceptance probability 1 - TV(p, q)."""
    cfg = dspark_tiny_config()
    model = random_dspark_model(cfg).train()
    with torch.no_grad():  # one target id (30) outside the 20-token draft vocab appears as a label below
        model.confidence_head.proj.weight.normal_()
    ids, aux, final, mask = case(cfg)
    ids[0, 4] = 30
    anchors = torch.tensor([[1, 3, 8], [2, 7, 0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    head = TargetDraftHead(torch.randn(cfg.draft_vocab_size, cfg.target_hidden_size, generator=torch.Generator().manual_seed(3)))
    spec = DSparkLossSpec(LossSpec(kind, target_temperature=tau), ce_weight=0.1, distill_weight=0.9,
                          confidence_weight=1.0)
    weights = dspark_slot_weights(cfg.block_size, 4.0)
    loss, metrics = dspark_loss(model, ids, aux, final, mask, anchors, valid, head, model.t2d, weights, spec,
                                chunk_size=5)
    grads = torch.autograd.grad(loss, [model.markov_head.markov_w1.weight, model.confidence_head.proj.weight,
                                       model.layers[0].self_attn.q_proj.weight])

    # by hand: slot k of anchor a -> label x_{a+k+1}, teacher p_{a+k}, Markov prev x_{a+k}
    h = model.block_hidden(ids, aux, anchors, valid)  # (B, A, Bk, H)
    total, wsum, rows = 0.0, 0.0, 0
    T = ids.shape[1]
    for b in range(2):
        for j in range(3):
            a = int(anchors[b, j])
            for k in range(cfg.block_size):
                t = a + k + 1
                if not valid[b, j] or t >= T or mask[b, t] == 0:
                    continue
                z = hand_logits(model, h[b, j, k], ids[b, a + k])
                log_q = torch.log_softmax(z, -1)
                p = torch.softmax(final[b, a + k] @ head.weight.T, -1)
                p_tau = torch.softmax(final[b, a + k] @ head.weight.T / tau, -1)
                tv = 0.5 * (p - log_q.exp()).abs().sum()
                if kind == "tv":
                    dist = 0.5 * (p_tau - log_q.exp()).abs().sum()
                else:
                    dist = (p_tau * (p_tau.log() - log_q)).sum()
                y = int(ids[b, t])
                ce = -log_q[y] if y < cfg.draft_vocab_size else torch.zeros(())
                normed = rms(h[b, j, k], model.norm.weight, cfg.rms_norm_eps)
                e = model.markov_head.markov_w1.weight[ids[b, a + k]]
                s = torch.sigmoid(torch.cat([normed, e]) @ model.confidence_head.proj.weight[0]
                                  + model.confidence_head.proj.bias[0])
                alpha = (1 - tv).detach()
                bce = -(alpha * torch.log(s) + (1 - alpha) * torch.log(1 - s))
                w = math.exp(-k / 4.0)
                total = total + w * (0.1 * ce + 0.9 * dist + 1.0 * bce)
                wsum += w
                rows += 1
    want = total / wsum
    assert rows == 18  # row 0: 3 anchors x 4 slots; row 1: anchor 2 (t = 3..6) + anchor 7 (t = 8, 9: m[10:] = 0)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    want_grads = torch.autograd.grad(want, [model.markov_head.markov_w1.weight, model.confidence_head.proj.weight,
                                            model.layers[0].self_attn.q_proj.weight])
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)
    assert set(metrics) >= {"loss", "loss_0", "acc_3", "acceptance_length", "alpha"} and 0 < metrics["alpha"] < 1


# ------------------------------------------------------------------------------------------
# Export, config and bad input


def make_checkpoint(tmp_path: Path, cfg: DSparkConfig) -> tuple[Path, dict]:
    state = write_draft_checkpoint(random_dspark_model(cfg), tmp_path / "ckpt", "dspark", TARGET)
    return tmp_path / "ckpt", state


def test_export_writes_the_tensor_set_and_config_vllm_reads(tmp_path):
    cfg = dspark_tiny_config()
    ckpt, state = make_checkpoint(tmp_path, cfg)
    out = export(ckpt, tmp_path / "out")
    weights = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected_dspark_weights(cfg)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert config["sample_from_anchor"] is True and config["markov_head_type"] == "vanilla"
    assert (config["markov_rank"], config["block_size"]) == (cfg.markov_rank, cfg.block_size)
    assert config["enable_confidence_head"] is True and config["confidence_head_with_markov"] is True
    assert config["dflash_config"] == {"mask_token_id": cfg.mask_token_id, "target_layer_ids": [0, 2], "causal": False}
    assert method_of_export(config) is get_method("dspark")  # not DFlash's, whose format DSpark's refines
    loaded = load_dspark(out)
    for k, v in weights.items():
        torch.testing.assert_close(loaded.state_dict()[k], v)
    assert DSparkConfig.from_export(config) == cfg


def test_export_refuses_a_tensor_set_vllm_would_not_load_naming_the_tensors(tmp_path):
    cfg = dspark_tiny_config()
    ckpt, state = make_checkpoint(tmp_path, cfg)
    weights = ckpt / "model.safetensors"
    save_file({k: v.contiguous() for k, v in state.items() if k != "markov_head.markov_w2.weight"}, str(weights))
    with pytest.raises(ExportError, match=r"DSpark layout.*missing \['markov_head.markov_w2.weight'\]"):
        export(ckpt, tmp_path / "a")
    save_file({**{k: v.contiguous() for k, v in state.items()}, "mask_embedding": torch.zeros(32)}, str(weights))
    with pytest.raises(ExportError, match=r"unexpected \['mask_embedding'\]"):
        export(ckpt, tmp_path / "b")
    bad = dict(state, **{"confidence_head.proj.weight": torch.zeros(1, cfg.hidden_size)})  # without the + r
    save_file({k: v.contiguous() for k, v in bad.items()}, str(weights))
    with pytest.raises(ExportError, match=r"confidence_head.proj.weight \(1, 32\) != \(1, 38\)"):
        export(ckpt, tmp_path / "c")


def test_a_k_other_than_the_block_size_is_refused(tmp_path):
    ckpt, _ = make_checkpoint(tmp_path, dspark_tiny_config())
    for k in (3, 5):
        with pytest.raises(ExportError, match=rf"num_speculative_tokens={k}: .*block_size=4"):
            export(ckpt, tmp_path / f"k{k}", num_speculative_tokens=k)
    assert json.loads((export(ckpt, tmp_path / "k4", num_speculative_tokens=4) / "config.json").read_text())[
        "block_size"] == 4


def test_bad_configs_are_refused_with_the_key():
    config = dspark_tiny_config().to_dspark("float32", {})
    with pytest.raises(ValueError, match="sample_from_anchor is false"):
        DSparkConfig.from_export(dict(config, sample_from_anchor=False))
    with pytest.raises(ValueError, match="markov_head_type 'gated'"):
        DSparkConfig.from_export(dict(config, markov_head_type="gated"))
    with pytest.raises(KeyError, match="markov_rank"):
        DSparkConfig.from_export({k: v for k, v in config.items() if k != "markov_rank"})
    with pytest.raises(ValueError, match="not a DSpark config"):
        DSparkConfig.from_export(dict(config, architectures=["DFlashDraftModel"]))
    with pytest.raises(ValueError, match="markov_rank=0"):
        dspark_tiny_config(markov_rank=0)


def test_proposer_refuses_more_tokens_than_the_block_holds():
    proposer = DSparkProposer(random_dspark_model(dspark_tiny_config()))
    assert proposer.max_k == 4
    with pytest.raises(ValueError, match="block_size=4"):
        proposer.propose(torch.randn(3, 48), torch.tensor([11, 12, 13]), 5, 0.0, None)


def test_greedy_proposal_is_vllms_sequential_markov_sampling():
    # vLLM's DSpark speculator at T=0: base logits of the k block rows at once, then left to right
    # logits_i = base_i + W2 @ W1[prev], prev = the pending token, then each argmax mapped to its target id.
    cfg = dspark_tiny_config()
    model = random_dspark_model(cfg)
    with torch.no_grad():
        model.d2t.copy_(torch.arange(cfg.draft_vocab_size))  # draft id i -> target id 2i
        model.t2d.copy_(torch.arange(cfg.vocab_size) % 2 == 0)
    ids, aux, _, _ = case(cfg, B=1)
    a = 7
    proposal = DSparkProposer(model).propose(aux[0, :a], ids[0, 1:a + 1], 4, 0.0, None)
    with torch.no_grad():
        h = model.block_hidden(ids, aux, torch.tensor([[a]]), torch.tensor([[True]]))[0, 0]  # (Bk, H)
    prev, want = int(ids[0, a]), []
    for i in range(4):
        d = int(hand_logits(model, h[i], torch.tensor(prev)).argmax())
        prev = d + int(model.d2t[d])
        want.append(prev)
    assert proposal.token_ids.tolist() == want
    # without the Markov correction some token differs (the test would not see a missing bias otherwise)
    base = rms(h, model.norm.weight, cfg.rms_norm_eps) @ model.lm_head.weight.T
    assert (2 * base.argmax(-1)).tolist() != want


# ------------------------------------------------------------------------------------------
# A short run on the tiny target


@pytest.fixture(scope="module")
def trained(prepared):
    from draftsmith.models.dspark.recipe import DSparkDraftConfig
    from draftsmith.models.dspark.training import DSparkMethod
    from draftsmith.train.trainer import fit

    recipe, run, _ = prepared
    recipe.draft = DSparkDraftConfig(num_layers=1, block_size=4, num_anchors=32, markov_rank=8, freeze_lm_head=False)
    recipe.train.max_steps, recipe.train.lr = 30, 0.003
    method = DSparkMethod(recipe, run)
    result = fit(recipe, method, run, progress=False)
    return recipe, run, method, result


def test_training_a_few_steps_lowers_the_loss(trained):
    recipe, run, method, result = trained
    assert result.steps == 30
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    print(f"dspark tiny run: loss {first:.4f} -> {last:.4f}, alpha {metrics[0]['alpha']:.3f} -> {metrics[-1]['alpha']:.3f}")
    assert last < 0.8 * first
    assert metrics[-1]["alpha"] > metrics[0]["alpha"]


def test_export_of_the_trained_draft_decodes_exactly_like_plain_greedy(trained, tiny_target, tmp_path):
    from draftsmith.target import load_target
    from draftsmith.eval.spec_decode import SpecCounters, Target, load_draft, plain_generate, speculative_generate
    from draftsmith.train.checkpoint import find_checkpoints

    recipe, run, method, _ = trained
    out = export(find_checkpoints(run / "checkpoints")[-1], tmp_path / "draft")
    model, tok = load_target(tiny_target, torch.float32)
    proposer = load_draft(out, model)
    assert isinstance(proposer, DSparkProposer)
    target, plain = Target(model, proposer.aux_layer_ids), Target(model)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False)["input_ids"]
               for p in ("Write a haiku about autumn.", "What is the capital of Italy?")]
    counters = SpecCounters(4)
    for p in prompts:
        spec = speculative_generate(target, proposer, p, k=4, max_new_tokens=24, counters=counters)
        assert spec == plain_generate(plain, p, max_new_tokens=24)
    print(f"dspark tiny run: {counters.drafts} drafts, {counters.accepted_tokens} accepted")
    assert counters.drafts > 0
