"""What the draft models share: RoPE in both spellings, the target's layer geometry
(:class:`LayerGeometry`: what the dry run's estimators read), the base of the EAGLE-3 / P-EAGLE /
DFlash configs built from it (:class:`LlamaLayerConfig`), the base of the drafts that embed with the target's
embedding, the training step's distillation targets, ``shift_left``, and what every method's
on-disk format (``models/<m>/format.py``) is made of: :class:`DraftFormat`,
the one tensor-set check (:func:`check_tensor_set`) and the one "does this draft fit the target"
rule (:func:`fit_problems`).

Imports nothing from ``data_prep`` / ``train`` / ``eval`` (``models`` is below every stage);
the target's text config (:func:`~draftsmith.target.text_config`) is ``target``'s, the file
contracts it uses (:class:`~draftsmith.layout.ExportError`) are ``layout.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from ..layout import DraftLoadError, ExportError
from ..target import text_config
from ..target.families import MLA_KEYS


ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "sdpa", "flex")


def resolve_attention_backend(backend: str, device: torch.device) -> str:
    """The attention kernel ``train.attention_backend`` names on ``device``: ``auto`` is
    ``flex`` on CUDA (a compiled ``flex_attention`` that skips fully masked tiles) and ``sdpa``
    elsewhere (torch 2.13 has no flex backward on the CPU); ``sdpa`` / ``flex`` are themselves.

    Raises:
        ValueError: an unknown backend (the message lists :data:`ATTENTION_BACKENDS`).
    """
    if backend == "auto":
        return "flex" if torch.device(device).type == "cuda" else "sdpa"
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}: one of {', '.join(ATTENTION_BACKENDS)}")
    return backend


class RMSNorm(LlamaRMSNorm):
    """Llama's RMSNorm (``weight * (x / rms(x)).to(x.dtype)``, the normalisation in float32) through
    ``torch.nn.functional.rms_norm``: on CUDA one fused kernel (``aten::_fused_rms_norm``) that
    keeps the input and the ``(..., 1)`` float32 reciprocal RMS for backward, where the written-out
    form launches a kernel per op and keeps float32 copies of the ``(..., H)`` input; on the CPU
    torch decomposes it into the written-out ops. The weight multiplies after the cast to the
    input's dtype, as in transformers' ``LlamaRMSNorm`` (same parameters, state-dict keys and
    dtype promotion: a bf16 input with an fp32 weight gives fp32, as under autocast).

    ``forward(x (..., H)) -> (..., H)``.
    """

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_normalize(hidden_states, self.variance_epsilon)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps)`` over the last dim, computed in float32, returned in ``x``'s
    dtype (``F.rms_norm`` without a weight). A module-level function so that ``draftsmith bench
    step`` can count CUDA's fused kernel in its place on a CPU."""
    return F.rms_norm(x, (x.shape[-1],), None, eps)


def resolve_compile(setting: str | bool, device: torch.device) -> bool:
    """``train.compile`` on ``device``: ``auto`` compiles on CUDA only (on the CPU inductor's
    compilation costs more than the fused kernels save on the lab's short runs)."""
    if setting == "auto":
        return torch.device(device).type == "cuda"
    return bool(setting)


def compile_regions(model: nn.Module) -> int:
    """Call ``compile_regions()`` of every submodule of ``model`` that has one (the draft decoder
    layers); returns how many did."""
    layers = [m for m in model.modules() if callable(getattr(m, "compile_regions", None)) and m is not model]
    for m in layers:
        m.compile_regions()
    return len(layers)


