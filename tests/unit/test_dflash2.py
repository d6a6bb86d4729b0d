"""DFlash2 (models/dflash2, models/dflash2/training.py dflash2_loss, models/dflash2/proposer.py): tensor shapes, the
grouped convolution and selector written out by hand, the loss against a hand computation, a few
training steps, lossless speculative decoding with the reference decoder, and refused input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from draftsmith.target import load_target
from draftsmith.models.dflash2.proposer import DFlash2Proposer
from draftsmith.eval.export import export
from draftsmith.eval.spec_decode import evaluate, load_draft
from draftsmith.layout import DraftLoadError, ExportError
from draftsmith.methods import method_of_export
from draftsmith.models.dflash.config import DFlashConfig
from draftsmith.models.dflash.format import load_dflash
from draftsmith.models.dflash.model import DFlashDraftModel, DFlashKVCache
from draftsmith.models.dflash2.config import DFlash2Config
from draftsmith.models.dflash2.format import expected_dflash2_weights, load_dflash2
from draftsmith.models.dflash2.model import DFlash2DraftModel, grouped_conv
from draftsmith.models.dflash.training import block_labels, sample_anchors, dflash_loss, slot_weights
from draftsmith.models.dflash2.training import dflash2_loss
from draftsmith.train.losses import TargetDraftHead

from helpers.tiny import write_draft_checkpoint

V = 40


def tiny_config(**kw) -> DFlash2Config:
    base = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, vocab_size=V, draft_vocab_size=V, aux_layer_ids=[1, 3], block_size=4, mask_token_id=7,
                target_hidden_size=24, num_target_layers=6, rope_theta=500.0, conv_kernel_size=3,
                conv_group_size=8, selector_rank=6, selector_top_k=5)
    base.update(kw)
    return DFlash2Config(**base)


def random_model(cfg: DFlash2Config, seed: int = 0, scale: float = 0.3) -> DFlash2DraftModel:
    """Every parameter random (norms around 1), a random target embedding, the identity vocab map."""
    torch.manual_seed(seed)
    model = DFlash2DraftModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else scale * torch.randn_like(p))
        model.init_from_target(torch.randn(cfg.vocab_size, cfg.hidden_size))
        model.set_vocab_mapping(torch.zeros(cfg.vocab_size, dtype=torch.long),
                                torch.ones(cfg.vocab_size, dtype=torch.bool))
    return model


def batch(cfg: DFlash2Config, B: int = 2, T: int = 14, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, cfg.vocab_size, (B, T), generator=gen)
    aux = torch.randn(B, T, 2 * cfg.target_hidden_size, generator=gen)
    final = torch.randn(B, T, cfg.hidden_size, generator=gen)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[:, :3] = 0
    mask[1, 10:] = 0
    head = TargetDraftHead(3 * torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen))
    anchors, valid = sample_anchors(mask, 4, torch.Generator().manual_seed(1))
    return ids, aux, final, mask, head, anchors, valid


# -- shapes and the architecture


def test_state_dict_holds_exactly_the_export_tensors_with_their_shapes():
    cfg = tiny_config()
    state = {k: tuple(v.shape) for k, v in DFlash2DraftModel(cfg).state_dict().items() if k not in ("d2t", "t2d")}
    want = expected_dflash2_weights(cfg)
    assert state == want
    G = cfg.hidden_size // cfg.conv_group_size
    assert want["layers.1.attention_conv.base_kernel"] == (2, 3, 32)
    assert want["layers.1.mlp_conv.kernel_projection.weight"] == (2 * 3 * G, 32)
    assert want["candidate_selector.predecessor_codebook"] == (V, 6)
    assert want["candidate_selector.hidden_projection.weight"] == (6, 32)
    assert "d2t" not in want and want["lm_head.weight"] == (V, 32)


def test_forward_shapes_and_untrained_dflash2_computes_dflash():
    cfg = tiny_config()
    ids, aux, *_, anchors, valid = batch(cfg)
    model = random_model(cfg)
    with torch.no_grad():  # the identity init of the convolutions: a DFlash layer
        for layer in model.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.kernel_projection.weight.zero_()
                conv.base_kernel.zero_()
                conv.base_kernel[:, 0] = 1.0
    dflash = DFlashDraftModel(DFlashConfig(**{k: v for k, v in cfg.to_dict().items()
                                              if k in DFlashConfig.__dataclass_fields__}))
    dflash.load_state_dict(model.state_dict(), strict=False)
    dflash.init_from_target(model.embed_tokens)
    logits = model(ids, aux, anchors, valid)
    assert logits.shape == (2, 4, cfg.block_size, V)
    torch.testing.assert_close(logits, dflash(ids, aux, anchors, valid), rtol=1e-5, atol=1e-5)


def test_grouped_conv_equals_the_sum_written_out():
    gen = torch.Generator().manual_seed(0)
    S, H, T, G = 5, 8, 3, 2
    x, delta, base = torch.randn(2, S, H, generator=gen), torch.randn(2, S, T, G, generator=gen), torch.randn(T, H)
    out = grouped_conv(x, delta, base)
    gs = H // G
    want = torch.zeros_like(x)
    for b in range(2):
        for i in range(S):
            for c in range(H):
                for t in range(T):
                    if i - t >= 0:  # taps never reach before the block start
                        want[b, i, c] += (base[t, c] + delta[b, i, t, c // gs]) * x[b, i - t, c]
    torch.testing.assert_close(out, want)


def test_selector_scores_are_the_bilinear_form_after_each_predecessor():
    cfg = tiny_config()
    sel = random_model(cfg).candidate_selector
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (1, 3, 5), generator=gen)
    unary, hidden, anchor = torch.randn(1, 3, 5, generator=gen), torch.randn(1, 3, 32, generator=gen), torch.tensor([9])
    scores = sel(ids, unary, hidden, anchor)
    assert scores.shape == (1, 3, 5, 5)
    g = sel.hidden_projection.weight @ hidden[0, 2]
    p, c = 3, 1
    pred = ids[0, 1, p]  # slot 2 after candidate p of slot 1
    want = unary[0, 2, c] + (sel.predecessor_codebook[pred] * g * sel.successor_codebook[ids[0, 2, c]]).sum()
    torch.testing.assert_close(scores[0, 2, p, c], want)
    g0 = sel.hidden_projection.weight @ hidden[0, 0]
    want0 = unary[0, 0] + (sel.predecessor_codebook[9] * g0) @ sel.successor_codebook[ids[0, 0]].T
    for row in range(5):  # slot 0: every row follows the anchor
        torch.testing.assert_close(scores[0, 0, row], want0)


# -- the loss


def test_dflash2_loss_is_dflash_loss_plus_alpha_times_the_hand_computed_selector_ce():
    cfg = tiny_config()
    ids, aux, final, mask, head, anchors, valid = batch(cfg)
    w = slot_weights(cfg.block_size, 4.0)
    model = random_model(cfg, scale=0.5)
    normed = []
    hook = model.norm.register_forward_hook(lambda mod, inp, out: normed.append(out.detach()) and None)
    with torch.no_grad():
        model(ids, aux, anchors, valid)  # the block hidden states, final-normed: (B, A, Bk, H)
    hook.remove()
    h = normed[0]
    label_pos, label_mask = block_labels(anchors, valid, mask, cfg.block_size)
    sel, K = model.candidate_selector, cfg.selector_top_k
    num = den = 0.0
    covered = []
    for b, a, k in label_mask.nonzero().tolist():  # by hand, one trained slot at a time
        logits = model.lm_head(h[b, a, k])
        gold, pred = int(ids[b, label_pos[b, a, k]]), int(ids[b, label_pos[b, a, k - 1]])
        cand = logits.topk(K).indices.tolist()
        covered.append(gold in cand)
        if gold not in cand:
            cand[-1] = gold  # the gold token takes the K-th place
        g = sel.hidden_projection.weight @ h[b, a, k]
        s = torch.stack([logits[c] + (sel.predecessor_codebook[pred] * g * sel.successor_codebook[c]).sum()
                         for c in cand])
        num += float(w[k]) * float(F.cross_entropy(s[None].detach(), torch.tensor([cand.index(gold)])))
        den += float(w[k])
    assert 0 < sum(covered) < len(covered)  # both cases happen
    with torch.no_grad():
        base, _ = dflash_loss(model, ids, aux, final, mask, anchors, valid, head, w)
        total, metrics = dflash2_loss(model, ids, aux, final, mask, anchors, valid, head, w, alpha=0.7, chunk_size=5)
    assert float(metrics["selector_loss"]) == pytest.approx(num / den, rel=1e-5)
    assert float(metrics["dflash_loss"]) == pytest.approx(float(base), rel=1e-6)
    assert float(total) == pytest.approx(float(base) + 0.7 * num / den, rel=1e-5)
    assert float(metrics["selector_coverage"]) == pytest.approx(sum(covered) / len(covered))


def test_a_few_training_steps_reduce_both_terms():
    cfg = tiny_config()
    ids, aux, final, mask, head, anchors, valid = batch(cfg, B=4, T=16)
    w = slot_weights(cfg.block_size, 4.0)
    model = random_model(cfg, scale=0.1).train()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    history = []
    for _ in range(30):
        loss, metrics = dflash2_loss(model, ids, aux, final, mask, anchors, valid, head, w)
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append((float(loss), float(metrics["dflash_loss"]), float(metrics["selector_loss"])))
    first, last = history[0], history[-1]
    assert last[0] < 0.7 * first[0] and last[1] < first[1] and last[2] < first[2], history[::10]
    for layer in model.layers:  # the convolutions and the selector learnt
        assert layer.attention_conv.kernel_projection.weight.abs().sum() > 0
    assert model.candidate_selector.successor_codebook.abs().sum() > 0


# -- the reference decoder


def target_draft(target_model, seed: int = 0) -> DFlash2DraftModel:
    """A random DFlash2 draft for the tiny target (H 128, V 512, 6 layers), its embedding shared."""
    cfg = tiny_config(hidden_size=128, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=32, vocab_size=512, draft_vocab_size=512, target_hidden_size=128, mask_token_id=3,
                      conv_group_size=32)
    model = random_model(cfg, seed, scale=0.05)
    model.init_from_target(target_model.get_input_embeddings().weight.detach())
    return model.eval()


def test_speculative_decoding_with_the_reference_proposer_equals_the_targets_greedy_output(tiny_target, tmp_path):
    target, tokenizer = load_target(tiny_target, dtype=torch.float32, device="cpu")
    draft = target_draft(target)
    write_draft_checkpoint(draft, tmp_path / "ckpt", "dflash2",
                           {"name_or_path": str(tiny_target), "architectures": ["LlamaForCausalLM"]})
    out = export(tmp_path / "ckpt", tmp_path / "export", dtype="float32")
    proposer = load_draft(out, target)
    assert isinstance(proposer, DFlash2Proposer)
    prompts = [[5, 40, 41, 42, 43], [9, 100, 200, 300]]
    r = evaluate(target, tokenizer, proposer, prompts, k=3, temperature=0.0, max_new_tokens=16, progress=False)
    assert r["identical_to_plain"] == len(prompts) and r["num_drafts"] > 0
    # the walk: each drafted token is a top-K candidate of its slot, chosen after the previous one
    cache = DFlashKVCache()
    states = torch.randn(6, 2 * 128)
    draft.append_context(cache, states, torch.arange(6))
    ids, scores = draft.propose_scores(cache, 11, 6, 3)
    walker = DFlash2Proposer(draft)
    walker.cache = cache
    tokens = walker.draft(11, 6, 3, 0.0, None).token_ids.tolist()
    row = 0
    for slot, tok in enumerate(tokens):
        assert tok == int(ids[slot, scores[slot, row].argmax()])
        row = int(scores[slot, row].argmax())


def test_sampled_proposal_puts_its_mass_on_the_candidates_only(tiny_target):
    target, _ = load_target(tiny_target, dtype=torch.float32, device="cpu")
    draft = target_draft(target)
    proposer = DFlash2Proposer(draft)
    p = proposer.propose(torch.randn(5, 256), torch.tensor([12]), 3, 1.0, torch.Generator().manual_seed(0))
    assert p.probs.shape == (3, 512)
    torch.testing.assert_close(p.probs.sum(-1), torch.ones(3))
    assert ((p.probs > 0).sum(-1) <= draft.config.selector_top_k).all()


# -- bad input


@pytest.mark.parametrize("kw, message", [
    (dict(draft_vocab_size=30), "DFlash2 drafts over the full target vocab"),
    (dict(conv_group_size=12), "conv_group_size=12 must divide hidden_size=32"),
    (dict(selector_top_k=41), "selector_top_k=41 exceeds the vocab of 40"),
    (dict(selector_rank=0), "selector_rank=0 must be >= 1"),
    (dict(block_size=1), "block_size=1 must be >= 2"),
])
def test_config_refuses_what_vllm_cannot_build(kw, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**kw)


def make_export(tmp_path: Path) -> Path:
    model = random_model(tiny_config())
    write_draft_checkpoint(model, tmp_path / "ckpt", "dflash2", {"name_or_path": "tiny"})
    return export(tmp_path / "ckpt", tmp_path / "export", dtype="float32")


def test_export_round_trips_and_is_told_apart_from_dflash(tmp_path):
    out = make_export(tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash2" and method_of_export(config).name == "dflash2"
    assert {k: config[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")} == \
        {"conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 6, "selector_top_k": 5}
    assert sorted(load_file(str(out / "model.safetensors"))) == sorted(expected_dflash2_weights(tiny_config()))
    assert type(load_dflash2(out, torch.randn(V, 32))) is DFlash2DraftModel
    with pytest.raises(DraftLoadError):  # a DFlash reader never takes it for a plain DFlash draft
        load_dflash(out)
    native = tiny_config().to_native("float32")
    assert method_of_export(native).name == "dflash2" and DFlash2Config.from_export(native) == tiny_config()
    with pytest.raises(ValueError, match="not a DFlashDraftModel config"):
        DFlashConfig.from_export(native)


def test_export_refuses_a_missing_tensor_naming_it(tmp_path):
    model = random_model(tiny_config())
    write_draft_checkpoint(model, tmp_path / "ckpt", "dflash2", {"name_or_path": "tiny"})
    weights = tmp_path / "ckpt" / "model.safetensors"
    state = load_file(str(weights))
    del state["layers.1.mlp_conv.base_kernel"]
    state["candidate_selector.extra"] = torch.zeros(2)
    save_file(state, str(weights))
    with pytest.raises(ExportError, match=r"DFlash2 layout.*missing \['layers.1.mlp_conv.base_kernel'\].*"
                                          r"unexpected \['candidate_selector.extra'\]"):
        export(tmp_path / "ckpt", tmp_path / "export")


def test_export_refuses_a_k_other_than_the_block(tmp_path):
    model = random_model(tiny_config())
    write_draft_checkpoint(model, tmp_path / "ckpt", "dflash2", {"name_or_path": "tiny"})
    with pytest.raises(ExportError, match="num_speculative_tokens=5: this draft was trained with block_size=4"):
        export(tmp_path / "ckpt", tmp_path / "export", num_speculative_tokens=5)


def test_loader_refuses_a_config_without_selector_keys_or_with_sample_from_anchor(tmp_path):
    out = make_export(tmp_path)
    path = out / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in config.items() if k != "selector_top_k"}))
    with pytest.raises(DraftLoadError, match="lacks selector_top_k"):
        load_dflash2(out)
    path.write_text(json.dumps(dict(config, sample_from_anchor=True)))
    with pytest.raises(DraftLoadError, match="sample_from_anchor is true"):
        load_dflash2(out)


def test_proposer_refuses_more_tokens_than_the_block_holds():
    proposer = DFlash2Proposer(random_model(tiny_config()).eval())
    with pytest.raises(ValueError, match="k=4: this DFlash2 draft was trained with block_size=4"):
        proposer.propose(torch.randn(3, 48), torch.tensor([12]), 4, 0.0, None)
