"""Tiny targets, tokenizers and draft checkpoints built in code: no network, no downloads."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A second, structurally different template (Zephyr-like: role tags, eos after each turn,
# system prompt folded in only when present).
ZEPHYR = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '</s>\n' }}"
    "{% elif message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] + '</s>\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n' + message['content'] + '</s>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens and the target verifies them.",
    "def add(a, b):\n    return a + b",
    "Translate to French: good morning, how are you?",
    '{"name": "Ada", "age": 36, "city": "London"}',
    "Summarize: the meeting moved to Tuesday because the room was booked.",
    "Write a haiku about autumn leaves falling on a quiet river.",
    "What is the capital of Italy? The capital of Italy is Rome.",
] * 20


HARMONY_SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>"]
# A harmony-shaped template (gpt-oss): channels, reasoning kept only on the last assistant turn.
HARMONY = (
    "<|start|>system<|message|>You are ChatGPT.<|end|>"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|start|>user<|message|>{{ m['content'] }}<|end|>"
    "{% elif m['role'] == 'assistant' %}"
    "{% if loop.last and m.get('thinking') %}<|start|>assistant<|channel|>analysis<|message|>{{ m['thinking'] }}<|end|>{% endif %}"
    "<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}{% if loop.last %}<|return|>{% else %}<|end|>{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def build_tokenizer(template: str = CHATML, vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on a tiny corpus, with ChatML/Zephyr specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>", "</s>", "<|user|>", "<|assistant|>",
                "<|system|>"] + HARMONY_SPECIALS
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    eos = {CHATML: "<|im_end|>", HARMONY: "<|return|>"}.get(template, "</s>")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token=eos)
    fast.chat_template = template
    return fast


# vLLM engine settings for this CPU machine (VllmConfig's defaults are GPU values): fp32, eager
# (a compiled start takes minutes), 0.2 of the RAM for the KV cache (docs/cpu_lab.md, "Engine settings on a CPU")
CPU_VLLM = {"dtype": "float32", "enforce_eager": True, "gpu_memory_utilization": 0.2, "max_model_len": 2048,
            "max_num_seqs": 32}
CPU_VLLM_FLAGS = ["--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.2",
                  "--max-model-len", "2048", "--max-num-seqs", "32"]


TINY_LAYERS = 6
TINY_AUX = [1, 3, 4]


def build_tiny_target(directory: Path, seed: int = 0, vocab_size: int = 512) -> Path:
    """Save a random tiny Llama target + tokenizer (H=128, 6 layers, head_dim 64) to ``directory``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=TINY_LAYERS,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=1024,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(cfg)
    # Random Llamas repeat one token under greedy decoding; scale up the embedding so the
    # tiny target produces varied text (a harder, more realistic job for the draft).
    # A peaked lm_head gives the target confident next-token distributions, like a trained model.
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(50.0)
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(directory, safe_serialization=True)
    tok.save_pretrained(directory)
    return directory


def write_jsonl(path: Path, rows: list) -> Path:
    with path.open("w") as fh:
        for r in rows:
            fh.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def write_draft_checkpoint(model: torch.nn.Module, directory: Path, method: str, target: dict, **fields) -> dict:
    """Save ``model`` as a training checkpoint export reads (``model.safetensors`` without the
    frozen ``embed_tokens``, plus ``draft_config.json``); returns the saved tensors."""
    from safetensors.torch import save_file

    from draftsmith.layout import DraftCheckpointConfig

    state = {k: v for k, v in model.state_dict().items() if k != "embed_tokens"}
    directory.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    DraftCheckpointConfig(method=method, config=model.config.to_dict(), target=target, **fields).write(directory)
    return state


def dflash_tiny_config(**kw):
    """A tiny DFlash draft geometry (GQA, 2 layers, blocks of 4), overridden by ``kw``."""
    from draftsmith.models.dflash.config import DFlashConfig

    base = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, vocab_size=50, draft_vocab_size=20, aux_layer_ids=[1, 3], block_size=4,
                mask_token_id=7, target_hidden_size=24, num_target_layers=6, rope_theta=500.0)
    base.update(kw)
    return DFlashConfig(**base)


def random_dflash_model(cfg, seed: int = 0, **model_kw):
    """A DFlash draft with random weights everywhere, norms included (ones would hide a norm applied
    in the wrong place), a random target embedding and an identity-prefix vocab map; in eval mode."""
    from draftsmith.models.dflash.model import DFlashDraftModel

    torch.manual_seed(seed)
    model = DFlashDraftModel(cfg, **model_kw)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
        model.init_from_target(torch.randn(cfg.vocab_size, cfg.hidden_size))
        d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        model.set_vocab_mapping(d2t, t2d)
    return model.eval()


