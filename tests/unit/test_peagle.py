"""P-EAGLE: the COD training forward against the forward vLLM runs, the COD sampler, the
exporter's tensor-set checks, the mask-token rule, and training -> export -> lossless decoding
on the tiny target."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.eval.export import export
from draftsmith.models.peagle.proposer import PEagleProposer
from draftsmith.layout import ExportError
from draftsmith.methods import method_of_export
from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.format import is_eagle3_export
from draftsmith.models.eagle3.model import Eagle3DraftModel, Eagle3KVCache
from draftsmith.models.peagle.config import PEagleConfig
from draftsmith.models.peagle.format import expected_peagle_weights, is_peagle_export, load_peagle
from draftsmith.models.peagle.model import CODElements, PEagleDraftModel, cod_attention_mask
from draftsmith.models.peagle.training import cod_sample
from draftsmith.train.mask_token import MaskTokenError, resolve_mask_token_id

from helpers.tiny import write_draft_checkpoint

V, H, VD = 64, 32, 48


def tiny_config(**kw) -> PEagleConfig:
    base = dict(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                vocab_size=V, draft_vocab_size=VD, aux_layer_ids=[0, 1, 2], rope_theta=10000.0,
                max_position_embeddings=256, num_layers=2, num_depths=4, mask_token_id=3)
    base.update(kw)
    return PEagleConfig(**base)


def tiny_model(seed: int = 0, **kw) -> PEagleDraftModel:
    torch.manual_seed(seed)
    cfg = tiny_config(**kw)
    model = PEagleDraftModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # norms away from ones, so a wrong norm shows
        model.init_from_target(torch.randn(V, H))
        d2t = torch.zeros(VD, dtype=torch.long)
        d2t[VD // 2:] = V - VD  # draft ids VD/2.. map to the top of the target vocab
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[(torch.arange(VD) + d2t)] = True
        model.set_vocab_mapping(d2t, t2d)
    return model.eval()


def chain_elements(T: int, anchor: int, depth: int) -> CODElements:
    """Depth 0 at every position plus one chain: anchor a, depths 1..depth."""
    anchors = list(range(T)) + [anchor] * depth
    depths = [0] * T + list(range(1, depth + 1))
    return CODElements.from_rows([(anchors, depths)])


def vllm_style(model: PEagleDraftModel, ids: torch.Tensor, aux: torch.Tensor, anchor: int, depth: int) -> torch.Tensor:
    """What vLLM runs: one causal forward over [depth-0 slots 0..a, masks at a+1..a+depth]
    (docs/parallel_drafts.md, "P-EAGLE at inference") -> pre-norm hidden of the depth + 1 sampled
    slots (bonus + masks)."""
    a = anchor
    tok = ids[0, 1 : a + 2]  # x_{t+1} for t = 0..a
    hid = model.fc(aux[0, : a + 1])
    slot_ids = torch.cat([tok, torch.full((depth,), model.config.mask_token_id)]).unsqueeze(0)
    slot_hid = torch.cat([hid, model.mask_state().expand(depth, -1)]).unsqueeze(0)
    positions = torch.arange(a + 1 + depth).unsqueeze(0)
    caches = [Eagle3KVCache() for _ in model.layers]
    out = model.forward_cached(slot_ids, slot_hid, positions, caches)
    return out[0, a:]


def random_inputs(T: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, V, (1, T), generator=g), torch.randn(1, T, 3 * H, generator=g)


@pytest.mark.parametrize("num_layers", [1, 3])
def test_cod_chain_equals_one_causal_forward_as_vllm_runs_it(num_layers):
    """The training forward's logits for a COD chain equal one causal forward over
    [depth-0 prefix <= a, masks a+1..a+d]."""
    model = tiny_model(num_layers=num_layers)
    T, a, d = 12, 5, 3
    ids, aux = random_inputs(T)
    with torch.no_grad():
        train = model(ids, aux, chain_elements(T, a, d))  # (1, T + d, H)
        got = torch.cat([train[0, a : a + 1], train[0, T:]])  # depth 0 at a, then the chain
        want = vllm_style(model, ids, aux, a, d)
    torch.testing.assert_close(model.compute_logits(got), model.compute_logits(want), atol=1e-5, rtol=1e-5)


def test_mask_slots_never_see_later_real_tokens():
    """Perturbing every real token / hidden after the anchor leaves the chain unchanged, while the
    depth-0 entry of a later position does change (the perturbation is live)."""
    model = tiny_model()
    T, a, d = 12, 4, 3
    ids, aux = random_inputs(T)
    ids2, aux2 = ids.clone(), aux.clone()
    ids2[0, a + 2 :] = torch.randint(4, V, (T - a - 2,))
    aux2[0, a + 1 :] += 3.0 * torch.randn(T - a - 1, 3 * H)
    el = chain_elements(T, a, d)
    with torch.no_grad():
        h1, h2 = model(ids, aux, el), model(ids2, aux2, el)
    torch.testing.assert_close(h1[0, T:], h2[0, T:])  # the chain
    torch.testing.assert_close(h1[0, : a + 1], h2[0, : a + 1])  # the context it reads
    assert (h1[0, a + 1 : T] - h2[0, a + 1 : T]).abs().max() > 1e-2


def test_attention_mask_is_the_cod_rule():
    el = CODElements.from_rows([([0, 1, 2, 3, 0, 1, 0], [0, 0, 0, 0, 1, 1, 2])])
    m = cod_attention_mask(el)[0]
    # the depth-2 slot of anchor 0 (element 6) sees position 0 and its own chain, nothing else
    assert m[6].tolist() == [True, False, False, False, True, False, True]
    # the depth-1 slot of anchor 1 sees positions 0, 1 and itself, not anchor 0's chain
    assert m[5].tolist() == [True, True, False, False, False, True, False]
    # depth 0 is causal over depth 0 only
    assert m[2].tolist() == [True, True, True, False, False, False, False]
    # packed rows: an element never sees another document
    docs = torch.tensor([[0, 0, 1, 1]])
    md = cod_attention_mask(el, docs)[0]
    assert md[3].tolist() == [False, False, True, True, False, False, False]


def test_depth0_equals_eagle3_step0_with_the_same_weights():
    model = tiny_model(num_layers=1, norm_before_residual=True)
    eagle = Eagle3DraftModel(Eagle3Config(**{k: getattr(model.config, k) for k in Eagle3Config.__dataclass_fields__}))
    state = {k: v for k, v in model.state_dict().items() if k != "mask_hidden"}
    eagle.load_state_dict(state, strict=False)
    eagle.init_from_target(model.embed_tokens)
    T = 10
    ids, aux = random_inputs(T, seed=3)
    with torch.no_grad():
        want = eagle(ids, aux, 1)[0]  # (1, T, Vd)
        got = model.compute_logits(model(ids, aux, chain_elements(T, 0, 0)))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_cod_sampling_sizes_chains_and_seed():
    T, D, r, rmin = 60, 5, 0.7, 0.2
    pred = torch.zeros(2, T, dtype=torch.bool)
    pred[:, 10:50] = True  # 40 trained positions
    el = cod_sample(pred, D, r, rmin, torch.Generator().manual_seed(0))
    again = cod_sample(pred, D, r, rmin, torch.Generator().manual_seed(0))
    other = cod_sample(pred, D, r, rmin, torch.Generator().manual_seed(1))
    assert torch.equal(el.anchor, again.anchor) and torch.equal(el.depth, again.depth)
    assert not torch.equal(el.anchor, other.anchor)
    for b in range(2):
        v = el.valid[b]
        a, d = el.anchor[b][v], el.depth[b][v]
        assert torch.equal(a[:T], torch.arange(T)) and (d[:T] == 0).all()
        n = 40
        for k in range(1, D):
            want = int(max(0, n - k) * max(r**k, rmin))
            got = int((d == k).sum())
            assert got == min(want, got) and got > 0  # never above the COD size
            if k == 1:
                assert got == want
            pos = (a + d)[d == k]
            assert pred[b, pos].all()  # only trained positions
            if k > 1:  # chains continue one step right: the same anchor at depth k-1
                prev = set(zip(a[d == k - 1].tolist(), (d[d == k - 1]).tolist()))
                assert all((ai, k - 1) in prev for ai in a[d == k].tolist())
    # r_min floors the size at deep depths
    deep = cod_sample(torch.ones(1, 200, dtype=torch.bool), 8, 0.3, 0.2, torch.Generator().manual_seed(0))
    assert int((deep.depth == 7).sum()) > 0


def test_cod_sample_max_anchors_and_documents():
    pred = torch.ones(1, 40, dtype=torch.bool)
    el = cod_sample(pred, 3, 0.7, 0.2, torch.Generator().manual_seed(0), max_anchors=10)
    assert int((el.depth == 1).sum()) == int(9 * 0.7)
    docs = torch.tensor([[0] * 20 + [1] * 20])
    el = cod_sample(pred, 4, 1.0, 0.2, torch.Generator().manual_seed(0), document_ids=docs)
    v = el.valid[0]
    a, pos = el.anchor[0][v], el.pos[0][v]
    assert (docs[0, a] == docs[0, pos]).all()  # a chain never crosses a document boundary


# --------------------------------------------------------------------------------------
# Export


TARGET = {"name_or_path": "tiny", "path": "/nowhere", "architectures": ["LlamaForCausalLM"], "aux_layer_ids": [0, 1, 2],
          "hidden_size": H, "vocab_size": V}


def checkpoint(tmp_path: Path, **kw) -> tuple[Path, PEagleDraftModel]:
    model = tiny_model(**kw)
    ckpt = tmp_path / "ckpt"
    state = write_draft_checkpoint(model, ckpt, "peagle", TARGET)
    if model.config.train_embeddings:  # a parameter then: the trainer saves it (the helper drops it)
        save_file({**state, "embed_tokens": model.embed_tokens.detach()}, str(ckpt / "model.safetensors"))
    return ckpt, model


def test_export_writes_exactly_the_expected_tensors_and_config(tmp_path):
    ckpt, model = checkpoint(tmp_path, num_layers=3)
    out = export(ckpt, tmp_path / "out", num_speculative_tokens=3)
    weights = load_file(str(out / "model.safetensors"))
    want = expected_peagle_weights(model.config)
    assert {k: tuple(v.shape) for k, v in weights.items()} == want
    assert want["mask_hidden"] == (1, 1, 3 * H)
    assert want["layers.0.self_attn.q_proj.weight"] == (32, 2 * H) and "layers.0.hidden_norm.weight" in want
    assert want["layers.2.self_attn.k_proj.weight"] == (16, H) and "layers.2.hidden_norm.weight" not in want
    assert "embed_tokens.weight" not in want
    torch.testing.assert_close(weights["mask_hidden"].flatten(), model.mask_hidden.detach())
    cfg = json.loads((out / "config.json").read_text())
    assert "model_type" not in cfg and cfg["speculators_model_type"] == "peagle"
    assert cfg["speculators_config"]["algorithm"] == "peagle"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert cfg["mask_token_id"] == 3 and cfg["norm_before_residual"] is False and cfg["norm_before_fc"] is False
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 3
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert is_peagle_export(cfg) and not is_eagle3_export(cfg) and method_of_export(cfg).name == "peagle"
    # config round trip
    back = PEagleConfig.from_speculators(cfg)
    assert back == model.config
    loaded = load_peagle(out, model.embed_tokens)
    ids, aux = random_inputs(8)
    with torch.no_grad():
        el = chain_elements(8, 3, 2)
        torch.testing.assert_close(loaded(ids, aux, el), model(ids, aux, el))


def test_export_ships_trained_embeddings(tmp_path):
    ckpt, model = checkpoint(tmp_path, train_embeddings=True)
    out = export(ckpt, tmp_path / "out")
    weights = load_file(str(out / "model.safetensors"))
    assert weights["embed_tokens.weight"].shape == (V, H)
    torch.testing.assert_close(weights["embed_tokens.weight"], model.embed_tokens.detach())
    assert json.loads((out / "config.json").read_text())["speculators_config"]["proposal_methods"][0][
        "speculative_tokens"] == model.config.num_depths


def test_export_refuses_missing_extra_or_misshaped_tensors_and_k_above_depths(tmp_path):
    ckpt, _ = checkpoint(tmp_path)
    state = load_file(str(ckpt / "model.safetensors"))
    with pytest.raises(ExportError, match=r"num_depths=4"):
        export(ckpt, tmp_path / "k", num_speculative_tokens=5)
    for name, edit in [("missing", lambda s: s.pop("mask_hidden")),
                       ("unexpected", lambda s: s.__setitem__("layers.1.hidden_norm.weight", torch.ones(H))),
                       ("mis-shaped", lambda s: s.__setitem__("fc.weight", torch.zeros(H, 2 * H)))]:
        s = dict(state)
        edit(s)
        save_file(s, str(ckpt / "model.safetensors"))
        with pytest.raises(ExportError, match=name):
            export(ckpt, tmp_path / name)


def test_proposer_is_one_parallel_forward_and_refuses_k_above_depths():
    model = tiny_model()
    proposer = PEagleProposer(model)
    ids, aux = random_inputs(9)
    states, nxt = aux[0], ids[0, 1:]
    states = states[:8]
    prop = proposer.propose(states, nxt, 4, 0.0, None)
    assert proposer.length == 8 and all(len(c) == 8 for c in proposer.caches)  # mask slots cropped
    with torch.no_grad():
        want = model.compute_logits(vllm_style(model, ids, aux, 7, 3)).argmax(-1)
    assert torch.equal(prop.token_ids, want + model.d2t[want])
    with pytest.raises(ValueError, match="num_depths=4"):
        proposer.propose(states[:1], nxt[:1], 5, 0.0, None)


def test_mask_token_occurring_in_the_data_is_refused():
    counts = np.zeros(V, dtype=np.int64)
    counts[[1, 2, 3, 5]] = 7
    with pytest.raises(MaskTokenError, match=r"mask_token_id=3 occurs 7 times in data.*never uses: 4"):
        resolve_mask_token_id(3, counts)
    assert resolve_mask_token_id(None, counts) == 4


# --------------------------------------------------------------------------------------
# Training on the tiny target -> export -> lossless speculative decoding
