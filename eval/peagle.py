"""Export, load and propose with P-EAGLE drafts (docs/formats.md, "P-EAGLE"; docs/parallel_drafts.md).

    draftsmith export RUN_DIR/checkpoints/step-N --out RUN_DIR/export/peagle

The export is the speculators ``peagle`` format vLLM 0.32 reads (``update_peagle`` hook ->
``PeagleLlamaForCausalLM`` = ``llama_eagle3.Eagle3LlamaForCausalLM``) and serves with
``{"method": "eagle3", "parallel_drafting": true, "num_speculative_tokens": K}``, K <= the
trained ``num_depths``:

- ``config.json``: ``speculators_model_type "peagle"``, ``mask_token_id`` (vLLM's
  ``pard_token``), ``norm_before_residual`` (always written; absent means False for peagle),
  ``norm_before_fc``, ``eagle_aux_hidden_state_layer_ids``, a ``num_layers``-layer
  ``transformer_layer_config``;
- ``model.safetensors``: exactly :func:`expected_peagle_weights` (vLLM's draft loader is not
  strict: a missing tensor would stay uninitialised, so the exporter refuses any other set).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .. import __version__
from ..models.eagle3.model import Eagle3KVCache
from ..models.peagle.config import PEagleConfig
from ..models.peagle.model import PEagleDraftModel
from .export import (SPECULATORS_VERSION, ExportError, check_tensor_set, expected_weight_shapes,
                     read_method_checkpoint)
from .spec_decode import DraftLoadError, Proposal, Proposer, read_export, to_target_vocab


def expected_peagle_weights(cfg: PEagleConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a P-EAGLE export holds, with its shape (docs/formats.md, "P-EAGLE").

    ``fc [H, 3Ht]``, ``mask_hidden [1, 1, 3Ht]`` (raw aux space), ``layers.0.*`` as EAGLE-3's
    layer (2H q/k/v inputs, ``hidden_norm``), ``layers.i>=1.*`` plain Llama blocks (H inputs, no
    ``hidden_norm``), ``norm``, ``lm_head [Vd, H]``, ``d2t [Vd]``, ``t2d [V]``, and
    ``embed_tokens.weight [V, H]`` iff the embeddings were trained. (No ``input_norm`` /
    ``fc_norm``: this draft uses neither.)
    """
    H, Ht = cfg.hidden_size, cfg.target_hidden_size
    out = dict(expected_weight_shapes(cfg, "layers.0."))
    out["mask_hidden"] = (1, 1, 3 * Ht)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for i in range(1, cfg.num_layers):
        layer = {k.replace("layers.0.", f"layers.{i}."): v for k, v in expected_weight_shapes(cfg, "layers.0.").items()
                 if k.startswith("layers.0.") and "hidden_norm" not in k}
        layer[f"layers.{i}.self_attn.q_proj.weight"] = (q, H)
        layer[f"layers.{i}.self_attn.k_proj.weight"] = (kv, H)
        layer[f"layers.{i}.self_attn.v_proj.weight"] = (kv, H)
        out.update(layer)
    if cfg.train_embeddings:
        out["embed_tokens.weight"] = (cfg.vocab_size, H)
    return out


