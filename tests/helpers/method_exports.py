"""Every built-in method's export, built from a tiny target's config with random weights (no
training): what the release tests hold against the keys and tensor names vLLM reads."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig

from draftsmith.eval.export import export
from draftsmith.methods import get_method
from draftsmith.models.dflash.config import DFlashConfig
from draftsmith.models.dflash2.config import DFlash2Config
from draftsmith.models.dspark.config import DSparkConfig
from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.medusa.model import MedusaConfig
from draftsmith.models.mlp_speculator.model import MLPSpeculatorConfig
from draftsmith.models.peagle.config import PEagleConfig

from helpers.tiny import write_draft_checkpoint

H, V, VD, LAYERS = 32, 64, 48, 6
AUX = [1, 3, 4]
MASK_TOKEN_ID = 5
K = 3


def tiny_target_config(max_position_embeddings: int = 40960) -> LlamaConfig:
    """A 6-layer Llama target (H=32, vocab 64) serving ``max_position_embeddings`` tokens."""
    return LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=LAYERS,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                       max_position_embeddings=max_position_embeddings, tie_word_embeddings=False)


def draft_config(method: str, target: LlamaConfig):
    """``method``'s draft config built from ``target`` as training builds it (``from_target``)."""
    blocks = dict(draft_vocab_size=VD, aux_layer_ids=AUX, num_layers=2, block_size=K + 1, mask_token_id=MASK_TOKEN_ID)
    if method == "eagle3":
        return Eagle3Config.from_target(target, VD, AUX)
    if method == "peagle":
        return PEagleConfig.from_eagle3(Eagle3Config.from_target(target, VD, AUX), num_layers=2, num_depths=K,
                                        mask_token_id=MASK_TOKEN_ID)
    if method == "dflash":
        return DFlashConfig.from_target(target, **blocks)
    if method == "dflash2":  # the candidate selector scores the full vocabulary
        return DFlash2Config.from_target(target, **{**blocks, "draft_vocab_size": V}, conv_kernel_size=2,
                                         conv_group_size=8, selector_rank=4, selector_top_k=3)
    if method == "dspark":
        return DSparkConfig.from_target(target, **blocks, markov_rank=8)
    if method == "medusa":
        return MedusaConfig(hidden_size=H, vocab_size=V, num_heads=K)
    if method == "mlp_speculator":
        return MLPSpeculatorConfig(emb_dim=H, inner_dim=H, vocab_size=V, n_predict=K)
    raise ValueError(f"no tiny draft config for method {method!r}")


def build_export(method: str, where: Path, target: LlamaConfig | None = None, seed: int = 0) -> Path:
    """Export a ``method`` draft with random weights (norms included) for ``target`` (default:
    :func:`tiny_target_config`) to ``where/export``; its checkpoint is ``where/ckpt``."""
    target = target or tiny_target_config()
    spec = get_method(method)
    torch.manual_seed(seed)
    model = spec.model_class(draft_config(method, target))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    if hasattr(model, "set_vocab_mapping"):
        vd = model.config.draft_vocab_size  # the draft vocab: the first vd target ids (d2t offsets 0)
        model.set_vocab_mapping(torch.zeros(vd, dtype=torch.long), torch.arange(V) < vd)
        model.init_from_target(torch.randn(V, H))
    info = {"name_or_path": "tiny-llama", "architectures": ["LlamaForCausalLM"], "hidden_size": H, "vocab_size": V}
    write_draft_checkpoint(model, where / "ckpt", method, info)
    return export(where / "ckpt", where / "export", dtype="float32")