def rope_theta_and_scaling(rope_parameters: dict[str, Any] | None, rope_theta: float | None = None,
                           rope_scaling: dict[str, Any] | None = None) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from either spelling of a Llama-style RoPE config.

    transformers >= 5 keeps theta and scaling together in ``rope_parameters``; older configs
    (and older exports) have ``rope_theta`` + ``rope_scaling``. When ``rope_parameters`` is
    given it wins; ``rope_scaling`` is None for the ``default`` rope type. Theta defaults to
    10000 (Llama's).
    """
    if rope_parameters:
        theta = rope_parameters.get("rope_theta") or rope_theta
        scaling = None
        if rope_parameters.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    else:
        theta, scaling = rope_theta, rope_scaling
    return float(theta or 10000.0), (dict(scaling) if scaling else None)



def global_value(text: Any, key: str) -> Any:
    """``text.<key>`` (None when absent); of a config with per-layer geometry (transformers'
    heterogeneous configs: Gemma 4's global layers have their own ``head_dim`` and
    ``num_key_value_heads``) the config-wide value, that of the layers without an override
    (Gemma 4's sliding layers), where reading the attribute raises."""
    try:
        return getattr(text, key, None)
    except RuntimeError:  # AmbiguousGlobalPerLayerAttributeError: a per-layer attribute
        return text.to_dict().get(key)


def mlp_width(text: Any) -> int:
    """The target's MLP width a draft layer copies: ``intermediate_size``, or for a target whose
    decoder layers are all mixture-of-experts and that states no dense width (Qwen3.5-MoE) the
    width a token passes through: ``num_experts_per_tok * moe_intermediate_size`` plus the shared
    expert's ``shared_expert_intermediate_size``.

    Raises:
        ValueError: neither is in the config.
    """
    width = global_value(text, "intermediate_size")
    if width:
        return int(width)
    per_expert, top_k = global_value(text, "moe_intermediate_size"), global_value(text, "num_experts_per_tok")
    if not (per_expert and top_k):
        raise ValueError(f"{type(text).__name__}: no intermediate_size, nor moe_intermediate_size and "
                         "num_experts_per_tok, to size a draft layer's MLP from")
    return int(top_k * per_expert + (global_value(text, "shared_expert_intermediate_size") or 0))


class LlamaLayerConfig:
    """Base of the draft configs built from Llama-style decoder layers (EAGLE-3, P-EAGLE,
    DFlash): the geometry they copy from the target and RoPE in transformers >= 5's spelling.
    Subclasses are dataclasses with ``rope_theta`` and ``rope_scaling`` fields."""

    rope_theta: float
    rope_scaling: dict[str, Any] | None

    @staticmethod
    def target_geometry(target_config: Any) -> dict[str, Any]:
        """The fields a draft copies from a transformers target config (Llama-like, Qwen3 or
        gpt-oss): hidden / MLP / attention sizes, vocab, norm eps, activation and RoPE (YaRN
        included, so draft positions rotate exactly as vLLM rotates them at serving time)."""
        text = text_config(target_config)
        heads = text.num_attention_heads
        rope_theta, rope_scaling = rope_theta_and_scaling(getattr(text, "rope_parameters", None),
                                                          getattr(text, "rope_theta", None),
                                                          getattr(text, "rope_scaling", None))
        return dict(
            hidden_size=text.hidden_size,
            intermediate_size=mlp_width(text),
            num_attention_heads=heads,
            num_key_value_heads=global_value(text, "num_key_value_heads") or heads,
            head_dim=global_value(text, "head_dim") or text.hidden_size // heads,
            vocab_size=text.vocab_size,
            target_hidden_size=text.hidden_size,
            rms_norm_eps=getattr(text, "rms_norm_eps", 1e-5),
            hidden_act=getattr(text, "hidden_act", "silu"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=getattr(text, "max_position_embeddings", 4096),
        )

    def rope_parameters(self) -> dict[str, Any]:
        """RoPE in transformers >= 5's ``rope_parameters`` spelling (inverse of
        :func:`rope_theta_and_scaling`)."""
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope_parameters.update(self.rope_scaling)
            rope_parameters["rope_type"] = self.rope_scaling.get(
                "rope_type", self.rope_scaling.get("type", "default")
            )
        return rope_parameters


@dataclass(frozen=True)
class LayerGeometry:
    """The target-derived geometry of a draft's layers, built from the target's config alone
    (:meth:`from_target`; no weights): what every method's dry-run estimators read
    (``parameter_estimate(recipe, geometry, vocab_size)``, ``activation_estimate(recipe, shapes,
    trainable)`` of ``models/<m>/training.py``, through :mod:`draftsmith.train.dry_run`).

    Attributes:
        hidden_size: H, the target's hidden size (the draft's, where it shares the embedding).
        intermediate_size: the target's MLP width.
        num_attention_heads / num_key_value_heads / head_dim: the target's attention geometry.
        vocab_size: V, the target vocabulary.
        target_hidden_size: Ht, width of each aux hidden state (the target's hidden size).
        rms_norm_eps, hidden_act, rope_theta, rope_scaling, max_position_embeddings: the
            target's (:meth:`LlamaLayerConfig.target_geometry`).
        draft_vocab_size: Vd, rows of a draft-vocab ``lm_head``.
        aux_layer_ids: the vLLM aux layer ids the hidden states are captured at, ascending.
        mla: a multi-head latent attention target's ``q_lora_rank``, ``kv_lora_rank``,
            ``qk_nope_head_dim``, ``qk_rope_head_dim`` and ``v_head_dim`` (DeepSeek-V2/V3, Kimi K2);
            None for other targets. Not a draft config field (:meth:`fields` leaves it out): the
            dry run reads it for EAGLE-3's ``draft.layer: mla``.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float
    hidden_act: str
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    mla: dict[str, Any] | None = None

    @classmethod
    def from_target(cls, target_config: Any, draft_vocab_size: int, aux_layer_ids: list[int]) -> LayerGeometry:
        """The geometry of a transformers target config (Llama-like, Qwen3, gpt-oss, DeepSeek's
        MLA), with the run's draft vocab size and aux layer ids."""
        text = text_config(target_config)
        mla = ({k: getattr(text, k, None) for k in MLA_KEYS} if getattr(text, "kv_lora_rank", None)
               else None)
        return cls(**LlamaLayerConfig.target_geometry(target_config), draft_vocab_size=int(draft_vocab_size),
                   aux_layer_ids=tuple(aux_layer_ids), mla=mla)

    def fields(self) -> dict[str, Any]:
        """The draft config fields as keyword arguments (``aux_layer_ids`` a list; ``mla`` left
        out), e.g. ``Eagle3Config(**geometry.fields())``."""
        return {**{name: getattr(self, name) for name in self.__dataclass_fields__ if name != "mla"},
                "aux_layer_ids": list(self.aux_layer_ids)}


@dataclass
class DistillTargets:
    """What a draft's ``forward`` distils its rows towards when the training loss is computed inside
    the forward (DFlash block slots, P-EAGLE COD elements): calling it on the forward's pre-norm
    hidden rows runs ``distill`` (``draftsmith.train.losses.chunked_distill``: chunks of rows, each
    recomputed in backward, so no ``(M, Vd)`` float32 tensor lives until backward). Reads nothing on
    the host.

    Attributes:
        teacher: ``(N, Vd)`` target logits over the draft vocab (no grad), computed once per batch.
        teacher_index: int64, the ``teacher`` row of each hidden row, shaped like the rows without H.
        weight: float, the loss weight of each hidden row (0: not trained), same shape.
        distill: ``chunked_distill`` itself (models import nothing from ``train/``):
            ``distill(rows (M, H), logits_fn, teacher, teacher_index (M,), weight (M,), loss, chunk_size)``.
        loss: the divergence (``train.loss``, a ``LossSpec``); None: forward KL.
        chunk_size: rows per loss chunk (None: ``chunk_rows`` of Vd, ``train.loss_chunk_rows``).
        rows: optional ``(M,)`` int64 indices of the flattened hidden rows to train: then
            ``teacher_index`` and ``weight`` are ``(M,)``, aligned with ``rows`` (the other rows are
            never projected by the ``lm_head``).
    """

    teacher: torch.Tensor
    teacher_index: torch.Tensor
    weight: torch.Tensor
    distill: Callable[..., Any]
    loss: Any = None
    chunk_size: int | None = None
    rows: torch.Tensor | None = None

    def __call__(self, hidden: torch.Tensor, logits_fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        """``hidden (..., H)`` rows (aligned with ``teacher_index`` / ``weight``, or indexed by
        ``rows``) -> what ``distill`` returns (``DistillOut``)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self.rows is not None:
            flat = flat.index_select(0, self.rows)
        return self.distill(flat, logits_fn, self.teacher, self.teacher_index.reshape(-1), self.weight.reshape(-1),
                            self.loss, self.chunk_size)


class TargetSharedDraft(nn.Module):
    """Base of the drafts that embed with the target's (frozen) embedding and predict over a
    draft vocab (EAGLE-3, DFlash, P-EAGLE). Subclasses define ``config`` (``vocab_size``,
    ``draft_vocab_size``), ``embed_tokens [V, H]``, ``lm_head``, ``norm`` and the ``d2t`` /
    ``t2d`` buffers."""

    @torch.no_grad()
    def init_from_target(
        self,
        embed_tokens: torch.Tensor,
        lm_head_draft_rows: torch.Tensor | None = None,
        final_norm: torch.Tensor | None = None,
    ) -> None:
        """Load the target embedding ``[V, H]`` (a frozen buffer kept in the target's dtype; the
        looked-up rows are cast to the hidden states' dtype) and, optionally, start ``lm_head``
        from the target's ``lm_head`` rows of the draft vocab ``[Vd, H]`` and ``norm`` from the
        target's final norm ``[H]``.

        Raises:
            ValueError: the embedding is not ``(vocab_size, hidden_size)``.
        """
        if tuple(embed_tokens.shape) != tuple(self.embed_tokens.shape):
            raise ValueError(
                f"target embedding has shape {tuple(embed_tokens.shape)}, draft expects "
                f"{tuple(self.embed_tokens.shape)} (vocab_size x hidden_size)"
            )
        if isinstance(self.embed_tokens, nn.Parameter):  # trained embedding (P-EAGLE train_embeddings)
            self.embed_tokens.copy_(embed_tokens)
        else:  # the frozen buffer keeps the target's dtype (bf16 for a bf16 target: half the memory)
            self.embed_tokens = embed_tokens.detach().to(self.embed_tokens.device).clone()
        if lm_head_draft_rows is not None:
            self.lm_head.weight.copy_(lm_head_draft_rows)
        if final_norm is not None:
            self.norm.weight.copy_(final_norm)

    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocab: ``d2t`` int64 ``[Vd]`` offsets, ``t2d`` bool ``[V]``.

        Raises:
            ValueError: shapes that do not match the config.
        """
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(
                f"vocab mapping shapes d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not match "
                f"draft_vocab_size={self.config.draft_vocab_size}, vocab_size={self.config.vocab_size}"
            )
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)



def shift_left(x: torch.Tensor, n: int, fill: int = 0) -> torch.Tensor:
    """``out[:, t] = x[:, t + n]``, padded with ``fill`` past the end. x: ``(B, T, ...)``."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)[:, : x.shape[1]]


def ttt_prediction_mask(
    loss_mask: torch.Tensor, step: int, document_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """``(B, T)`` bool: positions t whose step-``step`` prediction, token x_{t+step+2}, is
    trained (``loss_mask[t + step + 2] == 1``) and, with ``document_ids`` ``(B, T)`` (packed
    rows, each document a contiguous run), in the same document as t."""
    sel = shift_left(loss_mask, step + 2).bool()
    if document_ids is not None:
        sel = sel & (shift_left(document_ids, step + 2, fill=-1) == document_ids)
    return sel


# --------------------------------------------------------------------------------------
# On-disk formats

SPECULATORS_VERSION = "0.3.0"  # the speculators config schema the speculators-format exports follow


@dataclass(frozen=True)
class DraftCard:
    """How a model card (``draftsmith hub``) names a method and describes an export of it.

    Attributes:
        title: the method's name in the card's title ("EAGLE-3").
        summary: the method in a phrase, with its paper ("EAGLE-3 (arXiv:2503.01840)").
        facts: ``facts(config_json) -> lines``: Markdown list items about the export.
        num_speculative_tokens: ``k(config_json)``: the K the export proposes by default (None: unknown).
    """

    title: str
    summary: str
    facts: Callable[[dict[str, Any]], list[str]]
    num_speculative_tokens: Callable[[dict[str, Any]], int | None]


@dataclass(frozen=True)
class DraftFormat:
    """A draft method's export format, as ``models/<m>/format.py`` defines it and the generic
    exporter / loader (:mod:`draftsmith.eval.export`) drive it.

    Attributes:
        layout: its name in messages ("EAGLE-3", "DFlash", ...).
        detect: ``detect(config_json) -> bool``: the one rule telling its exports apart.
        export: ``export(config, state, target, dtype, provenance, **options) -> (tensors,
            config_json)``: the export names and tensors (checked against the layout vLLM loads,
            not yet cast) and the ``config.json`` of a training checkpoint's model ``config``
            and state dict ``state`` (``target``: ``draft_config.json``'s target record;
            ``provenance``: written under the ``draftsmith`` key).
        load: ``load(export_dir, embed_tokens=None, lm_head=None) -> model`` (float32, eval
            mode): the target's input embedding / ``lm_head`` are used by the drafts that share
            them when the export ships none, ignored by the others.
        fit: ``fit(config_json) -> DraftFit`` for the drafts that share the target's embedding
            and vocab (checked with :func:`fit_problems`); None: nothing to check.
        card: the model card's text for its exports.
        export_options: the keyword options of ``export`` besides the above (``legacy``,
            ``num_speculative_tokens``, ``embed_tokens``), given to it by the exporter when set.
        k_from_recipe: without an explicit K, ``draftsmith export`` writes the saved recipe's
            ``eval.num_speculative_tokens`` (False: the format's own, trained K).
        refines: the method whose format this one extends so that its detector accepts these
            exports too (DSpark: ``dflash``); where both detect a config, it is this format's
            (:func:`draftsmith.methods.method_of_export`). None: no other detector accepts them.
        sidecars: ``sidecars(config_json) -> {file name: JSON object}``: further JSON files the
            exporter writes beside ``config.json`` (XPress: ``speculators_config.json``); None: none.
    """

    layout: str
    detect: Callable[[dict[str, Any]], bool]
    export: Callable[..., tuple[dict[str, torch.Tensor], dict[str, Any]]]
    load: Callable[..., nn.Module]
    card: DraftCard
    fit: Callable[[dict[str, Any]], "DraftFit"] | None = None
    export_options: tuple[str, ...] = ()
    k_from_recipe: bool = False
    refines: str | None = None
    sidecars: Callable[[dict[str, Any]], dict[str, dict[str, Any]]] | None = None


def with_target_embedding(model: nn.Module, embed_tokens: torch.Tensor | None, where: Any) -> nn.Module:
    """A loaded draft that shares the target's embedding, ready to propose: ``embed_tokens``
    (None: left as is) installed as float32, eval mode, no gradients.

    Raises:
        DraftLoadError: the embedding does not fit the draft (names ``where``).
    """
    if embed_tokens is not None:
        try:
            model.init_from_target(embed_tokens.float())
        except ValueError as exc:
            raise DraftLoadError(f"{where}: {exc}") from exc
    return model.eval().requires_grad_(False)


def check_tensor_set(tensors: dict[str, torch.Tensor], want: dict[str, tuple[int, ...]], where: str,
                     layout: str) -> None:
    """Refuse any difference between ``tensors`` and the names / shapes ``want`` of the layout
    vLLM reads. vLLM's draft loaders are not strict (a missing tensor stays uninitialised, an
    extra one may be ignored or assert), so every exporter checks the exact set.

    Raises:
        ExportError: naming the missing, unexpected and mis-shaped tensors of ``where``
            (``layout``: e.g. "DFlash", for the message).
    """
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    shaped = sorted(f"{k} {tuple(tensors[k].shape)} != {want[k]}" for k in set(want) & set(tensors)
                    if tuple(tensors[k].shape) != want[k])
    if missing or extra or shaped:
        raise ExportError(f"{where}: the tensors do not match the {layout} layout vLLM loads (vLLM would not "
                          f"complain): missing {missing}, unexpected {extra}, mis-shaped {shaped}")


def verifier_of(target: dict[str, Any]) -> dict[str, Any]:
    """The speculators ``verifier`` record of a checkpoint's target record (``draft_config.json``)."""
    return {"name_or_path": target.get("verifier", target["name_or_path"]),
            "architectures": target.get("architectures", [])}


def cast_floating(tensors: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """``tensors`` with the floating ones in ``dtype`` (a torch dtype name), each contiguous and
    with storage of its own (tied tensors share storage, which safetensors refuses)."""
    torch_dtype = getattr(torch, dtype)
    return {k: (v.detach().to(torch_dtype) if v.is_floating_point() else v).clone().contiguous()
            for k, v in tensors.items()}


# --------------------------------------------------------------------------------------
# Does a draft fit the target


@dataclass(frozen=True)
class TargetFit:
    """What a target offers a draft: sizes, decoder layers, architectures and (when a run's
    hidden states were captured already) the aux layer ids the draft must read."""

    hidden_size: int
    vocab_size: int
    num_hidden_layers: int | None = None
    architectures: list[str] = field(default_factory=list)
    aux_layer_ids: list[int] | None = None

    @classmethod
    def of_config(cls, target_config: Any) -> "TargetFit":
        """The facts of a transformers target config (its :func:`text_config`)."""
        text = text_config(target_config)
        return cls(int(text.hidden_size), int(text.vocab_size), int(text.num_hidden_layers),
                   list(getattr(target_config, "architectures", None) or []))


@dataclass(frozen=True)
class DraftFit:
    """What a draft that shares the target's embedding and vocab (EAGLE-3, DFlash, P-EAGLE)
    must agree on with it; None: not recorded, not checked.

    Attributes:
        aux_count: how many aux layer ids the draft reads (None: any).
        aux_min: the smallest aux id the format allows (0: the embedding output; DFlash: 1).
        t2d_size: the length of the export's ``t2d`` (the target vocab it maps).
        mask_token_id: the mask slots' token id (P-EAGLE), which must be a target token.
        num_speculative_tokens / max_speculative_tokens: the export's K and the most it was
            trained for (P-EAGLE's ``num_depths``).
    """

    hidden_size: int | None
    target_hidden_size: int | None
    vocab_size: int | None
    draft_vocab_size: int | None
    aux_layer_ids: list[int] | None
    verifier: dict[str, Any] = field(default_factory=dict)
    aux_count: int | None = None
    aux_min: int = 0
    t2d_size: int | None = None
    mask_token_id: int | None = None
    num_speculative_tokens: int | None = None
    max_speculative_tokens: int | None = None


def fit_problems(draft: DraftFit, target: TargetFit) -> list[str]:
    """What keeps ``draft`` from serving (or being trained on) ``target``: one line per
    disagreement, empty when it fits. The one rule behind the acceptance / serving target
    checks and warm start's."""
    problems = []
    H, V = target.hidden_size, target.vocab_size
    if draft.hidden_size != H:
        problems.append(f"draft hidden_size {draft.hidden_size} != target {H} (vLLM would not share the "
                        "target embedding)")
    if draft.target_hidden_size is not None and draft.target_hidden_size != H:
        problems.append(f"draft target_hidden_size {draft.target_hidden_size} != target {H}")
    if draft.vocab_size != V:
        problems.append(f"draft vocab_size {draft.vocab_size} != target {V} (a draft for another tokenizer)")
    if (draft.draft_vocab_size or 0) > V:
        problems.append(f"draft_vocab_size {draft.draft_vocab_size} > target vocab {V}")
    arch = list(draft.verifier.get("architectures") or [])
    if arch and target.architectures and arch != list(target.architectures):
        problems.append(f"verifier {draft.verifier.get('name_or_path')!r} is {arch}, target is {target.architectures}")
    if draft.t2d_size is not None and draft.t2d_size != V:
        problems.append(f"t2d covers {draft.t2d_size} target ids, target vocab is {V}")
    ids = draft.aux_layer_ids
    if ids is not None and draft.aux_count is not None and len(ids) != draft.aux_count:
        problems.append(f"aux layer ids {ids}: this draft needs exactly {draft.aux_count}")
    n = target.num_hidden_layers
    if ids and n is not None and not all(draft.aux_min <= i < n for i in ids):
        problems.append(f"aux layer ids {ids} out of range for {n} target layers (allowed: [{draft.aux_min}, {n}))")
    if ids is not None and target.aux_layer_ids is not None and list(ids) != list(target.aux_layer_ids):
        problems.append(f"aux layer ids {list(ids)} != {list(target.aux_layer_ids)}, the layers this run's hidden "
                        "states were captured at (data.aux_layer_ids)")
    if draft.mask_token_id is not None and not 0 <= draft.mask_token_id < V:
        problems.append(f"mask_token_id {draft.mask_token_id!r} outside the target vocab of {V}")
    k, most = draft.num_speculative_tokens, draft.max_speculative_tokens
    if k is not None and most is not None and k > most:
        problems.append(f"speculative_tokens {k} > trained num_depths {most}")
    return problems


# --------------------------------------------------------------------------------------
# Drafts with their own heads (Medusa, MLP speculator): no shared embedding, tied stages


def checkpoint_model(ckpt: Any, model: nn.Module, want: dict[str, tuple[int, ...]], hidden: int,
                     vocab: int) -> nn.Module:
    """``model`` loaded with the weights of checkpoint ``ckpt`` (a
    :class:`~draftsmith.layout.DraftCheckpoint`) whose tensors ``want`` lists, after checking
    its ``hidden`` and ``vocab`` sizes against the target the checkpoint records.

    Checkpoints store a tied tensor once (safetensors refuses shared storage): a name may be
    absent only if the model ties it to one that is present.

    Raises:
        ExportError: sizes other than the recorded target's; unexpected, mis-shaped or missing tensors.
    """
    meta_path = ckpt.path / "draft_config.json"
    target = ckpt.meta.target
    for key, have in (("hidden_size", hidden), ("vocab_size", vocab)):
        if target.get(key) != have:
            raise ExportError(f"{meta_path}: draft {key} is {have} but the target it was trained on has "
                              f"target.{key}={target.get(key)!r}")
    state = ckpt.state
    check_tensor_set(state, {k: v for k, v in want.items() if k in state}, str(ckpt.weights), type(model).__name__)
    missing = set(model.load_state_dict(state, strict=False).missing_keys)
    own = model.state_dict()
    present = {p.data_ptr() for k, p in own.items() if k in state}
    untied = sorted(k for k in missing if own[k].data_ptr() not in present)
    if untied:
        raise ExportError(f"{ckpt.weights}: missing tensors {untied}")
    return model


def load_head_export(directory: Path, model: nn.Module, prefix: str) -> nn.Module:
    """``model`` loaded (float32, eval mode) from the ``model.safetensors`` of an export whose
    names carry ``prefix``.

    Raises:
        ExportError: missing or unexpected tensors.
    """
    from safetensors.torch import load_file

    weights = load_file(str(directory / "model.safetensors"))
    state = {k.removeprefix(prefix): v.float() for k, v in weights.items()}
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys or set(state) != set(model.state_dict()):
        raise ExportError(f"{directory}/model.safetensors: missing {sorted(result.missing_keys)}, "
                          f"unexpected {sorted(result.unexpected_keys)}")
    return model.eval()