def _checkpoint_tensors(cfg: PEagleConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Training-checkpoint names -> export names (``mask_hidden`` reshaped, ``embed_tokens``
    renamed); frozen buffers never reach the checkpoint."""
    out = {}
    for k, v in state.items():
        k = k.removeprefix("module.")
        if k == "mask_hidden":
            v = v.reshape(1, 1, -1)
        elif k == "embed_tokens":
            k = "embed_tokens.weight"
        out[k] = v
    return out


def read_peagle_checkpoint(ckpt: Path) -> tuple[Any, PEagleConfig, dict[str, torch.Tensor]]:
    """``(draft_config, PEagleConfig, export tensors)`` of a training checkpoint.

    Raises:
        ExportError: files missing, another method, an invalid config, or a tensor set other
            than :func:`expected_peagle_weights`.
    """
    meta, cfg, state = read_method_checkpoint(ckpt, "peagle", PEagleConfig)
    tensors = _checkpoint_tensors(cfg, state)
    check_tensor_set(tensors, expected_peagle_weights(cfg), str(ckpt / "model.safetensors"), "P-EAGLE")
    return meta, cfg, tensors


def export_peagle(ckpt: Path, out: Path, dtype: str = "float32", num_speculative_tokens: int | None = None) -> Path:
    """Write the vLLM-loadable P-EAGLE draft of checkpoint ``ckpt`` to ``out`` (created).

    Args:
        ckpt: training checkpoint (``checkpoints/step-N``).
        out: output directory.
        dtype: storage dtype of the floating-point weights.
        num_speculative_tokens: K written as the default proposal length (default: the
            trained ``num_depths``); must be <= ``num_depths``.

    Returns:
        ``out``.

    Raises:
        ExportError: see :func:`read_peagle_checkpoint`; K outside ``[1, num_depths]``.
    """
    meta, cfg, tensors = read_peagle_checkpoint(ckpt)
    k = cfg.num_depths if num_speculative_tokens is None else num_speculative_tokens
    target = meta.target
    verifier = {"name_or_path": target.get("verifier", target["name_or_path"]),
                "architectures": target.get("architectures", [])}
    try:
        config = cfg.to_speculators(verifier, k, dtype, SPECULATORS_VERSION,
                                    {"version": __version__, "num_depths": cfg.num_depths,
                                     "train_embeddings": cfg.train_embeddings, "target_path": target.get("path")})
    except ValueError as exc:
        raise ExportError(f"{ckpt}: {exc}") from None
    torch_dtype = getattr(torch, dtype)
    tensors = {n: (v.to(torch_dtype) if v.is_floating_point() else v).contiguous() for n, v in tensors.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def is_peagle_export(config: dict[str, Any]) -> bool:
    """True for the ``config.json`` of a P-EAGLE export (speculators ``peagle``)."""
    return config.get("speculators_model_type") == "peagle"


def peagle_config(raw: dict[str, Any]) -> PEagleConfig:
    """The :class:`PEagleConfig` of a P-EAGLE ``config.json``.

    Raises:
        ValueError: another format (names its ``speculators_model_type``).
        KeyError: a required key is missing.
    """
    if not is_peagle_export(raw):
        raise ValueError(f"not a P-EAGLE export (speculators_model_type {raw.get('speculators_model_type')!r})")
    return PEagleConfig.from_speculators(raw)


def load_peagle(export_dir: Path, embed_tokens: torch.Tensor | None = None) -> PEagleDraftModel:
    """A P-EAGLE export as a float32 model in eval mode.

    Args:
        embed_tokens: the target's input embedding ``[V, H]``, used when the export has none
            (vLLM shares the target's embedding the same way).

    Raises:
        DraftLoadError: not a P-EAGLE export, a missing key, a tensor set other than
            :func:`expected_peagle_weights`, or no embedding anywhere.
    """
    cfg, state, weights = read_export(Path(export_dir), peagle_config)
    cfg.train_embeddings = False  # loaded for inference: the embedding is a buffer either way
    want = expected_peagle_weights(cfg)
    want.pop("embed_tokens.weight", None)
    embed = state.pop("embed_tokens.weight", embed_tokens)
    try:
        check_tensor_set(state, want, str(weights), "P-EAGLE")
    except ExportError as exc:
        raise DraftLoadError(str(exc)) from None
    if embed is None:
        raise DraftLoadError(f"{weights}: no embed_tokens.weight and no target embedding given")
    model = PEagleDraftModel(cfg)
    state["mask_hidden"] = state["mask_hidden"].reshape(-1)
    model.load_state_dict(state, strict=True)
    try:
        model.init_from_target(embed.float())
    except ValueError as exc:
        raise DraftLoadError(f"{export_dir}: {exc}") from exc
    return model.eval().requires_grad_(False)


class PEagleProposer(Proposer):
    """Parallel drafting as vLLM runs it (docs/parallel_drafts.md, "P-EAGLE at inference").

    Per-layer KV caches hold the depth-0 entries ``(x_{t+1}, fc(g_t))`` of committed positions
    at RoPE position t. A proposal after pending token ``x_{p+1}`` writes the new committed
    positions (the last is the bonus slot, position p) plus K-1 mask slots
    (``mask_token_id``, ``fc(mask_hidden)``, positions p+1..p+K-1) in ONE causal forward, reads
    the K draft logits of the bonus and mask slots, and crops the mask slots from the caches.
    """

    def __init__(self, model: PEagleDraftModel):
        self.model = model
        self.aux_layer_ids = list(model.config.aux_layer_ids)
        self.max_k = int(model.config.num_depths)
        self.reset()

    def reset(self) -> None:
        self.caches = [Eagle3KVCache() for _ in self.model.layers]
        self.length = 0  # committed (depth-0) positions in the caches

    @torch.no_grad()
    def propose(self, states: torch.Tensor, next_tokens: torch.Tensor, k: int, temperature: float,
                generator: torch.Generator | None) -> Proposal:
        """See :meth:`Proposer.propose`.

        Raises:
            ValueError: ``k`` outside ``[1, num_depths]``.
        """
        m = self.model
        if not 1 <= k <= m.config.num_depths:
            raise ValueError(f"k={k}: this P-EAGLE draft was trained with num_depths={m.config.num_depths} "
                             f"parallel depths, so it proposes 1..{m.config.num_depths} tokens")
        dtype, device = m.fc.weight.dtype, m.fc.weight.device
        n = states.shape[0]
        hidden = m.fc(states.to(device, dtype))  # (n, H)
        masks = m.mask_state().to(dtype).expand(k - 1, -1)  # (k-1, H)
        hidden = torch.cat([hidden, masks]).unsqueeze(0)  # (1, n+k-1, H)
        ids = torch.cat([next_tokens.to(device),
                         torch.full((k - 1,), m.config.mask_token_id, dtype=torch.long, device=device)]).unsqueeze(0)
        positions = torch.arange(self.length, self.length + n + k - 1, device=device).unsqueeze(0)
        out = m.forward_cached(ids, hidden, positions, self.caches)  # (1, n+k-1, H)
        logits = m.compute_logits(out[0, n - 1:]).float()  # (k, Vd): bonus slot + k-1 mask slots
        self.length += n
        for cache in self.caches:
            cache.crop(self.length)
        proposal = self._chain(lambda i, prev: logits[i], k, temperature, generator)
        return to_target_vocab(proposal, m.d2t, m.config.vocab_size)


def peagle_proposer(path: Path, target_model: Any | None = None) -> PEagleProposer:
    """The proposer of a P-EAGLE export, sharing ``target_model``'s input embedding unless the
    export ships its own.

    Raises:
        DraftLoadError: see :func:`load_peagle`; aux layer ids the target does not have.
    """
    from ..data_prep.capture import decoder_layers

    embed = target_model.get_input_embeddings().weight.detach() if target_model is not None else None
    model = load_peagle(path, embed)
    if target_model is not None:
        n_layers = len(decoder_layers(target_model))
        if not all(0 <= L < n_layers for L in model.config.aux_layer_ids):
            raise DraftLoadError(f"{Path(path) / 'config.json'}: aux layer ids {model.config.aux_layer_ids} out of "
                                 f"range for a target with {n_layers} decoder layers")
    return PEagleProposer(model)


def check_peagle_matches_target(export_dir: Path, target_dir: Path) -> dict[str, Any]:
    """Refuse a P-EAGLE export that does not fit the target; returns its ``config.json``.

    Raises:
        ValueError (``DraftMismatchError``): not a P-EAGLE export; hidden / vocab sizes, aux
            layer ids, ``t2d`` length or ``mask_token_id`` that do not fit the target; K above
            the trained depths.
    """
    from transformers import AutoConfig

    from .acceptance import DraftMismatchError, target_fit_problems

    export_dir = Path(export_dir)
    config_path = export_dir / "config.json"
    cfg = json.loads(config_path.read_text())
    if not is_peagle_export(cfg):
        raise DraftMismatchError(f"{config_path}: not a P-EAGLE export")
    layer = cfg.get("transformer_layer_config") or {}
    tcfg = AutoConfig.from_pretrained(target_dir)
    text = getattr(tcfg, "text_config", None) or tcfg
    problems = target_fit_problems(
        tcfg, export_dir, hidden_size=layer.get("hidden_size"), target_hidden_size=cfg.get("target_hidden_size"),
        vocab_size=layer.get("vocab_size"), draft_vocab_size=cfg.get("draft_vocab_size"),
        verifier=(cfg.get("speculators_config") or {}).get("verifier") or {})
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or []
    if len(ids) != 3 or not all(0 <= i < text.num_hidden_layers for i in ids):
        problems.append(f"aux layer ids {ids}: need 3 in [0, {text.num_hidden_layers})")
    mask = cfg.get("mask_token_id")
    if not isinstance(mask, int) or not 0 <= mask < text.vocab_size:
        problems.append(f"mask_token_id {mask!r} outside the target vocab of {text.vocab_size}")
    depths = (cfg.get("draftsmith") or {}).get("num_depths")
    k = next((p.get("speculative_tokens") for p in (cfg.get("speculators_config") or {}).get("proposal_methods") or []),
             None)
    if depths is not None and k is not None and k > depths:
        problems.append(f"speculative_tokens {k} > trained num_depths {depths}")
    if problems:
        raise DraftMismatchError(f"{export_dir} does not match target {target_dir}: " + "; ".join(problems))
    return cfg
