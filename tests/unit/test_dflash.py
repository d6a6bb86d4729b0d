"""DFlash draft: training forward == vLLM's inference arithmetic, context / block visibility,
anchors, labels and loss weights, export tensor set and config formats, mask-token check,
and an end-to-end run on the tiny target whose speculative output equals plain decoding."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from draftsmith.eval.acceptance import check_draft_matches_target
from draftsmith.models.dflash.proposer import DFlashProposer
from draftsmith.eval.export import export
from draftsmith.layout import ExportError
from draftsmith.models.dflash.config import DFlashConfig
from draftsmith.models.dflash.format import expected_dflash_weights, is_dflash_export, load_dflash
from draftsmith.models.dflash.model import DFlashDraftModel, DFlashKVCache, block_attention, block_attention_mask
from draftsmith.train.activation_checkpointing import apply_activation_checkpointing
from draftsmith.models.dflash.training import anchor_count, block_labels, sample_anchors, valid_anchor_mask
from draftsmith.models.dflash.training import dflash_loss, slot_weights, teacher_rows, AnchorCountPlan
from draftsmith.train.losses import LOSSES, LossSpec, StepMetrics, TargetDraftHead

from helpers.tiny import dflash_tiny_config, random_dflash_model, write_draft_checkpoint


tiny_config, random_model = dflash_tiny_config, random_dflash_model


# ------------------------------------------------------------------------------------------
# A vLLM-style reference written from docs/parallel_drafts.md ("DFlash at inference"), independent of the model code


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_neox(x, pos, theta):  # x (S, heads, hd), pos (S,)
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    f = pos[:, None].float() * inv  # (S, hd/2)
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


@torch.no_grad()
def vllm_style_block(model: DFlashDraftModel, g_ctx: torch.Tensor, bonus: int, P: int, k: int) -> torch.Tensor:
    """Context K/V precomputed (fc -> hidden_norm -> k/v_proj -> k_norm -> RoPE at 0..P-1), then
    one non-causal query block [bonus, M*k] at P..P+k. -> (k, Vd) logits."""
    c = model.config
    eps, nh, nkv, hd = c.rms_norm_eps, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    cn = rms(g_ctx @ model.fc.weight.T, model.hidden_norm.weight, eps)  # (P, H)
    ctx_pos, q_pos = torch.arange(P), torch.arange(P, P + k + 1)
    h = model.embed_tokens[torch.tensor([bonus] + [c.mask_token_id] * k)]
    for layer in model.layers:
        a = layer.self_attn
        kc = rope_neox(rms((cn @ a.k_proj.weight.T).view(P, nkv, hd), a.k_norm.weight, eps), ctx_pos, c.rope_theta)
        vc = (cn @ a.v_proj.weight.T).view(P, nkv, hd)
        x = rms(h, layer.input_layernorm.weight, eps)
        q = rope_neox(rms((x @ a.q_proj.weight.T).view(k + 1, nh, hd), a.q_norm.weight, eps), q_pos, c.rope_theta)
        kb = rope_neox(rms((x @ a.k_proj.weight.T).view(k + 1, nkv, hd), a.k_norm.weight, eps), q_pos, c.rope_theta)
        vb = (x @ a.v_proj.weight.T).view(k + 1, nkv, hd)
        K, V = torch.cat([kc, kb]).transpose(0, 1), torch.cat([vc, vb]).transpose(0, 1)  # (nkv, P+k+1, hd)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), K.repeat_interleave(nh // nkv, 0),
                                             V.repeat_interleave(nh // nkv, 0), is_causal=False)
        h = h + out.transpose(0, 1).reshape(k + 1, nh * hd) @ a.o_proj.weight.T
        h = h + layer.mlp(rms(h, layer.post_attention_layernorm.weight, eps))
    return model.lm_head(rms(h, model.norm.weight, eps))[1:]


def test_training_forward_on_one_anchor_equals_vllm_style_incremental_block():
    cfg = tiny_config()
    model = random_model(cfg)
    T, a = 12, 5
    torch.manual_seed(1)
    ids = torch.randint(10, cfg.vocab_size, (1, T))
    g = torch.randn(1, T, 2 * cfg.target_hidden_size)
    logits = model(ids, g, torch.tensor([[a]]), torch.tensor([[True]]))  # (1, 1, Bk, Vd)
    want = vllm_style_block(model, g[0, :a], int(ids[0, a]), a, cfg.block_size - 1)
    torch.testing.assert_close(logits[0, 0, 1:], want, rtol=1e-4, atol=1e-5)

    cache = DFlashKVCache()  # the proposer's path: context appended in two rounds
    model.append_context(cache, g[0, :3], torch.arange(3))
    model.append_context(cache, g[0, 3:a], torch.arange(3, a))
    torch.testing.assert_close(model.propose_block(cache, int(ids[0, a]), a, cfg.block_size - 1), want,
                               rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="block_size=4"):
        model.propose_block(cache, int(ids[0, a]), a, cfg.block_size)


def test_block_sees_context_strictly_before_its_anchor():
    cfg = tiny_config()
    model = random_model(cfg)
    T, a = 12, 6
    torch.manual_seed(2)
    ids = torch.randint(10, cfg.vocab_size, (1, T))
    g = torch.randn(1, T, 2 * cfg.target_hidden_size)
    anchors, valid = torch.tensor([[2, a]]), torch.tensor([[True, True]])
    base = model(ids, g, anchors, valid)
    later = g.clone()
    later[:, a:] += 3.0  # the anchor's own state and everything after it
    torch.testing.assert_close(model(ids, later, anchors, valid)[:, 1], base[:, 1])
    earlier = g.clone()
    earlier[:, a - 1] += 3.0
    changed = model(ids, earlier, anchors, valid)
    assert (changed[:, 1] - base[:, 1]).abs().max() > 1e-3  # anchor 6 sees position 5
    torch.testing.assert_close(changed[:, 0], base[:, 0])  # anchor 2 does not
    other_ids = ids.clone()
    other_ids[0, a + 1:] = 9  # block tokens after the anchor are mask slots, never read
    torch.testing.assert_close(model(other_ids, g, anchors, valid)[:, 1], base[:, 1])


def test_packed_documents_hide_earlier_documents_from_a_block():
    cfg = tiny_config()
    model = random_model(cfg)
    T = 10
    torch.manual_seed(3)
    ids = torch.randint(10, cfg.vocab_size, (1, T))
    g = torch.randn(1, T, 2 * cfg.target_hidden_size)
    docs = torch.tensor([[0] * 4 + [1] * 6])
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
    packed = model(ids, g, torch.tensor([[7]]), torch.tensor([[True]]), position_ids=pos, document_ids=docs)
    alone = model(ids[:, 4:], g[:, 4:], torch.tensor([[3]]), torch.tensor([[True]]))
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)


def test_block_attention_equals_dense_masked_attention_and_is_bidirectional_in_block():
    torch.manual_seed(4)
    B, nh, A, Bk, T, hd = 1, 2, 3, 4, 9, 8
    q, kb, vb = (torch.randn(B, nh, A * Bk, hd) for _ in range(3))
    kc, vc = torch.randn(B, nh, T, hd), torch.randn(B, nh, T, hd)
    anchors = torch.tensor([[1, 4, 7]])
    allow = torch.arange(T)[None, None] < anchors[..., None]
    valid = torch.ones(B, A, dtype=torch.bool)
    got = block_attention(q, kc, vc, kb, vb, block_attention_mask(allow, valid, Bk), hd ** -0.5)
    # hand-written dense mask over [context (T) | all blocks (A*Bk)]
    mask = torch.zeros(A * Bk, T + A * Bk, dtype=torch.bool)
    for j, a in enumerate([1, 4, 7]):
        mask[j * Bk:(j + 1) * Bk, :a] = True
        mask[j * Bk:(j + 1) * Bk, T + j * Bk:T + (j + 1) * Bk] = True
    want = F.scaled_dot_product_attention(q, torch.cat([kc, kb], 2), torch.cat([vc, vb], 2), attn_mask=mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------
# The loss: dflash_loss (chunked, inside the forward, no host read) against the previous
# implementation, kept here as the reference


def teacher_for_labels_reference(teacher, label_pos, label_mask):
    """``teacher (B, T, Vd)`` gathered at ``label_pos - 1`` for the ``label_mask`` slots -> ``(M, Vd)``."""
    b = torch.arange(teacher.shape[0], device=teacher.device)[:, None, None].expand_as(label_pos)
    return teacher[b[label_mask], label_pos[label_mask] - 1]


def dflash_loss_reference(logits, teacher_logits, slots, weights, denominator=None, loss=None):
    """``logits / teacher_logits (M, Vd)`` of the trained slots, ``slots (M,)`` their k ->
    ``(sum(w*D) / sum(w), StepMetrics per slot k = 1..Bk-1, acceptance length)``."""
    Bk = weights.shape[0]
    w = weights.to(logits.device)[slots]
    kl = (loss or LossSpec())(teacher_logits, logits)
    denom = denominator if denominator is not None else float(w.sum().clamp_min(1e-6))
    total = (w * kl).sum() / denom
    losses, accs, counts = [], [], []
    with torch.no_grad():
        hit = (logits.argmax(-1) == teacher_logits.argmax(-1)).float()
        for k in range(1, Bk):
            sel = slots == k
            n = int(sel.sum())
            counts.append(n)
            losses.append(float(kl[sel].mean()) if n else 0.0)
            accs.append(float(hit[sel].mean()) if n else 0.0)
    al, run = 1.0, 1.0
    for a in accs:
        run *= a
        al += run
    return total, StepMetrics(loss=losses, acc=accs, tokens=counts), al


def loss_case(cfg, B=2, T=14, packed=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, cfg.vocab_size, (B, T), generator=gen)
    aux = torch.randn(B, T, 2 * cfg.target_hidden_size, generator=gen)
    final = torch.randn(B, T, cfg.hidden_size, generator=gen)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[:, :3] = 0
    mask[1, 9:] = 0  # right padding
    mask[0, 6] = 0  # a hole: slots whose label is not an assistant token
    docs = pos = None
    if packed:
        docs = (torch.arange(T)[None] >= 7).long().expand(B, T).contiguous()
        pos = torch.where(docs == 0, torch.arange(T), torch.arange(T) - 7)
    head = TargetDraftHead(3 * torch.randn(cfg.draft_vocab_size, cfg.hidden_size, generator=gen))
    return ids, aux, final, mask, pos, docs, head


@pytest.mark.parametrize("kind", LOSSES)
@pytest.mark.parametrize("packed,num_anchors", [(False, 3), (False, 5), (True, 4)])
def test_dflash_loss_equals_the_reference_loss_in_value_gradients_and_metrics(kind, packed, num_anchors):
    cfg = tiny_config()
    ids, aux, final, mask, pos, docs, head = loss_case(cfg, packed=packed)
    anchors, valid = sample_anchors(mask, num_anchors, torch.Generator().manual_seed(1), docs)
    Bk, spec, w = cfg.block_size, LossSpec(kind), slot_weights(cfg.block_size, 4.0)
    # num_anchors 3 gathers the 9 teacher rows of the slots, 5 runs the head on all 14 positions

    ref_model = random_model(cfg).train()
    label_pos, label_mask = block_labels(anchors, valid, mask, Bk, docs)
    logits = ref_model(ids, aux, anchors, valid, label_mask, pos, docs)
    teacher = teacher_for_labels_reference(head(final), label_pos, label_mask)
    slots = torch.arange(Bk).expand_as(label_pos)[label_mask]
    want, m, al = dflash_loss_reference(logits, teacher, slots, w, None, spec)
    want.backward()

    model = random_model(cfg).train()
    loss, metrics = dflash_loss(model, ids, aux, final, mask, anchors, valid, head, w, spec, pos, docs,
                                chunk_size=7)  # several chunks
    loss.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    for k in range(Bk - 1):
        assert metrics[f"loss_{k}"].dim() == 0 and not metrics[f"loss_{k}"].requires_grad
        assert float(metrics[f"loss_{k}"]) == pytest.approx(m.loss[k], rel=1e-5, abs=1e-6)
        assert float(metrics[f"acc_{k}"]) == pytest.approx(m.acc[k], abs=1e-6)
    assert float(metrics["acceptance_length"]) == pytest.approx(al, abs=1e-6)
    assert float(metrics["loss"]) == pytest.approx(float(want.detach()), rel=1e-5)

    # data parallel: a device-tensor global denominator replaces the local weight sum
    half, _ = dflash_loss(model, ids, aux, final, mask, anchors, valid, head, w, spec, pos, docs,
                          global_denominators=lambda counts: counts * 2.0)
    torch.testing.assert_close(half, want / 2, rtol=1e-5, atol=1e-6)


def test_dflash_loss_reads_nothing_from_the_device():
    from torch.utils._python_dispatch import TorchDispatchMode

    # .item() / float() / int() / bool() dispatch _local_scalar_dense; x[mask] dispatches index
    # (or index_put_) with a bool index, which reads the mask's count from the device
    syncing = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
               "aten._unique2.default", "aten.unique_consecutive.default"}

    class NoSync(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            bool_index = name.startswith(("aten.index.", "aten.index_put")) and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] if i is not None)
            if name in syncing or bool_index:
                self.seen.append(name)
            return func(*args, **(kwargs or {}))

    cfg = tiny_config()
    ids, aux, final, mask, pos, docs, head = loss_case(cfg, packed=True)
    model = random_model(cfg).train()
    mode = NoSync()
    with mode:
        anchors, valid = sample_anchors(mask, 5, torch.Generator().manual_seed(0), docs)
        loss, metrics = dflash_loss(model, ids, aux, final, mask, anchors, valid, head,
                                    slot_weights(cfg.block_size, 4.0), LossSpec(), pos, docs)
        loss.backward()
    assert mode.seen == []
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in metrics.values())


def test_padding_and_invalid_anchors_give_finite_outputs_and_gradients():
    cfg = tiny_config()
    model = random_model(cfg).train()
    T = 10
    ids = torch.randint(10, cfg.vocab_size, (2, T))
    g = torch.randn(2, T, 2 * cfg.target_hidden_size)
    mask = torch.zeros(2, T, dtype=torch.long)
    mask[0, 3:9] = 1  # row 1: no assistant tokens, no valid anchor at all
    anchors, valid = sample_anchors(mask, 8, torch.Generator().manual_seed(0))
    assert valid[0].sum() == 5 and not valid[1].any()
    head = TargetDraftHead(torch.randn(cfg.draft_vocab_size, cfg.hidden_size))
    final = torch.randn(2, T, cfg.hidden_size)
    loss, metrics = dflash_loss(model, ids, g, final, mask, anchors, valid, head, slot_weights(cfg.block_size, 4.0))
    loss.backward()
    assert torch.isfinite(loss) and loss > 0
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    full = model(ids, g, anchors, valid)
    assert torch.isfinite(full).all()
    # a micro-batch with no trained slot at all: loss 0, still a graph, finite gradients
    model.zero_grad()
    none, _ = dflash_loss(model, ids, g, final, torch.zeros_like(mask), anchors, valid & False, head,
                          slot_weights(cfg.block_size, 4.0))
    none.backward()
    assert float(none.detach()) == 0.0
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    cfg = tiny_config()
    T = 10
    torch.manual_seed(6)
    ids = torch.randint(10, cfg.vocab_size, (2, T))
    g = torch.randn(2, T, 2 * cfg.target_hidden_size)
    anchors, valid = torch.tensor([[2, 5], [3, 0]]), torch.tensor([[True, True], [True, False]])
    grads = []
    for ckpt in (False, True):
        model = random_model(cfg).train()
        if ckpt:
            apply_activation_checkpointing(model)
        model(ids, g, anchors, valid).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)})
    grads[1] = {n.replace("_checkpoint_wrapped_module.", ""): g for n, g in grads[1].items()}
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)


def test_anchors_are_valid_distinct_sorted_capped_and_reproducible():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 1, 1, 1]])
    assert valid_anchor_mask(mask).nonzero()[:, 1].tolist() == [2, 3, 4, 7, 8]  # m[a] = m[a+1] = 1
    a, v = sample_anchors(mask, 3, torch.Generator().manual_seed(0))
    assert v.all() and a.shape == (1, 3)
    assert a[0].tolist() == sorted(set(a[0].tolist())) and set(a[0].tolist()) <= {2, 3, 4, 7, 8}
    again, _ = sample_anchors(mask, 3, torch.Generator().manual_seed(0))
    assert torch.equal(a, again)
    draws = {tuple(sample_anchors(mask, 3, torch.Generator().manual_seed(s))[0][0].tolist()) for s in range(20)}
    assert len(draws) > 1  # re-sampled from step to step
    assert anchor_count(mask, 100) == 5 and anchor_count(mask, 3) == 3
    plan = pickle.loads(pickle.dumps(AnchorCountPlan(100)))  # runs in DataLoader workers
    assert plan({"loss_mask": mask}) == {"loss_mask": mask, "dflash_num_anchors": 5}
    everything, v = sample_anchors(mask, anchor_count(mask, 100), torch.Generator().manual_seed(0))
    assert everything[0].tolist() == [2, 3, 4, 7, 8] and v.all()
    padded, v = sample_anchors(mask, 100, torch.Generator().manual_seed(0))  # width capped at T, valid first
    assert padded.shape == (1, 10) and padded[0, :5].tolist() == [2, 3, 4, 7, 8] and v.sum() == 5
    assert not v[0, 5:].any() and padded[0, 5:].eq(0).all()


def test_labels_are_same_position_and_teacher_is_the_previous_positions_distribution():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 1, 1, 1]])
    anchors, valid = torch.tensor([[3, 8]]), torch.tensor([[True, True]])
    pos, ok = block_labels(anchors, valid, mask, 4)
    assert pos[0, 0].tolist() == [3, 4, 5, 6]
    assert ok[0, 0].tolist() == [False, True, True, False]  # slot 0 never trained; x_6 is not assistant
    assert ok[0, 1].tolist() == [False, True, False, False]  # past the end of the row
    T, V = 10, 12
    final = torch.arange(T, dtype=torch.float32).view(1, T, 1)  # the head makes row t one-hot(t): p_t
    head = lambda h: F.one_hot(h[:, 0].long(), V).float()  # noqa: E731
    for anchors_, want in ((anchors, [3, 4, 8]), (torch.tensor([[3, 8, 5, 2]]), None)):
        # 2 anchors * 3 slots < T: the slot rows are gathered; 4 * 3 >= T: the head runs on all rows
        pos_, ok_ = block_labels(anchors_, torch.ones_like(anchors_, dtype=torch.bool), mask, 4)
        teacher, index = teacher_rows(final, pos_, head)
        assert teacher.shape[0] == (2 * 3 if anchors_.shape[1] == 2 else T)
        got = teacher[index].argmax(-1)  # (1, A, 4)
        assert got[ok_].tolist() == (pos_[ok_] - 1).tolist()
        if want is not None:
            assert got[ok_].tolist() == want  # labels x_4, x_5, x_9 -> teachers p_3, p_4, p_8


def test_slot_weights_decay_exponentially_and_loss_normalises_by_their_sum():
    w = slot_weights(5, 4.0)
    torch.testing.assert_close(w, torch.tensor([0.0, 1.0, math.exp(-0.25), math.exp(-0.5), math.exp(-0.75)]))
    torch.manual_seed(5)
    teacher = torch.randn(3, 6)
    draft = torch.randn(3, 6)
    slots = torch.tensor([1, 2, 4])
    loss, m, al = dflash_loss_reference(draft, teacher, slots, w)
    log_p = teacher.log_softmax(-1)
    kl = (log_p.exp() * (log_p - draft.log_softmax(-1))).sum(-1)
    want = (w[slots] * kl).sum() / w[slots].sum()
    torch.testing.assert_close(loss, want)
    assert m.tokens == [1, 1, 0, 1]
    exact, m, al = dflash_loss_reference(teacher, teacher, slots, w)
    assert float(exact) == pytest.approx(0.0, abs=1e-6) and m.acc == [1.0, 1.0, 0.0, 1.0]
    assert al == pytest.approx(3.0)  # 1 + acc_1 + acc_1*acc_2 (slot 3 has no data: the chain stops)


# ------------------------------------------------------------------------------------------
# Config formats and export


def test_wrong_convention_layer_ids_are_refused():
    with pytest.raises(ValueError, match="ascending"):
        tiny_config(aux_layer_ids=[3, 1])
    with pytest.raises(ValueError, match="aux id 0"):
        tiny_config(aux_layer_ids=[0, 3])
    with pytest.raises(ValueError, match="6 layers"):
        tiny_config(aux_layer_ids=[1, 6])
    assert tiny_config(aux_layer_ids=[2, 5]).target_layer_ids == [1, 4]


def test_config_round_trips_through_format_a_and_reads_format_b():
    cfg = tiny_config()
    a = cfg.to_speculators({"name_or_path": "t", "architectures": ["LlamaForCausalLM"]}, 3, "float32", "0.3.0", {})
    assert "model_type" not in a and a["sliding_window_non_causal"] is True
    assert a["aux_hidden_state_layer_ids"] == [1, 3] and a["mask_token_id"] == 7
    layer = a["transformer_layer_config"]
    assert layer["head_dim"] == 8 and layer["rope_parameters"]["rope_theta"] == 500.0 and layer["rope_theta"] == 500.0
    assert DFlashConfig.from_export(json.loads(json.dumps(a))) == cfg
    b = cfg.to_native("float32")
    assert b["dflash_config"] == {"mask_token_id": 7, "target_layer_ids": [0, 2], "causal": False}
    assert "eagle_aux_hidden_state_layer_ids" not in b
    assert DFlashConfig.from_export(json.loads(json.dumps(b))) == cfg
    assert is_dflash_export(a) and is_dflash_export(b) and not is_dflash_export({"speculators_model_type": "eagle3"})
    with pytest.raises(ValueError, match="causally"):
        DFlashConfig.from_export(dict(a, sliding_window_non_causal=False))


def make_checkpoint(tmp_path: Path, cfg: DFlashConfig) -> tuple[Path, dict]:
    model = random_model(cfg)
    target = {"name_or_path": "tiny", "path": "tiny", "architectures": ["LlamaForCausalLM"]}
    state = write_draft_checkpoint(model, tmp_path / "ckpt", "dflash", target)
    return tmp_path / "ckpt", state


@pytest.mark.parametrize("draft_vocab", [20, 50])
def test_export_writes_exactly_the_tensors_vllm_loads(tmp_path, draft_vocab):
    cfg = tiny_config(draft_vocab_size=draft_vocab)
    ckpt, state = make_checkpoint(tmp_path, cfg)
    out = export(ckpt, tmp_path / "out")
    weights = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected_dflash_weights(cfg)
    assert ("d2t" in weights) == (draft_vocab < 50) and "embed_tokens.weight" not in weights
    assert "layers.1.self_attn.k_norm.weight" in weights and not any("mask_hidden" in k for k in weights)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == cfg.block_size - 1
    loaded = load_dflash(out)
    for k, v in weights.items():
        torch.testing.assert_close(loaded.state_dict()[k], v)
    with pytest.raises(ExportError, match="block_size=4"):
        export(ckpt, tmp_path / "k7", num_speculative_tokens=7)


def test_export_refuses_missing_or_extra_tensors(tmp_path):
    cfg = tiny_config()
    ckpt, state = make_checkpoint(tmp_path, cfg)
    weights = ckpt / "model.safetensors"
    missing = {k: v for k, v in state.items() if k != "layers.1.self_attn.q_norm.weight"}
    save_file({k: v.contiguous() for k, v in missing.items()}, str(weights))
    with pytest.raises(ExportError, match=r"missing \['layers.1.self_attn.q_norm.weight'\]"):
        export(ckpt, tmp_path / "a")
    save_file({**{k: v.contiguous() for k, v in state.items()}, "mask_hidden": torch.zeros(1, 48)}, str(weights))
    with pytest.raises(ExportError, match=r"unexpected \['mask_hidden'\]"):
        export(ckpt, tmp_path / "b")
    bad = dict(state, **{"fc.weight": torch.zeros(32, 24)})
    save_file({k: v.contiguous() for k, v in bad.items()}, str(weights))
    with pytest.raises(ExportError, match="fc.weight"):
        export(ckpt, tmp_path / "c")


def test_proposer_refuses_more_tokens_than_the_block_holds():
    proposer = DFlashProposer(random_model(tiny_config()))
    assert proposer.max_k == 3
    with pytest.raises(ValueError, match="block_size=4"):
        proposer.propose(torch.randn(3, 48), torch.tensor([11, 12, 13]), 4, 0.0, None)


def test_sampled_proposals_carry_draft_distributions_over_the_target_vocab():
    cfg = tiny_config()
    model = random_model(cfg)
    with torch.no_grad():
        model.d2t.copy_(torch.arange(cfg.draft_vocab_size))  # draft id i -> target id 2i
        model.t2d.copy_(torch.arange(cfg.vocab_size) % 2 == 0)
    proposer = DFlashProposer(model)
    states = torch.randn(5, 48)
    greedy = proposer.propose(states, torch.tensor([11, 12, 13, 14, 15]), 3, 0.0, None)
    logits = model.propose_block(proposer.cache, 15, 5, 3)
    assert greedy.token_ids.tolist() == (2 * logits.argmax(-1)).tolist() and greedy.probs is None
    proposer.reset()
    sampled = proposer.propose(states, torch.tensor([11, 12, 13, 14, 15]), 3, 1.0, torch.Generator().manual_seed(0))
    assert sampled.probs.shape == (3, cfg.vocab_size)
    torch.testing.assert_close(sampled.probs.sum(-1), torch.ones(3))
    assert sampled.probs[:, 1::2].abs().max() == 0  # odd target ids are outside the draft vocab
    torch.testing.assert_close(sampled.probs[:, 0:2 * cfg.draft_vocab_size:2], logits.softmax(-1))


def test_export_for_another_target_is_refused(tmp_path, tiny_target):
    from draftsmith.eval.acceptance import DraftMismatchError

    ckpt, _ = make_checkpoint(tmp_path, tiny_config())  # H=32, V=50 vs the tiny target's 128 / 512
    out = export(ckpt, tmp_path / "out")
    with pytest.raises(DraftMismatchError, match="hidden_size 32 != target 128.*vocab_size 50 != target 512"):
        check_draft_matches_target(out, tiny_target)


# ------------------------------------------------------------------------------------------
# End to end on the tiny target