@torch.no_grad()
def randomize_norms(model: torch.nn.Module, scale: float = 0.3) -> torch.nn.Module:
    """Every RMSNorm weight of ``model`` (parameters named ``*norm*``) set to ``1 + scale * N(0, 1)``:
    with ones, a norm applied twice or skipped can go unseen (RMSNorm is scale-invariant, so e.g.
    EAGLE-3.1's ``norm_output`` under ``hidden_norm`` changes nothing). Returns ``model``."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1.0 + scale * torch.randn_like(p))
    return model


def random_eagle3_model(cfg, seed: int = 0):
    """An :class:`~draftsmith.models.eagle3.model.Eagle3DraftModel` of ``cfg`` with random weights,
    random norms (:func:`randomize_norms`), a random target embedding and the vocab mapping
    draft id i -> target id 2i (``cfg.vocab_size`` must be at least ``2 * cfg.draft_vocab_size``)."""
    from draftsmith.models.eagle3.model import Eagle3DraftModel

    torch.manual_seed(seed)
    model = Eagle3DraftModel(cfg)
    with torch.no_grad():
        randomize_norms(model)
    model.init_from_target(torch.randn(cfg.vocab_size, cfg.hidden_size))
    model.set_vocab_mapping(torch.arange(cfg.draft_vocab_size), torch.arange(cfg.vocab_size) % 2 == 0)
    return model


def dspark_tiny_config(**kw):
    """A tiny DSpark draft geometry: :func:`dflash_tiny_config`'s plus a rank-6 Markov head and a
    confidence head over ``cat(hidden, Markov embedding)``, overridden by ``kw``."""
    from draftsmith.models.dspark.config import DSparkConfig

    base = dflash_tiny_config().to_dict()
    base.update(markov_rank=6, confidence_head=True, confidence_head_with_markov=True)
    base.update(kw)
    return DSparkConfig(**base)


def random_dspark_model(cfg, seed: int = 0):
    """A DSpark draft with random weights everywhere (:func:`random_dflash_model`'s rule; the
    zero-initialised ``markov_w2`` random too, so the Markov bias is not zero); eval mode."""
    from draftsmith.models.dspark.model import DSparkDraftModel

    torch.manual_seed(seed)
    model = DSparkDraftModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
            elif name.startswith("markov_head."):
                p.normal_(0.0, 1.0)
        model.init_from_target(torch.randn(cfg.vocab_size, cfg.hidden_size))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        model.set_vocab_mapping(torch.zeros(cfg.draft_vocab_size, dtype=torch.long), t2d)
    return model.eval()


def eagle3_tiny_config(**kw):
    """A tiny EAGLE-3 draft geometry (GQA, H=32, V=50 -> 20, aux layers 0-2), overridden by ``kw``."""
    from draftsmith.models.eagle3.config import Eagle3Config

    base = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                vocab_size=50, draft_vocab_size=20, aux_layer_ids=[0, 1, 2], rope_theta=10000.0)
    base.update(kw)
    return Eagle3Config(**base)


def make_records(n, vocab, seed=0):
    """``n`` random tokenized records (5 to 19 tokens below ``vocab``, the first 3 unmasked)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        T = int(torch.randint(5, 20, (1,), generator=g))
        ids = torch.randint(0, vocab, (T,), generator=g).tolist()
        out.append({"id": f"r{i}", "input_ids": ids, "loss_mask": [0] * 3 + [1] * (T - 3)})
    return out


def build_tiny_gpt_oss(directory, head_dim: int = 16, dtype: torch.dtype = torch.float32):
    """A random 6-layer gpt-oss (sliding and full attention, YaRN, 4 experts) saved with a
    ChatML tokenizer, in ``dtype``, without an MXFP4 ``quantization_config``."""
    from transformers import GptOssConfig, GptOssForCausalLM

    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = GptOssConfig(
        vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 3, max_position_embeddings=512,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 128, "truncate": False},
    )
    model = GptOssForCausalLM(cfg).to(dtype)
    model.save_pretrained(directory, safe_serialization=True)
    tok.save_pretrained(directory)
    return directory


def write_fp8_shards(model, directory: Path) -> tuple[Path, int, int]:
    """``(directory, records, hidden size)``: fp8 hidden-state shards of 7 random records of
    ``model`` (3 sequences a shard) written to ``directory``."""
    from draftsmith.data_prep.hidden_states import generate_hidden_states
    from draftsmith.data_prep.shards import ShardSpec

    records = make_records(7, model.config.vocab_size, seed=8)
    generate_hidden_states(model, records, directory, ShardSpec(model.config.hidden_size, TINY_AUX, "float8_e4m3fn"),
                           sequences_per_shard=3, progress=False)
    return directory, len(records), model.config.hidden_size


def masked_text(tok, enc) -> list[str]:
    """The text of each maximal run of loss-masked tokens of a ``tokenize_conversation`` result
    ``enc`` (``input_ids``, ``loss_mask``), decoded by ``tok`` (special tokens kept)."""
    runs, cur = [], []
    for t, m in zip(enc["input_ids"], enc["loss_mask"]):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs + ([tok.decode(cur)] if cur else [])
