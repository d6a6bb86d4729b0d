"""Replies cut by ``max_new_tokens``: the in-process vLLM engine (a fake ``LLM``) and the
transformers engine (a tiny model built here) report them, and a regenerated row whose last
reply was cut carries ``"cut": true`` (the server engine: tests/unit/test_regenerate_server.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from draftsmith.data_prep.chat_engines import Reply, TransformersChatEngine, VllmChatEngine
from draftsmith.data_prep.regenerate import regenerate

from helpers.tiny import build_tokenizer

# the prompt is the turns' contents run together, so its last token is the last user turn's end
PLAIN = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def user(q: str) -> dict:
    return {"role": "user", "content": q}


def conversations() -> list[dict]:
    return [{"id": "stops", "messages": [user("Stop!")]},
            {"id": "runs", "messages": [user("Go?")]},
            {"id": "cut first", "messages": [user("Go?"), {"role": "assistant", "content": "x"}, user("Stop!")]},
            {"id": "cut last", "messages": [user("Stop!"), {"role": "assistant", "content": "x"}, user("Go?")]}]


class FakeLLM:
    """``vllm.LLM.chat`` for conversations ending in "Go?" runs to ``max_tokens``, else stops."""

    def chat(self, conversations, params, use_tqdm, chat_template_kwargs=None):
        outs = []
        for c in conversations:
            finish = "length" if c[-1]["content"] == "Go?" else "stop"
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(text=f"to {c[-1]['content']}", finish_reason=finish)]))
        return outs


def test_the_vllm_engine_reports_a_reply_cut_by_max_tokens(tmp_path):
    engine = VllmChatEngine.__new__(VllmChatEngine)  # no vLLM start: only the call it makes
    engine.llm = FakeLLM()
    assert engine.generate([[user("Go?")], [user("Stop!")]], [0.0, 0.0], 8) == [Reply("to Go?", True),
                                                                                 Reply("to Stop!", False)]
    out = regenerate(conversations(), tmp_path / "regen.jsonl", lambda: engine, [0.0], 8, progress=False)
    assert {r["id"]: r.get("cut", False) for r in out} == {"stops": False, "runs": True, "cut first": False,
                                                           "cut last": True}


def tiny_model(tok, stop: int, word: int, repeat: int):
    """A one-layer Llama whose next token depends only on the current one (attention and MLP
    write nothing): ``stop`` -> ``word`` -> end of sequence, anything else -> ``repeat`` forever."""
    from transformers import LlamaConfig, LlamaForCausalLM

    n, eos = len(tok), tok.eos_token_id
    cfg = LlamaConfig(vocab_size=n, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=eos, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in (model.model.layers[0].self_attn.o_proj.weight, model.model.layers[0].mlp.down_proj.weight):
            p.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.zero_()
        emb[:, 0] = 1.0  # every token: "go on with repeat"
        emb[stop], emb[word] = torch.eye(8)[1], torch.eye(8)[2]
        head.zero_()
        head[repeat, 0], head[word, 1], head[eos, 2] = 10.0, 10.0, 10.0
    return model


def test_the_transformers_engine_reports_a_reply_that_filled_max_new_tokens(tmp_path):
    tok = build_tokenizer(PLAIN)
    ids = {s: tok(s, add_special_tokens=False)["input_ids"][-1] for s in ("Stop!", "b", "a")}
    model = tiny_model(tok, stop=ids["Stop!"], word=ids["b"], repeat=ids["a"])
    engine = TransformersChatEngine(model, tok, 0)
    # "Stop!" -> "b", end of sequence (padded while "Go?" goes on): finished; "Go?" -> "a" x 4: cut
    assert engine.generate([[user("Stop!")], [user("Go?")]], [0.0, 0.0], 4) == [Reply("b", False), Reply("aaaa", True)]
    # the end of sequence as the very last allowed token: finished, not cut
    assert engine.generate([[user("Stop!")]], [0.0], 2) == [Reply("b", False)]
    out = regenerate(conversations(), tmp_path / "regen.jsonl", lambda: engine, [0.0], 4, progress=False)
    assert {r["id"]: r.get("cut", False) for r in out} == {"stops": False, "runs": True, "cut first": False,
                                                           "cut last": True}
    assert out[2]["messages"][1]["content"] == "aaaa"  # the earlier cut reply is history, as generated
