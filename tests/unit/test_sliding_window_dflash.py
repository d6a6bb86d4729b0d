"""``draft.sliding_window`` for the DFlash family (DFlash, DFlash2, DSpark): the windowed block mask
equals a dense reference written from vLLM's rule on both attention backends, no window changes
nothing, training and the reference decoder apply the same window (packed rows too), the window and
every key vLLM 0.33 reads survive both export formats, ``max_position_embeddings`` reaches the
target's served context, and bad windows are refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from draftsmith.eval.export import export
from draftsmith.methods import get_method
from draftsmith.models.dflash.config import DFlashConfig, served_context_length
from draftsmith.models.dflash.model import DFlashKVCache, block_attention, block_attention_mask
from draftsmith.models.dflash.proposer import DFlashProposer
from draftsmith.models.dflash.training import sample_anchors
from draftsmith.models.dflash2.config import DFlash2Config
from draftsmith.models.dspark.config import DSparkConfig
from draftsmith.recipe import RecipeError, load_recipe
from draftsmith.train.dry_run import dry_run

from helpers import REPO
from helpers.tiny import dflash_tiny_config, dspark_tiny_config, random_dflash_model, write_draft_checkpoint

FAMILY = ("dflash", "dflash2", "dspark")
W = 5  # a window that binds on the tiny rows (the recipe's multiple-of-128 rule is the recipe's, not the config's)


def tiny_config(method: str, **kw):
    """A tiny config of ``method`` (DFlash2 drafts over the full vocab)."""
    if method == "dspark":
        return dspark_tiny_config(**kw)
    if method == "dflash2":
        base = dflash_tiny_config(draft_vocab_size=50).to_dict()
        return DFlash2Config(**{**base, "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 6,
                                "selector_top_k": 5, **kw})
    return dflash_tiny_config(**kw)


# ------------------------------------------------------------------------------------------
# The mask: a dense reference written from vLLM's window rule


def dense_reference(q, k_ctx, v_ctx, k_blk, v_blk, anchors, valid, docs, window, Bk, scale):
    """Attention of the blocks, one query at a time: block j's slot i sits at position
    ``anchors[j] + i``; a key at position p is seen iff ``|query - p| < window`` (vLLM's
    non-causal sliding window; None: any), the context key t only before the anchor and in its
    document, block keys only of block j. Invalid blocks give 0."""
    B, nh, L, hd = q.shape
    T, groups = k_ctx.shape[2], nh // k_ctx.shape[1]
    k = torch.cat([k_ctx, k_blk], 2).repeat_interleave(groups, 1)
    v = torch.cat([v_ctx, v_blk], 2).repeat_interleave(groups, 1)
    allow = torch.zeros(B, L, T + L, dtype=torch.bool)
    for b in range(B):
        for j in range(L // Bk):
            a = int(anchors[b, j])
            for i in range(Bk):
                query = a + i
                near = (lambda p: window is None or abs(query - p) < window)  # noqa: E731
                for t in range(T):
                    allow[b, j * Bk + i, t] = bool(valid[b, j]) and t < a and docs[b, t] == docs[b, a] and near(t)
                for i2 in range(Bk):
                    allow[b, j * Bk + i, T + j * Bk + i2] = near(a + i2)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allow[:, None], float("-inf"))
    out = scores.softmax(-1) @ v
    return out * valid.repeat_interleave(Bk, 1)[:, None, :, None], allow


def random_case(seed=0, B=2, nh=4, nkv=2, T=24, Bk=4, hd=8, A=6):
    gen = torch.Generator().manual_seed(seed)
    docs = (torch.arange(T)[None] >= 10).long().expand(B, T).contiguous()  # a packed row: 10 + 14 tokens
    mask = torch.ones(B, T, dtype=torch.long)
    mask[-1, : T - 5] = 0  # the last row has few valid anchors: padding anchors too
    anchors, valid = sample_anchors(mask, A, gen, docs)
    ctx_allow = torch.arange(T)[None, None] < anchors[..., None]
    ctx_allow &= docs[:, None, :] == docs.gather(1, anchors)[..., None]
    L = anchors.shape[1] * Bk
    tensors = [torch.randn(B, n, m, hd, generator=gen) for n, m in ((nh, L), (nkv, T), (nkv, T), (nkv, L), (nkv, L))]
    return tensors, ctx_allow, anchors, valid, docs


@pytest.mark.parametrize("window", [None, W, 9])
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_window_mask_equals_the_dense_reference(window, backend):
    if backend == "flex":
        pytest.importorskip("torch.nn.attention.flex_attention")
    (q, kc, vc, kb, vb), ctx_allow, anchors, valid, docs = random_case()
    Bk, scale = 4, 8 ** -0.5
    assert not valid.all()
    want, allow = dense_reference(q, kc, vc, kb, vb, anchors, valid, docs, window, Bk, scale)
    mask = block_attention_mask(ctx_allow, valid, Bk, backend, sliding_window=window, anchors=anchors)
    if backend == "sdpa":
        valid_rows = valid.repeat_interleave(Bk, 1)  # an invalid block's row sees only its block, output zeroed
        assert torch.equal(mask.allow[:, 0][valid_rows], allow[valid_rows])
    with torch.no_grad():
        got = block_attention(q, kc, vc, kb, vb, mask, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if window is not None:  # the window binds in this case: some context key is cut
        assert not torch.equal(allow, dense_reference(q, kc, vc, kb, vb, anchors, valid, docs, None, Bk, scale)[1])


def test_no_window_leaves_the_mask_and_the_model_bit_identical():
    _, ctx_allow, anchors, valid, _ = random_case()
    plain = block_attention_mask(ctx_allow, valid, 4)
    assert torch.equal(block_attention_mask(ctx_allow, valid, 4, sliding_window=None, anchors=anchors).allow,
                       plain.allow)
    assert torch.equal(block_attention_mask(ctx_allow, valid, 4, sliding_window=64, anchors=anchors).allow,
                       plain.allow)  # a window past the row never binds
    ids, g, anchors, valid, pos, docs = model_inputs()
    with torch.no_grad():
        want = random_dflash_model(dflash_tiny_config())(ids, g, anchors, valid, position_ids=pos, document_ids=docs)
        got = random_dflash_model(dflash_tiny_config(sliding_window=64))(ids, g, anchors, valid, position_ids=pos,
                                                                          document_ids=docs)
    assert torch.equal(got, want)


def test_a_window_below_the_block_or_without_anchors_is_refused():
    _, ctx_allow, anchors, valid, _ = random_case()
    with pytest.raises(ValueError, match="sliding_window=3 needs the anchors and must be >= block_size=4"):
        block_attention_mask(ctx_allow, valid, 4, sliding_window=3, anchors=anchors)
    with pytest.raises(ValueError, match="needs the anchors"):
        block_attention_mask(ctx_allow, valid, 4, sliding_window=8)
    with pytest.raises(ValueError, match="sliding_window=3 must be >= block_size=4"):
        dflash_tiny_config(sliding_window=3)


# ------------------------------------------------------------------------------------------
# The model: training and the reference decoder see the same window


def model_inputs(T=20, seed=0):
    cfg = dflash_tiny_config()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, cfg.vocab_size, (1, T), generator=gen)
    g = torch.randn(1, T, len(cfg.aux_layer_ids) * cfg.target_hidden_size, generator=gen)
    anchors = torch.tensor([[1, 4, 8, 12, 15]])
    return ids, g, anchors, torch.ones_like(anchors, dtype=torch.bool), None, None


@pytest.mark.parametrize("method", FAMILY)
def test_windowed_training_blocks_equal_the_reference_decoder(method):
    """Each training block equals the proposer's forward over a cache of the context before its
    anchor (the decoder keeps every position; the window cuts them), and differs from the unwindowed
    draft exactly where a query reaches past the window."""
    cfg = tiny_config(method, sliding_window=W)
    spec = get_method(method)
    torch.manual_seed(0)
    model, plain = spec.model_class(cfg).eval(), spec.model_class(tiny_config(method)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
        model.init_from_target(torch.randn(cfg.vocab_size, cfg.hidden_size))
        plain.load_state_dict(model.state_dict())
        plain.init_from_target(model.embed_tokens)
    ids, g, anchors, valid, _, _ = model_inputs()
    with torch.no_grad():
        train = model.block_hidden(ids, g, anchors, valid)  # (1, A, Bk, H)
        full = plain.block_hidden(ids, g, anchors, valid)
        for j, a in enumerate(anchors[0].tolist()):
            cache = DFlashKVCache()
            model.append_context(cache, g[0, :a], torch.arange(a))
            got = model.run_block(cache, int(ids[0, a]), a, cfg.block_size)
            torch.testing.assert_close(got, train[0, j], rtol=1e-5, atol=1e-5)
            reaches_past = a + cfg.block_size - 1 - W >= 0  # the last slot's window starts after position 0
            assert torch.allclose(train[0, j], full[0, j], atol=1e-6) != reaches_past, a


def test_the_reference_decoders_greedy_drafts_are_the_windowed_training_argmax():
    cfg = dflash_tiny_config(sliding_window=W)
    model = random_dflash_model(cfg)
    ids, g, anchors, valid, _, _ = model_inputs()
    with torch.no_grad():
        logits = model(ids, g, anchors, valid)  # (1, A, Bk, Vd); d2t is the identity on the draft ids
    for j, a in enumerate(anchors[0].tolist()):
        proposer = DFlashProposer(model)
        proposal = proposer.propose(g[0, :a], ids[0, : a + 1], cfg.block_size - 1, 0.0, None)
        assert proposal.token_ids.tolist() == logits[0, j, 1:].argmax(-1).tolist(), a


def test_a_packed_row_windows_each_document_as_if_alone():
    cfg = dflash_tiny_config(sliding_window=W)
    model = random_dflash_model(cfg)
    ids, g, _, _, _, _ = model_inputs(T=21)
    first = 9  # document 0: positions 0..8, document 1: 9..20
    docs = (torch.arange(21) >= first).long()[None]
    pos = torch.where(docs == 0, torch.arange(21), torch.arange(21) - first)
    local = torch.tensor([[2, 6, 10]])
    valid = torch.ones_like(local, dtype=torch.bool)
    with torch.no_grad():
        packed = model(ids, g, local + first, valid, position_ids=pos, document_ids=docs)
        alone = model(ids[:, first:], g[:, first:], local, valid)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------
# The flex backend of the training forward: the block mask from each query's context interval (the
# window a bound on it), no dense mask, the tiles create_block_mask finds


def tile_sets(block_mask, n_kv_tiles: int):
    """The (partial, full) tiles of a BlockMask, dense ``(B, 1, nq, nk)`` bool, and its query-major
    tables transposed back."""
    from torch.nn.attention.flex_attention import _ordered_to_dense

    nq = block_mask.kv_num_blocks.shape[-1]
    return (_ordered_to_dense(block_mask.kv_num_blocks, block_mask.kv_indices, n_kv_tiles).bool(),
            _ordered_to_dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, n_kv_tiles).bool(),
            _ordered_to_dense(block_mask.q_num_blocks, block_mask.q_indices, nq).bool().transpose(-1, -2),
            _ordered_to_dense(block_mask.full_q_num_blocks, block_mask.full_q_indices, nq).bool().transpose(-1, -2))


@pytest.mark.parametrize("window", [None, W, 9])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("tile", [128, 8], ids=["one-tile", "8-row-tiles"])
def test_anchor_block_mask_flex_is_the_dense_rule_and_create_block_masks_tiles(window, packed, tile):
    """:func:`anchor_block_mask` on flex: its mask_mod, evaluated densely, is the SDPA path's mask at
    every valid block (an invalid block sees only itself); its full tiles are exactly those
    ``create_block_mask`` finds pair by pair and its partial tiles cover the rest; and the flex
    attention (forward only: no CPU flex backward in torch 2.13) is the dense reference."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    from draftsmith.models.dflash.model import anchor_block_mask

    (q, kc, vc, kb, vb), _, anchors, valid, docs = random_case(seed=3)
    docs = docs if packed else None
    if not packed:  # anchors anywhere in the row
        anchors, valid = sample_anchors(torch.ones(2, 24, dtype=torch.long), anchors.shape[1],
                                        torch.Generator().manual_seed(4))
        valid[-1, -2:] = False
    B, A = anchors.shape
    Bk, T, scale = 4, kc.shape[2], 8 ** -0.5
    L = A * Bk
    sdpa = anchor_block_mask(anchors, valid, T, Bk, "sdpa", window, docs)
    flex = anchor_block_mask(anchors, valid, T, Bk, "flex", window, docs, tile=tile)
    assert flex.allow is None and torch.equal(flex.keep, sdpa.keep)
    dense = create_mask(flex.flex.mask_mod, B, None, L, T + L, device="cpu")[:, 0]
    rows = valid.repeat_interleave(Bk, 1)
    assert torch.equal(dense[rows], sdpa.allow[:, 0][rows])
    own = (torch.arange(L)[:, None] // Bk == torch.arange(L)[None, :] // Bk)  # (L, L)
    assert torch.equal(dense[~rows], torch.cat([torch.zeros(L, T, dtype=torch.bool), own], 1)[None]
                       .expand(B, L, T + L)[~rows])
    nk = -(-(T + L) // tile)
    partial, full, q_partial, q_full = tile_sets(flex.flex, nk)
    assert torch.equal(q_partial, partial) and torch.equal(q_full, full) and not (partial & full).any()
    want_partial, want_full, _, _ = tile_sets(create_block_mask(flex.flex.mask_mod, B, None, L, T + L, device="cpu",
                                                                BLOCK_SIZE=tile), nk)
    assert torch.equal(full, want_full)
    assert not ((want_partial | want_full) & ~(partial | full)).any()
    with torch.no_grad():
        got = block_attention(q, kc, vc, kb, vb, flex, scale)
    want, _ = dense_reference(q, kc, vc, kb, vb, anchors, valid,
                              docs if docs is not None else torch.zeros(B, T, dtype=torch.long), window, Bk, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops dispatched under it (views left out) and the largest tensor any returned (elements)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.names.append(str(func))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_the_flex_anchor_mask_builds_no_dense_mask_and_the_window_is_a_bound():
    """At a recipe-like shape, the flex mask's build makes no tensor of a block query per context
    key (the SDPA path's ``(B, A, T)`` context mask, or the ``(B, L, T + L)`` pair evaluation of
    ``create_block_mask``); the window adds two elementwise ops over ``(B, A, Bk)``."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from draftsmith.models.dflash.model import anchor_block_mask

    B, T, A, Bk = 2, 2048, 64, 16
    gen = torch.Generator().manual_seed(0)
    anchors = torch.sort(torch.randint(1, T - Bk, (B, A), generator=gen), dim=1).values
    valid = torch.ones(B, A, dtype=torch.bool)
    docs = (torch.arange(T)[None] >= 700).long().expand(B, T).contiguous()
    names = {}
    for window in (None, 256):
        anchor_block_mask(anchors, valid, T, Bk, "flex", window, docs)  # the bucket's constants, once
        with _Ops() as ops:
            anchor_block_mask(anchors, valid, T, Bk, "flex", window, docs)
        assert ops.largest < B * A * T, f"window {window}: an op made {ops.largest} elements"
        names[window] = ops.names
    extra = list(names[256])
    for n in names[None]:
        extra.remove(n)
    assert sorted(extra) == ["aten.add.Tensor", "aten.maximum.default"]


# ------------------------------------------------------------------------------------------
# Export: the window and the keys vLLM 0.33 reads, both formats


def layouts(cfg):
    """Every config.json layout the method writes: Format A (speculators) and B (native) for
    DFlash / DFlash2, the one Qwen3DSparkModel config for DSpark."""
    if isinstance(cfg, DSparkConfig):
        return {"dspark": cfg.to_dspark("float32", {})}
    verifier = {"name_or_path": "t", "architectures": ["Qwen3ForCausalLM"]}
    return {"A": cfg.to_speculators(verifier, cfg.block_size - 1, "float32", "0.9.0", {}),
            "B": cfg.to_native("float32")}


@pytest.mark.parametrize("method", FAMILY)
@pytest.mark.parametrize("window", [None, 256])
def test_the_window_round_trips_through_every_layout(method, window):
    cfg = tiny_config(method, sliding_window=window)
    for name, config in layouts(cfg).items():
        config = json.loads(json.dumps(config))
        layer = config.get("transformer_layer_config", config)
        assert layer["sliding_window"] == window and layer["use_sliding_window"] is (window is not None), name
        assert layer["layer_types"] == ["full_attention" if window is None else "sliding_attention"] * cfg.num_layers
        if name == "A":
            assert config["sliding_window_non_causal"] is True  # vLLM 0.33: dflash_config.causal = not it
        else:
            assert config["dflash_config"]["causal"] is False
        assert type(cfg).from_export(config) == cfg, name


def test_readers_refuse_what_vllm_would_run_differently():
    b = dflash_tiny_config(sliding_window=256).to_native("float32")
    with pytest.raises(ValueError, match="mixed"):
        DFlashConfig.from_export(dict(b, layer_types=["sliding_attention", "full_attention"]))
    unset = dict(b, dflash_config={k: v for k, v in b["dflash_config"].items() if k != "causal"})
    with pytest.raises(ValueError, match="causally"):  # vLLM makes sliding layers causal unless told otherwise
        DFlashConfig.from_export(unset)
    swa = dict(dflash_tiny_config().to_native("float32"), dflash_config=dict(b["dflash_config"], use_swa=True,
                                                                               swa_window_size=384))
    assert DFlashConfig.from_export(swa).sliding_window == 384  # vLLM's other spelling of a window on every layer


@pytest.mark.parametrize("method", FAMILY)
def test_exported_checkpoint_carries_the_window(tmp_path, method):
    cfg = tiny_config(method, sliding_window=256)
    spec = get_method(method)
    target = {"name_or_path": "tiny", "path": "tiny", "architectures": ["Qwen3ForCausalLM"]}
    write_draft_checkpoint(spec.model_class(cfg), tmp_path / "ckpt", method, target)
    out = export(tmp_path / "ckpt", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config.get("transformer_layer_config", config)["sliding_window"] == 256
    assert spec.format.load(out).config.sliding_window == 256


# every key vLLM 0.33's speculators bridge reads (transformers_utils/configs/speculators/algos.py)
DFLASH_KEYS = ("draft_vocab_size", "target_hidden_size", "aux_hidden_state_layer_ids", "mask_token_id",
               "sample_from_anchor", "sliding_window_non_causal")
BRIDGE_KEYS = {
    "dflash": DFLASH_KEYS,
    "dflash2": DFLASH_KEYS + ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"),
    "dspark": ("architectures", "sample_from_anchor", "aux_hidden_state_layer_ids", "draft_vocab_size",
               "target_hidden_size", "mask_token_id", "markov_rank", "markov_head_type", "block_size",
               "enable_confidence_head", "confidence_head_with_markov", "use_aux_hidden_state"),
}


def tiny_target_config(**rope):
    return Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=50, max_position_embeddings=4096,
                       rope_parameters={"rope_type": "default", "rope_theta": 500.0, **rope})


def from_target(method, target, **kw):
    extra = {"dflash2": dict(conv_group_size=8, selector_rank=6, selector_top_k=5)}.get(method, {})
    vocab = 50 if method == "dflash2" else 20
    return type(tiny_config(method)).from_target(target, vocab, [1, 3], 2, 4, 7, **extra, **kw)


@pytest.mark.parametrize("method", FAMILY)
def test_every_key_vllm_reads_is_written_with_the_targets_context(method):
    target = tiny_target_config()
    for name, config in layouts(from_target(method, target)).items():
        layer = config.get("transformer_layer_config", config)
        assert layer["max_position_embeddings"] >= target.max_position_embeddings
        if name == "B":  # the native layout: vLLM reads it without the bridge, from dflash_config
            assert set(config["dflash_config"]) >= {"mask_token_id", "target_layer_ids", "causal"}
            continue
        missing = [key for key in BRIDGE_KEYS[method] if config.get(key) is None]
        assert not missing, (name, missing)
    if method == "dspark":
        config = layouts(from_target(method, target))["dspark"]
        assert config["architectures"] == ["Qwen3DSparkModel"] and config["sample_from_anchor"] is True
        assert config["target_layer_ids"] == [0, 2] and config["eagle_aux_hidden_state_layer_ids"] == [1, 3]


def test_max_position_embeddings_reaches_the_context_vllm_serves_the_target_with():
    plain, linear = tiny_target_config(), tiny_target_config(rope_type="linear", factor=4.0)
    yarn = tiny_target_config(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024)
    assert served_context_length(plain) == 4096 and served_context_length(linear) == 16384
    assert served_context_length(yarn) is None  # its max_position_embeddings enters the rotation: copied as is
    assert from_target("dflash", plain).max_position_embeddings == 4096
    assert from_target("dflash", linear).max_position_embeddings == 16384
    assert from_target("dflash", yarn).max_position_embeddings == 4096
    llama = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                        vocab_size=50, max_position_embeddings=2048)
    assert DFlashConfig.from_target(llama, 20, [1, 3], 1, 4, 7).max_position_embeddings == 2048


# ------------------------------------------------------------------------------------------
# Bad windows: one line each


@pytest.mark.parametrize("method", FAMILY)
def test_a_window_that_is_no_multiple_of_128_is_refused_by_the_recipe(method):
    with pytest.raises(RecipeError, match="draft.sliding_window 100: must be a positive multiple of 128"):
        load_recipe(REPO / f"recipes/qwen3_8b_{method}.yaml", ["draft.sliding_window=100"])
    assert load_recipe(REPO / f"recipes/qwen3_8b_{method}.yaml", ["draft.sliding_window=2048"]).draft.sliding_window \
        == 2048


@pytest.mark.parametrize("method", FAMILY)
def test_the_dry_run_refuses_a_window_beyond_the_targets_context(method):
    recipe = load_recipe(REPO / f"recipes/qwen3_8b_{method}.yaml", ["draft.sliding_window=65536"])
    with pytest.raises(ValueError, match=r"draft.sliding_window 65536 is larger than the target's context "
                                         r"\(40960 tokens, max_position_embeddings\)"):
        dry_run(recipe)


def test_training_setup_refuses_a_window_beyond_the_targets_context():
    with pytest.raises(ValueError, match=r"draft.sliding_window 8192 is larger than the target's context \(4096"):
        from_target("dflash", tiny_target_config(), sliding_window=8192)
    with pytest.raises(ValueError, match="multiple of 128"):
        from_target("dspark", tiny_target_config(), sliding_window=1000)
    assert from_target("dflash2", tiny_target_config(), sliding_window=2048).sliding_window == 2048
