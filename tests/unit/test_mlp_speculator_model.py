"""The MLP speculator model: weight names and shapes as vLLM loads them, stage 0 as published, the
teacher-forced chain of stages, the chunked-loss head_fn and tied weights."""

from __future__ import annotations
import math

import pytest
import torch
import torch.nn.functional as F
from draftsmith.models.mlp_speculator.model import MLPSpeculator, MLPSpeculatorConfig
from draftsmith.recipe import RecipeError, load_recipe


def test_weight_names_shapes_and_forward_shape():
    model = MLPSpeculator(MLPSpeculatorConfig(emb_dim=16, inner_dim=24, vocab_size=40, n_predict=3))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["proj.0.weight"] == (24, 16) and shapes["proj.2.weight"] == (24, 24)
    assert shapes["emb.1.weight"] == (40, 24) and shapes["head.2.weight"] == (40, 24)
    assert shapes["ln.0.weight"] == shapes["ln.0.bias"] == (24,)
    assert len(shapes) == 3 * 5
    out = model(torch.randn(2, 5, 16), torch.randint(0, 40, (2, 8)))
    assert out.shape == (3, 2, 5, 40)
    with pytest.raises(ValueError, match="T \\+ n_predict"):
        model(torch.randn(2, 5, 16), torch.randint(0, 40, (2, 7)))


def test_stage_zero_follows_the_published_formula():
    torch.manual_seed(0)
    cfg = MLPSpeculatorConfig(emb_dim=8, inner_dim=12, vocab_size=20, n_predict=4)
    model = MLPSpeculator(cfg)
    state, ids = torch.randn(1, 3, 8), torch.randint(0, 20, (1, 3))
    state_w = 0.5 ** (0.5 / 4)
    emb_w = math.sqrt((1 - state_w**2) * 12 / 2)
    s = state @ model.proj[0].weight.T + (emb_w / state_w) * model.emb[0].weight[ids]
    s = s / s.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * model.ln[0].weight + model.ln[0].bias
    s = F.gelu(s)
    new_state, logits = model.stage(0, state, ids)
    torch.testing.assert_close(new_state, s)
    torch.testing.assert_close(logits, s @ model.head[0].weight.T)


def test_forward_is_teacher_forced_chain_of_stages():
    torch.manual_seed(0)
    model = MLPSpeculator(MLPSpeculatorConfig(emb_dim=8, inner_dim=8, vocab_size=20, n_predict=3, scale_input=True))
    state, ids = torch.randn(2, 4, 8), torch.randint(0, 20, (2, 7))
    out = model(state, ids)
    s = state
    for i in range(3):  # stage i at t reads x_{t+1+i}
        s, logits = model.stage(i, s, ids[:, 1 + i : 5 + i])
        torch.testing.assert_close(out[i], logits)


def test_forward_with_head_fn_hands_each_stage_its_state_and_head():
    # training computes the loss inside forward (chunked, tests/unit/test_head_loss_chunked.py): head_fn
    # gets stage i's state rows and head[i] instead of the (P, B, T, V) logits
    torch.manual_seed(0)
    model = MLPSpeculator(MLPSpeculatorConfig(emb_dim=8, inner_dim=12, vocab_size=20, n_predict=3, tie_weights=True))
    state, ids = torch.randn(2, 4, 8), torch.randint(0, 20, (2, 7))
    seen = model(state, ids, head_fn=lambda i, rows, head: (i, rows, head))
    logits = model(state, ids)
    assert [i for i, _, _ in seen] == [0, 1, 2]
    for i, rows, head in seen:
        assert head is model.head[i] and rows.shape == (8, 12)
        torch.testing.assert_close(head(rows), logits[i].flatten(0, 1))


def test_tie_weights_share_stages_like_fms_extras():
    model = MLPSpeculator(MLPSpeculatorConfig(emb_dim=8, inner_dim=12, vocab_size=20, n_predict=4, tie_weights=True))
    assert all(model.emb[i].weight is model.emb[0].weight for i in range(4))
    assert all(model.head[i].weight is model.head[0].weight for i in range(4))
    assert all(model.ln[i].bias is model.ln[0].bias for i in range(4))
    assert model.proj[1].weight is not model.proj[0].weight
    assert all(model.proj[i].weight is model.proj[1].weight for i in range(2, 4))
    n = sum(p.numel() for p in model.parameters())
    assert n == 20 * 12 + 8 * 12 + 12 * 12 + 20 * 12 + 2 * 12
    with pytest.raises(RecipeError, match="tie_weights needs n_predict >= 2"):
        load_recipe(None, ["draft.method=mlp_speculator", "draft.tie_weights=true",
                           "draft.n_predict=1"])
