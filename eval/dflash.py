"""Export, load and propose with DFlash drafts (``{"method": "dflash"}`` in vLLM 0.32).

    python -m draftsmith.eval.export RUN_DIR/checkpoints/step-N OUT_DIR   # dispatches here

Format A (speculators, what :func:`export_dflash` writes) and Format B (z-lab / ModelOpt
``DFlashDraftModel`` with ``dflash_config``, read by :func:`load_dflash`) are described in
docs/formats.md ("DFlash") and :class:`~draftsmith.models.dflash.config.DFlashConfig`.

vLLM's DFlash ``load_weights`` is not strict: a tensor missing from ``model.safetensors`` is
left at its random / ones init without any error. :func:`export_dflash` therefore checks the
written tensor set against :func:`expected_dflash_weights`, name by name and shape by shape.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .. import __version__
from ..models.dflash.config import DFlashConfig
from ..models.dflash.model import DFlashDraftModel, DFlashKVCache
from .export import SPECULATORS_VERSION, ExportError, check_tensor_set, read_method_checkpoint
from .spec_decode import DraftLoadError, Proposal, Proposer, _read_config, read_export, to_target_vocab


def expected_dflash_weights(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a DFlash export holds, with its shape (docs/formats.md, "DFlash").

    ``lm_head.weight [Vd, H]`` is always shipped (the trained head; with Vd = V vLLM keeps it
    when it differs from the target's). ``d2t [Vd]`` and ``t2d [V]`` only when Vd < V: with a
    full vocab vLLM has no ``draft_id_to_target_id`` parameter to load ``d2t`` into. Never
    ``mask_hidden`` (vLLM asserts) and no ``embed_tokens`` (the target's is shared).
    """
    H, Ht, nh, nkv, hd, I = (cfg.hidden_size, cfg.target_hidden_size, cfg.num_attention_heads,
                             cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size)
    out: dict[str, tuple[int, ...]] = {"fc.weight": (H, len(cfg.aux_layer_ids) * Ht), "hidden_norm.weight": (H,)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        out.update({
            f"{p}input_layernorm.weight": (H,),
            f"{p}self_attn.q_proj.weight": (nh * hd, H),
            f"{p}self_attn.k_proj.weight": (nkv * hd, H),
            f"{p}self_attn.v_proj.weight": (nkv * hd, H),
            f"{p}self_attn.o_proj.weight": (H, nh * hd),
            f"{p}self_attn.q_norm.weight": (hd,),
            f"{p}self_attn.k_norm.weight": (hd,),
            f"{p}post_attention_layernorm.weight": (H,),
            f"{p}mlp.gate_proj.weight": (I, H),
            f"{p}mlp.up_proj.weight": (I, H),
            f"{p}mlp.down_proj.weight": (H, I),
        })
        if cfg.attention_bias:
            out.update({f"{p}self_attn.q_proj.bias": (nh * hd,), f"{p}self_attn.k_proj.bias": (nkv * hd,),
                        f"{p}self_attn.v_proj.bias": (nkv * hd,), f"{p}self_attn.o_proj.bias": (H,)})
    out.update({"norm.weight": (H,), "lm_head.weight": (cfg.draft_vocab_size, H)})
    if cfg.draft_vocab_size < cfg.vocab_size:
        out.update({"d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,)})
    return out


def check_dflash_tensors(tensors: dict[str, torch.Tensor], cfg: DFlashConfig, where: str) -> None:
    """:func:`~draftsmith.eval.export.check_tensor_set` against :func:`expected_dflash_weights`."""
    check_tensor_set(tensors, expected_dflash_weights(cfg), where, "DFlash")


def read_dflash_checkpoint(ckpt: Path) -> tuple[Any, DFlashConfig, dict[str, torch.Tensor]]:
    """``(draft_config.json, config, exportable tensors)`` of a DFlash training checkpoint.

    Raises:
        ExportError: missing files, another method, an invalid config, or tensors that do not
            match :func:`expected_dflash_weights`.
    """
    meta, cfg, state = read_method_checkpoint(ckpt, "dflash", DFlashConfig)
    want = expected_dflash_weights(cfg)
    # the checkpoint always carries the vocab buffers; with a full vocab vLLM takes neither
    state = {k: v for k, v in state.items() if k in want or k not in ("d2t", "t2d")}
    check_dflash_tensors(state, cfg, str(ckpt / "model.safetensors"))
    return meta, cfg, state


def export_dflash(ckpt: Path, out: Path, dtype: str = "float32", num_speculative_tokens: int | None = None) -> Path:
    """Write the vLLM-loadable DFlash draft (Format A, speculators) of checkpoint ``ckpt`` to
    ``out`` (created); returns ``out``.

    Args:
        ckpt: training checkpoint directory (``checkpoints/step-N``).
        dtype: storage dtype of the floating-point weights.
        num_speculative_tokens: K written as the default proposal length; None or
            ``block_size - 1``. Anything else is refused: vLLM would feed the draft a block of a
            length it was never trained on (bidirectional attention over the whole block), an
            untested train/serve mismatch. A smaller K can still be passed to vLLM at serve time.

    Raises:
        ExportError: see :func:`read_dflash_checkpoint`; ``num_speculative_tokens`` other than
            ``block_size - 1``; a written tensor set that differs from the expected one.
    """
    meta, cfg, state = read_dflash_checkpoint(ckpt)
    K = cfg.block_size - 1
    if num_speculative_tokens is not None and num_speculative_tokens != K:
        raise ExportError(f"num_speculative_tokens={num_speculative_tokens}: this draft was trained with "
                          f"block_size={cfg.block_size}, so its exports propose {K} tokens (serve a smaller K "
                          "through vLLM's speculative_config if needed, or retrain with draft.block_size=K+1)")
    torch_dtype = getattr(torch, dtype)
    tensors = {k: (v.to(torch_dtype) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    out.mkdir(parents=True, exist_ok=True)
    weights = out / "model.safetensors"
    save_file(tensors, str(weights), metadata={"format": "pt"})
    check_dflash_tensors(load_file(str(weights)), cfg, str(weights))  # what vLLM will read, read back
    target = meta.target
    verifier = {"name_or_path": target.get("verifier", target["name_or_path"]),
                "architectures": target.get("architectures", [])}
    config = cfg.to_speculators(verifier, K, dtype, SPECULATORS_VERSION,
                                {"version": __version__, "target_path": target.get("path")})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def is_dflash_export(config: dict[str, Any]) -> bool:
    """True for the ``config.json`` of a DFlash draft (Format A or B)."""
    return config.get("speculators_model_type") == "dflash" or "dflash_config" in config


def load_dflash(path: Path, embed_tokens: torch.Tensor | None = None,
                lm_head: torch.Tensor | None = None) -> DFlashDraftModel:
    """A DFlash draft from an export folder (Format A or B), float32, eval mode.

    Args:
        embed_tokens: the target's input embedding ``[V, H]``, used when the export has none
            (vLLM shares the target's embedding the same way); None with no embedding in the
            export leaves a zero embedding (enough to inspect weights, not to propose).
        lm_head: the target's ``lm_head [V, H]``, used when a full-vocab export (Format B) ships
            none: vLLM then shares the target's head.

    Raises:
        DraftLoadError: not a DFlash config, missing keys, missing / unexpected / mis-shaped tensors.
    """
    path = Path(path)
    cfg, state, weights = read_export(path, DFlashConfig.from_export)
    embed = state.pop("embed_tokens.weight", embed_tokens)
    if "lm_head.weight" not in state and lm_head is not None and cfg.draft_vocab_size == cfg.vocab_size:
        state["lm_head.weight"] = lm_head.float()
    try:
        check_dflash_tensors(state, cfg, str(weights))
    except ExportError as exc:
        raise DraftLoadError(str(exc)) from None
    model = DFlashDraftModel(cfg)
    if cfg.draft_vocab_size == cfg.vocab_size:  # identity mapping
        state.update(d2t=torch.zeros(cfg.vocab_size, dtype=torch.long),
                     t2d=torch.ones(cfg.vocab_size, dtype=torch.bool))
    model.load_state_dict(state, strict=False)
    if embed is not None:
        try:
            model.init_from_target(embed.float())
        except ValueError as exc:
            raise DraftLoadError(f"{path}: {exc}") from exc
    return model.eval().requires_grad_(False)


class DFlashProposer(Proposer):
    """DFlash block drafting, as vLLM runs it: each proposal appends the context keys / values
    of the newly committed positions to the draft cache, then ONE draft forward over
    ``[pending token, M * k]`` at positions ``P..P+k`` proposes all k tokens (the argmax of
    each mask slot at T=0, a sample of ``softmax(logits / T)`` at T>0: the slots are
    independent given the block, as in vLLM's parallel drafting)."""

    def __init__(self, model: DFlashDraftModel):
        self.model = model
        self.aux_layer_ids = list(model.config.aux_layer_ids)
        self.max_k = model.config.block_size - 1
        self.reset()

    def reset(self) -> None:
        self.cache = DFlashKVCache()

    @torch.no_grad()
    def propose(self, states: torch.Tensor, next_tokens: torch.Tensor, k: int, temperature: float,
                generator: torch.Generator | None) -> Proposal:
        """See :meth:`Proposer.propose`.

        Raises:
            ValueError: ``k`` > ``block_size - 1`` (names the trained block size).
        """
        m = self.model
        if k > self.max_k:
            raise ValueError(f"k={k}: this DFlash draft was trained with block_size={m.config.block_size} and "
                             f"proposes at most {self.max_k} tokens per block")
        device, dtype = m.fc.weight.device, m.fc.weight.dtype
        start, n = len(self.cache), states.shape[0]
        m.append_context(self.cache, states.to(device, dtype), torch.arange(start, start + n, device=device))
        logits = m.propose_block(self.cache, int(next_tokens[-1]), start + n, k)  # (k, Vd)
        proposal = self._chain(lambda i, prev: logits[i], k, temperature, generator)
        return to_target_vocab(proposal, m.d2t, m.config.vocab_size)


def dflash_proposer(path: Path, target_model: Any | None = None) -> DFlashProposer:
    """The proposer of a DFlash export, sharing ``target_model``'s input embedding (and its
    ``lm_head`` when the export ships none and the vocab is full).

    Raises:
        DraftLoadError: see :func:`load_dflash`; aux layer ids out of range for the target.
    """
    from ..data_prep.capture import decoder_layers

    embed = head = None
    if target_model is not None:
        embed = target_model.get_input_embeddings().weight.detach()
        head = target_model.get_output_embeddings().weight.detach()
    model = load_dflash(path, embed, head)
    if target_model is not None:
        n_layers = len(decoder_layers(target_model))
        if not all(1 <= L < n_layers for L in model.config.aux_layer_ids):
            raise DraftLoadError(f"{path / 'config.json'}: aux layer ids {model.config.aux_layer_ids} out of "
                                 f"range for a target with {n_layers} decoder layers")
    return DFlashProposer(model)


def check_dflash_matches_target(export_dir: Path, target_dir: Path) -> dict[str, Any]:
    """Refuse a DFlash export made for another target.

    Raises:
        DraftMismatchError: hidden size, vocab size, draft vocab larger than the target's,
            verifier architecture, or aux layer ids out of range for the target's layers.
        DraftLoadError: the config is no DFlash config.
    """
    from transformers import AutoConfig

    from .acceptance import DraftMismatchError, target_fit_problems

    export_dir = Path(export_dir)
    raw = _read_config(export_dir)
    try:
        cfg = DFlashConfig.from_export(raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise DraftLoadError(f"{export_dir / 'config.json'}: {exc}") from None
    tcfg = AutoConfig.from_pretrained(target_dir)
    text = getattr(tcfg, "text_config", None) or tcfg
    problems = target_fit_problems(
        tcfg, export_dir, hidden_size=cfg.hidden_size, target_hidden_size=cfg.target_hidden_size,
        vocab_size=cfg.vocab_size, draft_vocab_size=cfg.draft_vocab_size,
        verifier=(raw.get("speculators_config") or {}).get("verifier") or {})
    if not all(1 <= i < text.num_hidden_layers for i in cfg.aux_layer_ids):
        problems.append(f"aux layer ids {cfg.aux_layer_ids} out of range for {text.num_hidden_layers} target layers")
    if problems:
        raise DraftMismatchError(f"{export_dir} does not match target {target_dir}: " + "; ".join(problems))
    return raw
