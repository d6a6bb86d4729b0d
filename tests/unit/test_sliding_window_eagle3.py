"""``draft.sliding_window`` for EAGLE-3 / 3.1: the TTT attention under a window equals a dense
reference written from vLLM's rule (a query at position p sees keys at p' with p - p' < W; TTT
step k's query stands at position t + k), on both backends and packed rows; no window leaves the
draft as it was; the reference decoder's cached chain computes what training computes; the export
writes the window (and every key vLLM 0.33's speculators reader reads) and reads it back; bad
windows give one-line errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from draftsmith.draft_section import sliding_window_problem
from draftsmith.models.eagle3.config import EAGLE31_OPTIONS, Eagle3Config
from draftsmith.models.eagle3.model import Eagle3DraftModel, Eagle3KVCache, TTTMask, ttt_attention, ttt_attention_mask
from draftsmith.models.peagle.config import PEagleConfig
from draftsmith.recipe import RecipeError, load_recipe

from helpers.tiny import eagle3_tiny_config

BACKENDS = ["sdpa", "flex"]
# two rows: three documents (packed), and one document then padding (-1)
DOCS = torch.tensor([[0] * 9 + [1] * 8 + [2] * 3, [0] * 16 + [-1] * 4])


def allowed(T: int, step: int, window: int | None, docs: torch.Tensor | None) -> torch.Tensor:
    """``(B | 1, T, (step + 1) * T)`` bool, written key by key from the positions vLLM attends
    over: step-0 key j at position j, step-s key (s >= 1) of row j at position j + s, the query of
    row t at position t + step."""
    B = 1 if docs is None else docs.shape[0]
    out = torch.zeros(B, T, (step + 1) * T, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            for s in range(step + 1):
                for j in range(T):
                    same_doc = docs is None or bool(docs[b, t] == docs[b, j])
                    if s == 0:
                        ok = j <= t and same_doc and (window is None or (t + step) - j < window)
                    else:
                        ok = j == t
                    out[b, t, s * T + j] = ok
    return out


def dense_attention(q, keys, values, scale, window=None, docs=None):
    """The reference: every score materialised, masked by :func:`allowed`, one softmax."""
    groups = q.shape[1] // keys[0].shape[1]
    k = torch.cat(keys, dim=2).repeat_interleave(groups, dim=1)
    v = torch.cat(values, dim=2).repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    mask = allowed(q.shape[-2], len(keys) - 1, window, docs).unsqueeze(1)
    return torch.matmul(torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1), v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_windowed_ttt_attention_equals_the_dense_reference(backend, packed):
    if backend == "flex":  # forward only: flex's backward needs CUDA in torch 2.13
        pytest.importorskip("torch.nn.attention.flex_attention")
    torch.manual_seed(1)
    B, nh, nkv, T, hd, steps, window = 2, 4, 2, 20, 8, 4, 6
    docs = DOCS if packed else None
    dtype = torch.float64 if backend == "sdpa" else torch.float32
    q = torch.randn(B, nh, T, hd, dtype=dtype)
    keys = [torch.randn(B, nkv, T, hd, dtype=dtype) for _ in range(steps)]
    values = [torch.randn(B, nkv, T, hd, dtype=dtype) for _ in range(steps)]
    mask = TTTMask.build(T, steps, torch.device("cpu"), docs, backend=backend, sliding_window=window)
    for k in range(steps):
        got = ttt_attention(q, keys[:k + 1], values[:k + 1], 1 / math.sqrt(hd), mask=mask)
        want = dense_attention(q, keys[:k + 1], values[:k + 1], 1 / math.sqrt(hd), window, docs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # the window matters here: the unwindowed attention differs at the rows it cuts
        full = dense_attention(q, keys[:k + 1], values[:k + 1], 1 / math.sqrt(hd), None, docs)
        assert not torch.allclose(got, full, atol=1e-3)


def test_windowed_mask_gradients_match_the_dense_reference():
    torch.manual_seed(2)
    B, nh, nkv, T, hd, steps, window = 2, 2, 1, 20, 4, 3, 5
    q = torch.randn(B, nh, T, hd, dtype=torch.float64, requires_grad=True)
    keys = [torch.randn(B, nkv, T, hd, dtype=torch.float64, requires_grad=True) for _ in range(steps)]
    values = [torch.randn(B, nkv, T, hd, dtype=torch.float64, requires_grad=True) for _ in range(steps)]
    mask = TTTMask.build(T, steps, torch.device("cpu"), DOCS, backend="sdpa", sliding_window=window)
    got = ttt_attention(q, keys, values, 0.5, mask=mask)
    want = dense_attention(q, keys, values, 0.5, window, DOCS)
    upstream = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, [q, *keys, *values], upstream),
                    torch.autograd.grad(want, [q, *keys, *values], upstream)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_no_window_leaves_the_masks_and_the_draft_as_they_were():
    T, steps = 12, 3
    for k in range(steps):  # the mask function: exactly the unwindowed rule
        assert torch.equal(ttt_attention_mask(T, k, sliding_window=None), allowed(T, k, None, None)[0])
        assert torch.equal(ttt_attention_mask(T, k, document_ids=DOCS[:, :T], sliding_window=None),
                           allowed(T, k, None, DOCS[:, :T]))
    # the SDPA path keeps its one shared mask (sliced per step) without a window
    plain = TTTMask.build(T, steps, torch.device("cpu"), DOCS[:, :T])
    assert isinstance(plain.dense, torch.Tensor) and plain.dense.shape == (2, 1, T, steps * T)
    # a window no row ever reaches computes the same bits as no window
    torch.manual_seed(3)
    model = Eagle3DraftModel(eagle3_tiny_config())
    wide = Eagle3DraftModel(eagle3_tiny_config(sliding_window=T + steps))
    wide.load_state_dict(model.state_dict())
    ids, aux = torch.randint(0, 50, (2, T)), torch.randn(2, T, 96)
    with torch.no_grad():
        for got, want in zip(wide(ids, aux, steps), model(ids, aux, steps)):
            assert torch.equal(got, want)


def chained_logits(model: Eagle3DraftModel, ids: torch.Tensor, aux: torch.Tensor, t: int, steps: int) -> list:
    """What the reference decoder computes for row t (:class:`Eagle3Proposer`'s arithmetic): step 0
    over rows 0..t through the KV cache, then chained steps at positions t + 1, t + 2, ..."""
    cache = Eagle3KVCache()
    hidden = model.step_cached(ids[:, 1:t + 2], model.fuse(aux[:, :t + 1]), torch.arange(t + 1)[None], cache)
    hidden = hidden[:, -1:]
    out = [model.compute_logits(hidden[0, -1])]
    for k in range(1, steps):
        hidden = model.step_cached(ids[:, t + k + 1:t + k + 2], model.next_hidden(hidden),
                                   torch.tensor([[t + k]]), cache)
        out.append(model.compute_logits(hidden[0, -1]))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_reference_decoder_sees_the_window_training_trains(backend):
    if backend == "flex":
        pytest.importorskip("torch.nn.attention.flex_attention")
    torch.manual_seed(4)
    T, steps, window = 24, 3, 5
    model = Eagle3DraftModel(eagle3_tiny_config(sliding_window=window, norm_output=True)).eval()
    model.attention_backend = backend
    with torch.no_grad():
        model.embed_tokens.normal_()
        ids, aux = torch.randint(0, 50, (1, T)), torch.randn(1, T, 96)
        trained = model(ids, aux, steps)  # K x (1, T, Vd)
        for t in (0, 4, 11, T - steps - 1):
            for k, logits in enumerate(chained_logits(model, ids, aux, t, steps)):
                torch.testing.assert_close(logits, trained[k][0, t], rtol=1e-4, atol=1e-4)


def test_a_packed_row_computes_what_its_documents_compute_alone():
    torch.manual_seed(5)
    steps, window, lengths = 3, 5, (11, 9)
    model = Eagle3DraftModel(eagle3_tiny_config(sliding_window=window)).eval()
    with torch.no_grad():
        model.embed_tokens.normal_()
        docs_ids = [torch.randint(0, 50, (1, n)) for n in lengths]
        docs_aux = [torch.randn(1, n, 96) for n in lengths]
        row = model(torch.cat(docs_ids, 1), torch.cat(docs_aux, 1), steps,
                    position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
                    document_ids=torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None])
        start = 0
        for ids, aux, n in zip(docs_ids, docs_aux, lengths):
            alone = model(ids, aux, steps)
            for k in range(steps):  # step k's inputs past the document's end differ: compare the rows before
                torch.testing.assert_close(row[k][0, start:start + n - k - 1], alone[k][0, :n - k - 1],
                                           rtol=1e-5, atol=1e-5)
            start += n


VERIFIER = {"name_or_path": "t", "architectures": ["LlamaForCausalLM"]}


@pytest.mark.parametrize("window", [None, 256])
def test_the_window_round_trips_through_both_export_formats(window):
    cfg = eagle3_tiny_config(sliding_window=window, max_position_embeddings=4096)
    written = json.loads(json.dumps(cfg.to_speculators(VERIFIER, 3, "float32", "0.9.0", {})))
    layer = written["transformer_layer_config"]
    kind = "full_attention" if window is None else "sliding_attention"
    assert (layer["sliding_window"], layer["use_sliding_window"], layer["layer_types"]) == (window, window is not None,
                                                                                          [kind])
    assert Eagle3Config.from_speculators(written) == cfg
    assert Eagle3Config.from_export(json.loads(json.dumps(cfg.to_legacy("float32", {})))) == cfg


def test_the_reader_applies_the_window_as_vllm_does():
    layer = eagle3_tiny_config(sliding_window=256).to_speculators(VERIFIER, 3, "float32", "0.9.0", {})
    # vLLM's Llama attention windows a layer only when layer_types names it sliding_attention
    bare = json.loads(json.dumps(layer))
    del bare["transformer_layer_config"]["layer_types"]
    assert Eagle3Config.from_speculators(bare).sliding_window is None
    peagle = PEagleConfig.from_eagle3(eagle3_tiny_config(sliding_window=256), num_layers=2, mask_token_id=3)
    mixed = json.loads(json.dumps(peagle.to_speculators(VERIFIER, 2, "float32", "0.9.0", {})))
    mixed["transformer_layer_config"]["layer_types"] = ["sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match="layer_types mixes"):
        PEagleConfig.from_speculators(mixed)
    with pytest.raises(ValueError, match="sliding_window must be a positive number of tokens"):
        eagle3_tiny_config(sliding_window=0)


def test_peagle_export_writes_a_window_key_per_layer_and_reads_it_back():
    cfg = PEagleConfig.from_eagle3(eagle3_tiny_config(sliding_window=128), num_layers=3, mask_token_id=3)
    written = json.loads(json.dumps(cfg.to_speculators(VERIFIER, 2, "float32", "0.9.0", {})))
    assert written["transformer_layer_config"]["layer_types"] == ["sliding_attention"] * 3
    assert PEagleConfig.from_speculators(written).sliding_window == 128


# every key vLLM 0.33's speculators reader (transformers_utils/configs/speculators/algos.py) reads
EAGLE3_KEYS = {"draft_vocab_size", "target_hidden_size", "norm_before_residual", *EAGLE31_OPTIONS,
               "eagle_aux_hidden_state_layer_ids"}
PEAGLE_KEYS = {"draft_vocab_size", "target_hidden_size", "norm_before_residual", "norm_before_fc", "mask_token_id",
               "eagle_aux_hidden_state_layer_ids"}


@pytest.mark.parametrize("method", ["eagle3", "eagle31", "peagle"])
def test_exports_write_every_key_vllm_reads_and_the_targets_context(method, tiny_target):
    from transformers import AutoConfig

    target = AutoConfig.from_pretrained(tiny_target)
    options = dict.fromkeys(EAGLE31_OPTIONS, method == "eagle31")
    cfg = Eagle3Config.from_target(target, draft_vocab_size=64, aux_layer_ids=[1, 2, 4],
                                   **(options if method != "peagle" else {}))
    keys = EAGLE3_KEYS
    if method == "peagle":
        cfg, keys = PEagleConfig.from_eagle3(cfg, mask_token_id=3), PEAGLE_KEYS
    written = cfg.to_speculators(VERIFIER, 2, "float32", "0.9.0", {})
    assert keys <= set(written), sorted(keys - set(written))
    assert all(written[k] is not None for k in keys)
    # written as trained, never left to the reader's default (True for eagle3, False for peagle)
    assert written["norm_before_residual"] is cfg.norm_before_residual
    assert {k: written[k] for k in EAGLE31_OPTIONS if k in keys} == {k: options[k] for k in EAGLE31_OPTIONS
                                                                      if k in keys}
    layer = written["transformer_layer_config"]
    assert layer["model_type"] == "llama"
    assert layer["max_position_embeddings"] >= target.max_position_embeddings


def test_bad_windows_give_one_line_errors(tiny_target):
    for value, match in [(100, "draft.sliding_window 100: must be a positive multiple of 128"),
                         (-128, "draft.sliding_window -128: must be a positive multiple of 128")]:
        with pytest.raises(RecipeError, match=match) as caught:
            load_recipe(None, [f"draft.sliding_window={value}"])
        assert "\n" not in str(caught.value).split("draft.sliding_window", 1)[1].strip()
    problem = sliding_window_problem(2048, 1024)
    assert problem.startswith("draft.sliding_window 2048 is larger than the target's context (1024 tokens")
    assert sliding_window_problem(1024, 1024) is None  # the whole context is a window that never slides
    assert load_recipe(None, ["draft.sliding_window=256"]).draft.sliding_window == 256
    assert load_recipe(None, []).draft.sliding_window is None


def test_the_dry_run_refuses_a_window_beyond_the_targets_context(tiny_target, tmp_path):
    from draftsmith.train.dry_run import dry_run

    recipe = load_recipe(None, [f"target.name_or_path={tiny_target}", "data.max_length=96",
                                "data.aux_layer_ids=[1, 2, 4]", "data.draft_vocab_size=64",
                                "draft.sliding_window=2048"])
    with pytest.raises(ValueError) as caught:
        dry_run(recipe, target_config=tiny_target)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("draft.sliding_window 2048 is larger than the target's context (1024 tokens")
    assert str(tiny_target) in message
    recipe.draft.sliding_window = 512
    assert dry_run(recipe, target_config=tiny_target)["method"] == "eagle3"


def fake_run(tiny_target, root, draft_vocab_size: int = 64):
    """A run directory holding what :class:`Eagle3Method` reads at setup: ``data/target.json`` of
    the tiny target and an identity draft vocab of its first ``draft_vocab_size`` ids."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from draftsmith.layout import RunLayout
    from draftsmith.target import TargetInfo

    target = AutoConfig.from_pretrained(tiny_target)
    data = RunLayout(root).data
    data.target_info.parent.mkdir(parents=True)
    TargetInfo(name_or_path=str(tiny_target), path=str(tiny_target), architectures=target.architectures,
               num_hidden_layers=target.num_hidden_layers, hidden_size=target.hidden_size,
               vocab_size=target.vocab_size, aux_layer_ids=[1, 2, 4]).write(data.target_info)
    t2d = torch.arange(target.vocab_size) < draft_vocab_size
    save_file({"d2t": torch.zeros(draft_vocab_size, dtype=torch.long), "t2d": t2d}, str(data.vocab))
    return root


def test_training_setup_checks_the_window_and_keeps_the_targets_context(tiny_target, tmp_path):
    from draftsmith.models.eagle3.training import Eagle3Method

    from helpers.tiny import write_draft_checkpoint

    run = fake_run(tiny_target, tmp_path / "run")
    base = [f"target.name_or_path={tiny_target}", "data.aux_layer_ids=[1, 2, 4]", "data.draft_vocab_size=64"]
    with pytest.raises(ValueError) as caught:
        Eagle3Method(load_recipe(None, base + ["draft.sliding_window=2048"]), run)
    assert "\n" not in str(caught.value)
    assert str(caught.value).startswith("draft.sliding_window 2048 is larger than the target's context (1024 tokens")
    method = Eagle3Method(load_recipe(None, base + ["draft.sliding_window=256"]), run)
    assert (method.config.sliding_window, method.config.max_position_embeddings) == (256, 1024)
    assert method.build_model().layers[0].self_attn.sliding_window == 256
    # a warm start from a draft made for a shorter context is raised to the target's
    short = Eagle3DraftModel(Eagle3Config(**{**method.config.to_dict(), "max_position_embeddings": 512}))
    write_draft_checkpoint(short, tmp_path / "short", "eagle3", {"name_or_path": str(tiny_target)}, ttt_steps=3)
    warm = Eagle3Method(load_recipe(None, base + [f"draft.init_from={tmp_path / 'short'}"]), run)
    assert warm.config.max_position_embeddings == 1024


def test_a_window_shorter_than_the_ttt_unroll_is_refused():
    TTTMask.build(8, 3, torch.device("cpu"), sliding_window=3)  # the last step still sees its own row
    with pytest.raises(ValueError, match="sliding_window=2 is shorter than the TTT steps"):
        TTTMask.build(8, 3, torch.device("cpu"), sliding_window=2)


# ------------------------------------------------------------------------------------------
# The flex backend: the window is a bound in the BlockMask's per-key intervals, evaluated inside
# the kernel only; no (T, (k + 1) T) mask is built per step, and unpacked rows reuse their bucket's


def packed_rows(T: int) -> torch.Tensor:
    """Two rows of contiguous documents, the first ending in padding (-1)."""
    a, b = T // 4, T // 2 + 3
    row0 = [0] * a + [1] * (b - a) + [2] * (T - 3 - b) + [-1] * 3
    row1 = [0] * (T - T // 3) + [1] * (T // 3)
    return torch.tensor([row0, row1])


def tile_sets(block_mask, n_kv_tiles: int):
    """The (partial, full) tiles of a BlockMask as dense ``(B, 1, nq, nk)`` bool, and its query-major
    tables transposed back."""
    from torch.nn.attention.flex_attention import _ordered_to_dense

    def dense(num, idx, n):
        return _ordered_to_dense(num, idx, n).bool()

    nq = block_mask.kv_num_blocks.shape[-1]
    return (dense(block_mask.kv_num_blocks, block_mask.kv_indices, n_kv_tiles),
            dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, n_kv_tiles),
            dense(block_mask.q_num_blocks, block_mask.q_indices, nq).transpose(-1, -2),
            dense(block_mask.full_q_num_blocks, block_mask.full_q_indices, nq).transpose(-1, -2))


@pytest.mark.parametrize("T, bs", [(20, 128), (48, 8), (45, 8)], ids=["one-tile", "aligned", "ragged"])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_flex_block_masks_are_the_rule_and_create_block_masks_tiles(T, bs, window, packed):
    """Every step's mask_mod, evaluated densely, is :func:`allowed`; its full tiles are exactly those
    ``create_block_mask`` finds by evaluating every pair, its partial ones cover the rest (exactly,
    when T is a multiple of the tile), and the query-major tables are the key-major ones transposed."""
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    from draftsmith.models.eagle3.model import ttt_block_masks

    steps, docs = 4, packed_rows(T) if packed else None
    B = 1 if docs is None else docs.shape[0]
    masks = ttt_block_masks(T, steps, torch.device("cpu"), docs, window, block_size=bs)
    assert len(masks) == steps
    for k, bm in enumerate(masks):
        KV, nk = (k + 1) * T, -(-(k + 1) * T // bs)
        dense = create_mask(bm.mask_mod, B, None, T, KV, device="cpu")[:, 0]
        assert torch.equal(dense, allowed(T, k, window, docs)), f"step {k}"
        partial, full, q_partial, q_full = tile_sets(bm, nk)
        assert torch.equal(q_partial, partial) and torch.equal(q_full, full) and not (partial & full).any()
        exact = create_block_mask(bm.mask_mod, B, None, T, KV, device="cpu", BLOCK_SIZE=bs)
        want_partial, want_full, _, _ = tile_sets(exact, nk)
        assert torch.equal(full, want_full), f"step {k}: full tiles differ from create_block_mask's"
        assert not ((want_partial | want_full) & ~(partial | full)).any(), f"step {k}: a needed tile is skipped"
        if T % bs == 0:
            assert torch.equal(partial, want_partial), f"step {k}: extra partial tiles"


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_windowed_flex_attention_over_several_tiles_equals_the_dense_reference(packed):
    """Forward only (flex has no CPU backward in torch 2.13): the flex attention of every TTT step,
    with 8-row tiles over 45 rows (full, partial and skipped tiles, a ragged last one), is the dense
    reference with the window, and the window binds (it differs from the unwindowed reference)."""
    from draftsmith.models.attention import flex_attention
    from draftsmith.models.eagle3.model import ttt_block_masks

    torch.manual_seed(6)
    T, steps, window, hd = 45, 3, 7, 8
    docs = packed_rows(T) if packed else None
    B, nh, nkv = 2, 4, 2
    masks = ttt_block_masks(T, steps, torch.device("cpu"), docs, window, block_size=8)
    q = torch.randn(B, nh, T, hd)
    keys = [torch.randn(B, nkv, T, hd) for _ in range(steps)]
    values = [torch.randn(B, nkv, T, hd) for _ in range(steps)]
    for k in range(steps):
        got = flex_attention(q, torch.cat(keys[:k + 1], 2), torch.cat(values[:k + 1], 2), masks[k], 1 / math.sqrt(hd),
                             enable_gqa=True)
        want = dense_attention(q, keys[:k + 1], values[:k + 1], 1 / math.sqrt(hd), window, docs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(got, dense_attention(q, keys[:k + 1], values[:k + 1], 1 / math.sqrt(hd), None, docs),
                                  atol=1e-3)


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops dispatched under it, views left out, and the largest tensor any of them returned (elements)."""

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


def test_the_flex_window_costs_no_mask_work_per_step():
    """On packed rows (a new mask each batch) the window adds one elementwise op for every step
    together (a bound on the keys' reach); no op of the build makes a tensor of T x T elements (the
    mask is never evaluated pair by pair). Unpacked rows reuse their length bucket's masks: a
    second build dispatches nothing."""
    from draftsmith.models.eagle3.model import ttt_block_masks

    T, steps, window = 512, 7, 200
    docs = packed_rows(T)
    counts = {}
    for w in (None, window):
        ttt_block_masks(T, steps, torch.device("cpu"), docs, w)  # the bucket's constants, once
        with _Ops() as ops:
            ttt_block_masks(T, steps, torch.device("cpu"), docs, w)
        counts[w] = ops.names
        assert ops.largest < T * T, f"window {w}: an op made {ops.largest} elements"
    assert len(counts[window]) - len(counts[None]) == 1
    assert [n for n in counts[window] if n not in counts[None]] == ["aten.minimum.default"]
    first = ttt_block_masks(T, steps, torch.device("cpu"), None, window)
    with _Ops() as ops:
        again = ttt_block_masks(T, steps, torch.device("cpu"), None, window)
    assert again is first and ops.names == []
    with torch.inference_mode():  # inference tensors cannot be saved for backward: never kept
        assert ttt_block_masks(T + 1, steps, torch.device("cpu"), None, window) is not \
            ttt_block_masks(T + 1, steps, torch.device("cpu"), None, window)
