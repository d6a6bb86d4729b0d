"""Targets with the rotary embeddings of the recipes' model families (Llama-3.1's llama3 scaling,
gpt-oss's YaRN) in both config spellings, and each method's draft built from them: what the RoPE
tests check in transformers and in vLLM."""

from __future__ import annotations

import torch
from transformers import GptOssConfig, LlamaConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from draftsmith.models.dflash.config import DFlashConfig
from draftsmith.models.dflash.model import DFlashDraftModel
from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.model import Eagle3DraftModel
from draftsmith.models.peagle.config import PEagleConfig
from draftsmith.models.peagle.model import PEagleDraftModel

# Llama-3.1-8B-Instruct's config.json values, and gpt-oss-20b/120b's
LLAMA31_THETA = 500000.0
LLAMA31_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
GPTOSS_THETA = 150000.0
GPTOSS_SCALING = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                  "original_max_position_embeddings": 4096}
HEAD_DIM = 64  # both families' real head_dim for Llama-3.1 is 128; 64 is gpt-oss's: enough frequencies
GEOMETRY = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD_DIM,
                intermediate_size=64, num_hidden_layers=4, vocab_size=96, max_position_embeddings=131072)


def llama31_target(spelling: str) -> LlamaConfig:
    """A Llama-3.1-style target: the Hub config.json spelling (``rope_theta`` + ``rope_scaling``,
    what every transformers reads) or transformers 5's ``rope_parameters``."""
    if spelling == "rope_scaling":
        return LlamaConfig.from_dict(dict(GEOMETRY, rope_theta=LLAMA31_THETA, rope_scaling=dict(LLAMA31_SCALING)))
    return LlamaConfig(**GEOMETRY, rope_parameters=dict(LLAMA31_SCALING, rope_theta=LLAMA31_THETA))


def gptoss_target(spelling: str) -> GptOssConfig:
    kw = dict(GEOMETRY, num_local_experts=2, num_experts_per_tok=1)
    if spelling == "rope_scaling":
        return GptOssConfig.from_dict(dict(kw, rope_theta=GPTOSS_THETA, rope_scaling=dict(GPTOSS_SCALING)))
    return GptOssConfig(**kw, rope_parameters=dict(GPTOSS_SCALING, rope_theta=GPTOSS_THETA))


TARGETS = {"llama3": (llama31_target, LlamaRotaryEmbedding), "yarn": (gptoss_target, GptOssRotaryEmbedding)}
AUX = [1, 2, 3]
DRAFT_VOCAB = 32
MASK_ID = 5


def build_draft(method: str, target_config) -> torch.nn.Module:
    """The draft each method's trainer builds from a target config (train/method_*.py)."""
    if method == "eagle3":
        return Eagle3DraftModel(Eagle3Config.from_target(target_config, DRAFT_VOCAB, AUX))
    if method == "dflash":
        return DFlashDraftModel(DFlashConfig.from_target(target_config, DRAFT_VOCAB, AUX, num_layers=1,
                                                         block_size=4, mask_token_id=MASK_ID))
    base = Eagle3Config.from_target(target_config, DRAFT_VOCAB, AUX, norm_before_residual=False)
    return PEagleDraftModel(PEagleConfig.from_eagle3(base, num_layers=1, num_depths=2, mask_token_id=MASK_ID))


def exported_config(model: torch.nn.Module) -> dict:
    """The ``config.json`` the method's exporter writes (speculators format)."""
    return model.config.to_speculators({"name_or_path": "t", "architectures": []}, 1, "float32", "0.3.0", {})
