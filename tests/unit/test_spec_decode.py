"""Reference speculative decoder (eval/spec_decode.py): lossless at T=0 and T>0 for every
draft type, the EAGLE-3 draft KV cache equals the TTT forward, counters add up, exported
drafts load."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.target import load_target
from draftsmith.eval.acceptance import summarise
from draftsmith.cli.spec_decode import main
from draftsmith.eval.export import export
from draftsmith.models.eagle3.proposer import Eagle3Proposer
from draftsmith.models.medusa.proposer import MedusaProposer
from draftsmith.models.mlp_speculator.proposer import MLPSpeculatorProposer
from draftsmith.eval.spec_decode import (
    DraftLoadError,
    Proposal,
    SpecCounters,
    Target,
    load_draft,
    plain_generate,
    speculative_generate,
    stop_token_ids,
    verify,
)
from draftsmith.layout import DraftCheckpointConfig
from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.model import Eagle3DraftModel
from draftsmith.models.medusa.model import MedusaConfig, MedusaModel
from draftsmith.models.mlp_speculator.model import MLPSpeculator, MLPSpeculatorConfig

from helpers.tiny import TINY_AUX, randomize_norms
from helpers.drafts import draft_vocab, make_eagle3, random_proposer, strengthen_attention

DRAFT_TYPES = ["eagle3", "medusa", "mlp_speculator"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny matmuls on a shared 2-core machine: with 2 OpenMP threads each op waits for a
    # busy core (measured ~200x slower under load), one thread never does.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# --------------------------------------------------------------------------------------
# Drafts and targets built in code


@pytest.fixture(scope="module")
def tiny(tiny_target):
    model, tok = load_target(tiny_target)
    strengthen_attention(model)
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False)
               for c in ("What is the capital of Italy?", "def add(a, b):", "Write a haiku about autumn.")]
    return model, [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]


def bigram_target(vocab_size: int = 64, hidden_size: int = 64, seed: int = 0) -> tuple[LlamaForCausalLM, torch.Tensor]:
    """A Llama whose greedy next token is ``f(current token)`` for a random permutation f.

    Attention and MLP outputs are zeroed, so every residual stream (every aux hidden state)
    at t is ``emb(x_t)`` and the final hidden state is ``n_t = rmsnorm(emb(x_t))``; the
    lm_head row of token j is ``n[f^-1(j)]``, so the argmax is ``f(x_t)`` (random unit-RMS
    vectors in 64 dims: self dot 64 vs ~N(0, 64) for others). Returns ``(model, f)``.
    """
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    f = torch.randperm(vocab_size)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight.normal_()
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.copy_(0.5 * rmsnorm(emb)[inverse(f)])
    return model, f


def rmsnorm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(len(perm))
    return inv


def power(perm: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.arange(len(perm))
    for _ in range(abs(n)):
        out = perm[out] if n > 0 else inverse(perm)[out]
    return out


def accurate_proposer(kind: str, model, f: torch.Tensor):
    """Drafts that know the bigram target's f (see :func:`bigram_target`).

    - EAGLE-3: ``fc`` passes ``emb(x_t)`` through, attention and MLP add nothing, so every
      step outputs ``n_t``; lm_head rows ``n[f^-2(j)]`` make step 0 predict ``f(f(x_t)) =
      x_{t+2}`` (right) and the chained steps repeat it (wrong): per position ~ 1, 0, 0.
      The draft vocab is a permutation of the target vocab (non-trivial ``d2t``).
    - Medusa: identity ResBlocks; head k's rows ``n[f^-(k+2)(j)]`` predict ``x_{t+k+2}``;
      heads 0 and 1 are right, head 2 is random: per position ~ 1, 1, 0.
    - MLP speculator: no state projection, so stage i sees only ``emb[i](x_{t+1+i})``; its
      head rows are the stage features of ``f^-1(j)``: every stage predicts
      ``f(previous token)``, all right: per position 1, 1, 1 (bonus token path).
    """
    V, H = model.config.vocab_size, model.config.hidden_size
    n = rmsnorm(model.model.embed_tokens.weight.detach())  # (V, H)
    with torch.no_grad():
        if kind == "eagle3":
            draft = Eagle3DraftModel(Eagle3Config.from_target(model.config, V, [0, 1, 2]))
            draft.init_from_target(model.get_input_embeddings().weight.detach())
            perm = torch.randperm(V, generator=torch.Generator().manual_seed(1))  # draft i -> target perm[i]
            draft.set_vocab_mapping(perm - torch.arange(V), torch.ones(V, dtype=torch.bool))
            draft.fc.weight.zero_()
            draft.fc.weight[:, :H].copy_(torch.eye(H))
            draft.layers[0].self_attn.o_proj.weight.zero_()
            draft.layers[0].mlp.down_proj.weight.zero_()
            draft.lm_head.weight.copy_(n[power(f, -2)[perm]])
            return Eagle3Proposer(draft.eval())
        if kind == "medusa":
            medusa = MedusaModel(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=3))
            for k in range(2):
                medusa.lm_heads[k].weight.copy_(n[power(f, -(k + 2))])
            return MedusaProposer(medusa.eval())
        mlp = MLPSpeculator(MLPSpeculatorConfig(emb_dim=H, inner_dim=H, vocab_size=V, n_predict=3))
        for i in range(3):
            mlp.proj[i].weight.zero_()
            features, _ = mlp.stage(i, torch.zeros(1, V, H), torch.arange(V)[None])  # (1, V, H)
            mlp.head[i].weight.copy_(features[0][inverse(f)])
        return MLPSpeculatorProposer(mlp.eval())


# --------------------------------------------------------------------------------------
# Verification rule


def test_greedy_verification_keeps_the_matching_prefix_and_appends_the_target_token():
    logits = torch.full((4, 10), -1.0)
    logits[torch.arange(4), torch.tensor([5, 7, 9, 2])] = 1.0  # target argmax after x_m, d_1, d_2, d_3
    assert verify(Proposal(torch.tensor([5, 7, 1])), logits, 0.0, None) == (2, 9)
    assert verify(Proposal(torch.tensor([5, 7, 9])), logits, 0.0, None) == (3, 2)  # bonus token
    assert verify(Proposal(torch.tensor([4, 7, 9])), logits, 0.0, None) == (0, 5)


def test_rejection_sampling_accepts_a_draft_equal_to_the_target_and_never_emits_impossible_tokens():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 10, generator=gen)
    logits[3, 9] = 100.0  # after d_3 the target is sure of token 9
    p = torch.softmax(logits, -1)
    for _ in range(50):  # q == p: min(1, p/q) = 1 for every draft; the bonus comes from row K
        assert verify(Proposal(torch.tensor([1, 2, 3]), p[:3].clone()), logits, 1.0, gen) == (3, 9)
    logits[0, 4] = -float("inf")  # the target can never produce token 4 after x_m
    q = torch.zeros(3, 10)
    q[:, 4] = 1.0
    for _ in range(50):
        n, nxt = verify(Proposal(torch.tensor([4, 4, 4]), q), logits, 1.0, gen)
        assert n == 0 and nxt != 4


# --------------------------------------------------------------------------------------
# EAGLE-3 draft KV cache


@pytest.mark.parametrize("eagle31", [{}, dict(norm_before_fc=True, fc_norm=True, norm_output=True)],
                         ids=["eagle3", "eagle31"])
def test_eagle3_cached_proposals_equal_the_ttt_forward_across_rounds(eagle31):
    # with EAGLE-3.1's norm_output each chained step reads the post-norm hidden, as TTT step k does
    torch.manual_seed(0)
    cfg = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, vocab_size=50, draft_vocab_size=20, aux_layer_ids=[0, 1, 2], **eagle31)
    draft = randomize_norms(Eagle3DraftModel(cfg)) if eagle31 else Eagle3DraftModel(cfg)
    draft.init_from_target(torch.randn(50, 32))
    draft.set_vocab_mapping(*draft_vocab(50, 20, seed=0))
    draft.eval()
    T, K = 16, 3
    x = torch.randint(0, 50, (T,))
    aux = torch.randn(T, 96)
    proposer = Eagle3Proposer(draft)
    gen = torch.Generator().manual_seed(0)
    committed = 0
    for m in (7, 9, 13):  # three rounds: commit up to position m-1, pending token x_m
        proposal = proposer.propose(aux[committed:m], x[committed + 1 : m + 1], K, 1.0, gen)
        committed = m
        # TTT step k at position m-1 reads x_{m+k}: x_m, then the drafted d_1..d_{K-1}
        ids = torch.cat([x[: m + 1], proposal.token_ids[: K - 1]])
        padded_aux = torch.cat([aux[:m], torch.zeros(K, 96)])  # later positions never reach m-1
        with torch.no_grad():
            ttt = draft(ids[None], padded_aux[None], ttt_steps=K)
        for k in range(K):
            q = torch.zeros(50)
            q[torch.arange(20) + draft.d2t] = torch.softmax(ttt[k][0, m - 1], -1)
            torch.testing.assert_close(proposal.probs[k], q, atol=1e-5, rtol=1e-4)
    assert [len(c) for c in proposer.caches] == [13]  # only step-0 keys of committed positions are kept


# --------------------------------------------------------------------------------------
# Lossless decoding


def test_plain_decoding_equals_transformers_generate(tiny):
    model, prompts = tiny
    for prompt in prompts:
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):].tolist()
        assert plain_generate(Target(model), prompt, 0.0, 20, stop_token_ids(model, None)) == ref


@pytest.mark.parametrize("kind", DRAFT_TYPES)
def test_greedy_output_equals_plain_decoding_with_a_random_draft(tiny, kind):
    model, prompts = tiny
    proposer = random_proposer(kind, model, TINY_AUX, draft_vocab_size=200)
    target = Target(model, proposer.aux_layer_ids)
    counters = SpecCounters(3)
    for prompt in prompts:
        spec = speculative_generate(target, proposer, prompt, k=3, max_new_tokens=24, counters=counters)
        assert spec == plain_generate(Target(model), prompt, max_new_tokens=24)
        assert len(spec) == 24
    assert counters.drafts > 0


@pytest.mark.parametrize("kind,expected_per_pos", [
    ("eagle3", [1.0, 0.0, 0.0]), ("medusa", [1.0, 1.0, 0.0]), ("mlp_speculator", [1.0, 1.0, 1.0])])
def test_greedy_output_equals_plain_decoding_with_an_accurate_draft(kind, expected_per_pos):
    model, f = bigram_target()
    prompts = [[3, 17, 42], [8], [60, 1, 2, 3, 4]]
    chain = [int(f[42])]
    for _ in range(4):
        chain.append(int(f[chain[-1]]))
    assert plain_generate(Target(model), prompts[0], max_new_tokens=5) == chain  # the target is the bigram f
    proposer = accurate_proposer(kind, model, f)
    target = Target(model, proposer.aux_layer_ids)
    counters = SpecCounters(3)
    for prompt in prompts:
        spec = speculative_generate(target, proposer, prompt, k=3, max_new_tokens=40, counters=counters)
        assert spec == plain_generate(Target(model), prompt, max_new_tokens=40)
    figures = summarise(counters.as_dict(), 3)
    assert figures["per_position_acceptance"] == pytest.approx(expected_per_pos, abs=0.1)
    if kind == "mlp_speculator":  # every round accepted all K and added the bonus token
        assert figures["mean_acceptance_length"] == 4.0


# --------------------------------------------------------------------------------------
# Counters


def test_counters_count_drafts_tokens_and_accepted_per_position():
    c = SpecCounters(3)
    for n in (3, 0, 1, 2):
        c.record(n)
    assert c.as_dict() == {"drafts": 4, "draft_tokens": 12, "accepted_tokens": 6, "per_pos": [3, 2, 1]}
    figures = summarise(c.as_dict(), 3)
    assert figures["mean_acceptance_length"] == pytest.approx(1 + 6 / 4)
    assert figures["acceptance_rate"] == pytest.approx(6 / 12)
    assert figures["per_position_acceptance"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])


def test_counters_of_a_run_are_consistent_with_its_output():
    model, f = bigram_target()
    proposer = accurate_proposer("medusa", model, f)
    counters = SpecCounters(3)
    out = speculative_generate(Target(model), proposer, [5, 9], k=3, max_new_tokens=30, counters=counters)
    c = counters.as_dict()
    assert sum(c["per_pos"]) == c["accepted_tokens"] and c["draft_tokens"] == 3 * c["drafts"]
    assert c["per_pos"] == sorted(c["per_pos"], reverse=True)  # position i+1 needs position i accepted
    # first token from the prefill, then (accepted + 1) per round; the last round may overshoot
    produced = 1 + c["accepted_tokens"] + c["drafts"]
    assert produced >= len(out) == 30 and produced - 30 <= 3


# --------------------------------------------------------------------------------------
# Loading exported drafts


def _checkpoint(tmp_path, method: str, config: dict, state: dict, target: dict):
    ckpt = tmp_path / f"ckpt_{method}"
    ckpt.mkdir()
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(ckpt / "model.safetensors"))
    DraftCheckpointConfig(method=method, config=config, target=target).write(ckpt)
    return ckpt


@pytest.mark.parametrize("kind", ["eagle3", "eagle3_legacy", "medusa", "mlp_speculator"])
def test_exported_draft_loads_and_proposes_like_the_trained_one(tiny, tmp_path, kind):
    model, prompts = tiny
    H, V = model.config.hidden_size, model.config.vocab_size
    target = {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"], "hidden_size": H, "vocab_size": V}
    base = "eagle3" if kind.startswith("eagle3") else kind
    proposer = random_proposer(base, model, TINY_AUX, draft_vocab_size=200, seed=3)
    state = proposer.model.state_dict()
    ckpt = _checkpoint(tmp_path, base, proposer.model.config.to_dict(), state, target)
    out = tmp_path / "export"
    if base == "eagle3":
        export(ckpt, out, legacy=kind == "eagle3_legacy")
    else:
        export(ckpt, out)
    loaded = load_draft(out, model)
    assert type(loaded) is type(proposer)
    for name, tensor in loaded.model.state_dict().items():
        torch.testing.assert_close(tensor, state[name], msg=f"{name} differs after export + load")
    gen_a, gen_b = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    a = speculative_generate(Target(model, proposer.aux_layer_ids), proposer, prompts[0], 3, 1.0, 12, None, gen_a)
    b = speculative_generate(Target(model, loaded.aux_layer_ids), loaded, prompts[0], 3, 1.0, 12, None, gen_b)
    assert a == b


def test_a_draft_that_does_not_fit_is_refused_with_the_reason(tiny, tmp_path):
    model, _ = tiny
    draft = make_eagle3(model, 200, TINY_AUX)
    meta_target = {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}
    ckpt = _checkpoint(tmp_path, "eagle3", draft.config.to_dict(), draft.state_dict(), meta_target)
    out = export(ckpt, tmp_path / "export")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(out / "model.safetensors"))
    del tensors["norm.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(DraftLoadError, match="norm.weight"):
        load_draft(out, model)
    config = json.loads((out / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [1, 3, 6]  # the tiny target has 6 layers: 0..5
    (out / "config.json").write_text(json.dumps(config))
    save_file(load_file(str(tmp_path / "ckpt_eagle3" / "model.safetensors")), str(out / "model.safetensors"))
    with pytest.raises(DraftLoadError, match=r"aux layer ids \[1, 3, 6\] out of range"):
        load_draft(out, model)
    (out / "config.json").write_text(json.dumps({"architectures": ["Something"]}))
    with pytest.raises(DraftLoadError, match="unknown draft format"):
        load_draft(out, model)


def test_cli_writes_acceptance_and_speed_figures(tiny_target, tmp_path):
    model, _ = load_target(tiny_target)
    draft = make_eagle3(model, 200, TINY_AUX)
    ckpt = _checkpoint(tmp_path, "eagle3", draft.config.to_dict(), draft.state_dict(),
                       {"name_or_path": str(tiny_target), "architectures": ["LlamaForCausalLM"]})
    out = export(ckpt, tmp_path / "export")
    result = tmp_path / "result.json"
    assert main(["--target", str(tiny_target), "--draft", str(out), "--prompts", "builtin:eval",
                 "--max-prompts", "2", "--max-new-tokens", "16", "--k", "2", "--out", str(result)]) == 0
    r = json.loads(result.read_text())["reference"]
    assert r["num_prompts"] == 2 and r["identical_to_plain"] == 2
    assert r["num_draft_tokens"] == 2 * r["num_drafts"] and len(r["per_position_acceptance"]) == 2
    assert r["output_tokens"] == r["plain_output_tokens"] and r["speedup"] > 0
