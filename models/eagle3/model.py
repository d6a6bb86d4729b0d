"""EAGLE-3 draft model with training-time test (TTT).

Follows EAGLE-3 (Li et al., arXiv:2503.01840) and the layout vLLM's
``llama_eagle3.py`` loads (speculators format, see :mod:`draftsmith.models.eagle3.format`):

    e_t   = embed_tokens(x_{t+1})                  # target embedding, frozen
    g_t   = fc(cat(h_low, h_mid, h_high))          # Linear(3H -> H, bias=False)
    a     = cat(input_layernorm(e_t), hidden_norm(g_t))   # [.., 2H]
    h     = r + o_proj(attn(q_proj(a), k_proj(a), v_proj(a)))
    h     = h + mlp(post_attention_layernorm(h))
    logits_d = lm_head(norm(h))                    # Linear(H -> Vd)

with ``r = g_t`` (``norm_before_residual=False``, the paper's layout) or
``r = hidden_norm(g_t)`` (``norm_before_residual=True``).

EAGLE-3.1 (the three options vLLM's ``llama_eagle3`` reads and the speculators library writes;
all off: EAGLE-3 as above, bit for bit): ``norm_before_fc`` puts one RMSNorm ``input_norm``
(width 3 * Ht) over ``cat(h_low, h_mid, h_high)`` before ``fc``; ``fc_norm`` one RMSNorm
``fc_norm.{i}`` (width Ht) over each of the three before the concatenation (with both, ``input_norm``
runs first, as in vLLM); ``norm_output`` feeds the next step the post-norm hidden ``norm(h)``
instead of ``h`` (:meth:`Eagle3DraftModel.next_hidden`; the logits are ``lm_head(norm(h))`` either way).

TTT unrolls the draft for ``ttt_steps`` steps on each training sequence: step 0 reads
the fused target states ``g_t``; step k > 0 reads the draft's own output ``h`` of step k-1
(pre-norm; post-norm with ``norm_output``) at the same position, the token embedding shifted one more position and the
RoPE position shifted by k -- exactly what vLLM's proposer feeds at the k-th drafted
token. Attention at step k is given by :func:`ttt_attention_mask`.

Packed rows (several documents in one row, ``train.packing``) pass per-document
``position_ids`` and ``document_ids``: attention and predictions then stay inside each
document, so the row computes what its documents compute one by one.

A sliding window W (``Eagle3Config.sliding_window``) limits attention as vLLM serves it: a query
at position p sees keys at positions p' with ``p - p' < W`` (W keys, its own included; vLLM's
FlashAttention ``window_size=(W - 1, 0)``, transformers' ``sliding_window_overlay``). The query of
TTT step k at row t stands at position t + k (the k-th chained token in vLLM), so it sees the
step-0 keys of rows ``t - W + k < j <= t`` and, as without a window, the diagonal keys of steps
1..k (positions t + 1 .. t + k, within the window since k < W).

Shapes: B batch, T sequence length (tokens), H hidden size, Vd draft vocab size,
nh / nkv query / key-value heads, hd head dim.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRotaryEmbedding

from ..common import RMSNorm, TargetSharedDraft, resolve_attention_backend, ttt_prediction_mask
from .attention import (  # noqa: F401 (re-exported where they were defined before)
    Eagle3Attention,
    Eagle3KVCache,
    Qwen3Eagle3Attention,
    TTTAttention,
    ttt_attention,
)
from .config import Eagle3Config
from .mla import DeepseekRotaryEmbedding, MLAEagle3Attention
from .masks import (  # noqa: F401 (the masks, re-exported where they were defined before)
    TTTMask,
    document_last,
    same_document,
    ttt_attention_mask,
    ttt_block_masks,
)


#: ``Eagle3Config.layer`` -> the draft layer's attention (the rest of the layer is the same for all).
LAYER_ATTENTION: dict[str, type[TTTAttention]] = {
    "llama": Eagle3Attention, "qwen3": Qwen3Eagle3Attention, "mla": MLAEagle3Attention}


def rotary_embedding(config: Eagle3Config) -> nn.Module:
    """The draft layer's RoPE tables ``(x, position_ids) -> (cos, sin)``: Llama's (rotate-half layout,
    head_dim wide; Qwen3 the same), or the MLA layer's (:class:`~draftsmith.models.eagle3.mla.DeepseekRotaryEmbedding`)."""
    return DeepseekRotaryEmbedding(config) if config.layer == "mla" else LlamaRotaryEmbedding(config.llama_config())


class Eagle3DecoderLayer(nn.Module):
    """One draft decoder layer (vLLM: ``layers.{i}``; layer 0 is the legacy format's ``midlayer``):
    norms, residuals and SiLU MLP as in every vLLM EAGLE-3 draft, the attention of ``config.layer``
    (:data:`LAYER_ATTENTION`).

    Layer 0 reads ``[input_layernorm(embeds) ; hidden_norm(hidden)]`` (2H q/k/v inputs); a layer
    ``layer_idx >= 1`` (``draft.num_layers`` > 1) is a plain pre-norm block on the hidden state
    (H q/k/v inputs, no ``hidden_norm``, the embedding not read), as vLLM's ``llama_eagle3`` /
    ``qwen3_eagle3`` / ``deepseek_eagle3`` build the layers after the first."""

    def __init__(self, config: Eagle3Config, layer_idx: int = 0):
        super().__init__()
        lc = config.llama_config()
        self.layer_idx = layer_idx
        self.norm_before_residual = config.norm_before_residual
        self.self_attn = LAYER_ATTENTION[config.layer](config, input_size=None if layer_idx == 0 else config.hidden_size)
        self.mlp = LlamaMLP(lc)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if layer_idx == 0:
            self.hidden_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def compile_regions(self) -> None:
        """``torch.compile`` the layer's regions around attention (``train.compile``): the input
        norms and concatenation, the q/k/v projections with RoPE, and the output projection,
        residuals, post-attention norm and MLP, each one graph whose elementwise chain inductor
        fuses into a few kernels (the matmuls stay cuBLAS calls). Attention itself is left out: the
        flex kernel is compiled on its own, SDPA is one call. Values equal the eager regions' within
        the fused kernels' rounding; parameters, state-dict keys and hooks are unchanged."""
        attn = self.self_attn
        self._input = torch.compile(self._input)
        self._output = torch.compile(self._output)
        attn._qkv = torch.compile(attn._qkv)
        attn._out = torch.compile(attn._out)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past: tuple[tuple[torch.Tensor, torch.Tensor], ...],
        mask: TTTMask | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """embeds, hidden: ``(B, T, H)`` -> (pre-norm output ``(B, T, H)``, this step's key/value);
        ``mask``: the unroll's :class:`TTTMask`."""
        x, residual = self._input(embeds, hidden)
        attn, kv = self.self_attn(x, cos, sin, past, mask)
        return self._output(residual, attn), kv

    def forward_cached(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       cache: Eagle3KVCache) -> torch.Tensor:
        """Inference with a KV cache: same arithmetic as :meth:`forward`. -> ``(B, T, H)``."""
        x, residual = self._input(embeds, hidden)
        return self._output(residual, self.self_attn.forward_cached(x, cos, sin, cache))

    def _input(self, embeds: torch.Tensor | None, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> attention input ``[norm(embeds) ; hidden_norm(hidden)]`` ``(B, T, 2H)`` and the residual;
        a layer after the first: ``input_layernorm(hidden)`` ``(B, T, H)`` and ``hidden``."""
        if self.layer_idx > 0:
            return self.input_layernorm(hidden), hidden
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1), residual

    def _output(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        h = residual + attn
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3DraftModel(TargetSharedDraft):
    """EAGLE-3 draft: ``fc`` fusion of three target aux hidden states + ``config.num_layers`` decoder
    layers (one, the paper's draft, unless ``draft.num_layers`` says more; :class:`Eagle3DecoderLayer`).

    The target's token embedding is held as a frozen, non-persistent buffer: it is not
    trained, not saved in checkpoints and (by default) not exported, because vLLM shares
    the target's embedding when the draft has none. ``d2t`` / ``t2d`` are persistent
    buffers (see :mod:`draftsmith.data_prep.vocab`).

    Activation checkpointing is applied from outside (``draft.gradient_checkpointing``:
    :func:`draftsmith.train.activation_checkpointing.apply_activation_checkpointing` wraps each
    decoder layer): each TTT step's layer then keeps only its inputs and outputs and is
    recomputed in backward.
    """

    _no_split_modules = ["Eagle3DecoderLayer"]  # FSDP unit (transformers convention, read by accelerate)

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        self.attention_backend = "auto"  # train.attention_backend: auto (flex on CUDA, sdpa elsewhere), sdpa, flex
        H, Ht = config.hidden_size, config.target_hidden_size
        self.register_buffer("embed_tokens", torch.zeros(config.vocab_size, H), persistent=False)
        # EAGLE-3.1 norms before fc (vLLM's names: input_norm, fc_norm.{i}); absent in EAGLE-3
        self.input_norm = RMSNorm(3 * Ht, eps=config.rms_norm_eps) if config.norm_before_fc else None
        self.fc_norm = (nn.ModuleList([RMSNorm(Ht, eps=config.rms_norm_eps) for _ in range(3)])
                        if config.fc_norm else None)
        self.fc = nn.Linear(3 * Ht, H, bias=False)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(config, i) for i in range(config.num_layers)])
        self.norm = RMSNorm(H, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary_emb = rotary_embedding(config)

    @torch.no_grad()
    def init_fc_last_aux(self) -> None:
        """``draft.init_fc: last_aux``: ``fc`` starts as ``[0 | 0 | I]``, so the fused ``g`` is the
        last (highest) aux hidden state itself (after the EAGLE-3.1 norms that are on).

        Raises:
            ValueError: the draft's hidden size differs from the target's (no identity exists).
        """
        H, Ht = self.config.hidden_size, self.config.target_hidden_size
        if H != Ht:
            raise ValueError(f"draft.init_fc=last_aux needs the draft's hidden size ({H}) equal to the target's ({Ht})")
        self.fc.weight.zero_()
        self.fc.weight[:, 2 * Ht:] = torch.eye(H, dtype=self.fc.weight.dtype, device=self.fc.weight.device)

    @torch.no_grad()
    def init_layer_from_target(self, layer: dict[str, torch.Tensor]) -> list[str]:
        """Start the draft decoder layer from one target decoder layer (``draft.init_layer_from_target``).

        ``layer`` maps the target layer's tensor names without the ``model.layers.{i}.`` prefix
        (``self_attn.q_proj.weight``, ``mlp.down_proj.weight``, ``input_layernorm.weight``, ...) to
        tensors in the target's shapes. The draft's attention reads ``[input_layernorm(embeds) ;
        hidden_norm(g)]`` ``(.., 2H)``: the target's projections of the layer input (Llama / Qwen3:
        q/k/v; MLA: ``q_a_proj`` or ``q_proj`` and ``kv_a_proj_with_mqa``) go into the columns that
        read ``g`` (``[:, H:]``) and ``hidden_norm`` takes the target's ``input_layernorm``, so the
        layer starts as the target's own layer applied to the fused hidden state; the columns that
        read the next token's embedding and ``input_layernorm`` keep their initialisation. The rest
        of the attention (``o_proj``; Qwen3's ``q_norm`` / ``k_norm``; MLA's latent norms,
        ``q_b_proj``, ``kv_b_proj``), the MLP and ``post_attention_layernorm`` are copied; biases
        where the draft has them.

        Returns:
            the names in ``layer`` the draft layer has no place for (e.g. Qwen3's ``q_norm`` /
            ``k_norm`` under ``layer: llama``), so the started layer is then not exactly the target's.

        Raises:
            KeyError: a tensor the draft layer needs is not in ``layer`` (named; a mixture-of-experts
                target layer has no dense ``mlp.*``: start from one of its dense layers).
            ValueError: a tensor's shape differs from the draft's (named, both shapes).
        """
        dst = self.layers[0]
        H = self.config.hidden_size
        copies = dst.self_attn.target_tensors(H) | {  # target name -> the draft tensor (or view) it is copied into
            "input_layernorm.weight": dst.hidden_norm.weight,
            "post_attention_layernorm.weight": dst.post_attention_layernorm.weight,
        }
        for name in ("gate_proj", "up_proj", "down_proj"):
            proj = getattr(dst.mlp, name)
            copies[f"mlp.{name}.weight"] = proj.weight
            if proj.bias is not None:
                copies[f"mlp.{name}.bias"] = proj.bias
        missing = sorted(set(copies) - set(layer))
        if missing:
            moe = any(name.startswith("mlp.") for name in missing) and any(".experts." in name for name in layer)
            raise KeyError(f"target layer tensors missing for the draft layer: {missing}"
                           + (" (a mixture-of-experts layer: start from one of the target's dense layers)" if moe else ""))
        for name, into in copies.items():
            src = layer[name]
            if tuple(src.shape) != tuple(into.shape):
                g_columns = not into.is_contiguous()  # a [:, H:] view of a (out, 2H) weight
                raise ValueError(f"target layer tensor {name} has shape {list(src.shape)}, the draft layer's "
                                 f"{'g columns ([:, H:]) of ' if g_columns else ''}{name} is {list(into.shape)}")
            into.copy_(src.to(into.dtype))
        return sorted(set(layer) - set(copies))

    def fuse(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """``(..., 3 * Ht)`` concatenated aux hidden states -> ``(..., H)`` fused ``g``: ``fc`` after
        the EAGLE-3.1 norms that are on (``input_norm`` over the whole, then ``fc_norm.{i}`` over
        each aux state), as vLLM's ``combine_hidden_states``."""
        if self.input_norm is not None:
            aux_hidden_states = self.input_norm(aux_hidden_states)
        if self.fc_norm is not None:
            chunks = aux_hidden_states.chunk(len(self.fc_norm), dim=-1)
            aux_hidden_states = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux_hidden_states)

    def next_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(..., H)`` pre-norm output of a step -> the hidden state the next step reads (TTT step
        k + 1, the next chained proposal): ``norm(hidden)`` with ``norm_output`` (EAGLE-3.1, vLLM's
        ``aux_output``), else ``hidden`` itself."""
        return self.norm(hidden) if self.config.norm_output else hidden

    def step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: list[tuple[tuple[torch.Tensor, torch.Tensor], ...]],
        mask: TTTMask | None = None,
    ) -> torch.Tensor:
        """One draft step.

        Args:
            input_ids: ``(B, T)`` tokens whose embeddings enter this step (x_{t+k+1}).
            hidden: ``(B, T, H)`` fused target states (step 0) or :meth:`next_hidden` of the
                previous step's output.
            position_ids: ``(B, T)`` RoPE positions.
            cache: one entry per earlier step (each a tuple of the layers' key/value), appended to.
            mask: the unroll's :class:`TTTMask` (documents of packed rows); default: plain TTT.

        Returns:
            pre-norm output hidden ``(B, T, H)``; logits are ``lm_head(norm(.))``.
        """
        embeds = F.embedding(input_ids, self.embed_tokens).to(hidden.dtype)  # (B, T, H)
        cos, sin = self.rotary_emb(hidden, position_ids)
        return self._step(embeds, hidden, cos, sin, cache, mask)

    def _step(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              cache: list[tuple[tuple[torch.Tensor, torch.Tensor], ...]], mask: TTTMask | None) -> torch.Tensor:
        """:meth:`step` from the step's embeddings ``(B, T, H)`` and RoPE ``cos`` / ``sin`` ``(B, T, hd)``.
        Layer i attends to its own keys of the earlier steps (``entry[i]`` of each ``cache`` entry)."""
        kvs = []
        for i, layer in enumerate(self.layers):
            hidden, kv = layer(embeds, hidden, cos, sin, tuple(entry[i] for entry in cache), mask)
            kvs.append(kv)
        cache.append(tuple(kvs))
        return hidden

    def step_cached(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                    cache: Eagle3KVCache | list[Eagle3KVCache]) -> torch.Tensor:
        """One draft step at inference over new positions, with a KV cache.

        Chain drafting (docs/conventions.md, "EAGLE-3 draft and training-time test"; as vLLM
        runs it): step 0 over the newly committed
        positions (``hidden = fuse(aux)``), then one call per chained token with the previous
        output hidden state (:meth:`next_hidden`) at the next RoPE position; the caller crops the chained keys
        afterwards. Attending every cached key is exactly the TTT mask of training.

        Args:
            input_ids: ``(B, T)`` target ids whose embeddings enter (x_{t+1}).
            hidden: ``(B, T, H)`` fused aux states or :meth:`next_hidden` of the previous step's output.
            position_ids: ``(B, T)`` RoPE positions.
            cache: one :class:`Eagle3KVCache` per decoder layer (a bare cache for a one-layer draft),
                appended to.

        Returns:
            pre-norm output hidden ``(B, T, H)``.

        Raises:
            ValueError: not one cache per layer.
        """
        caches = [cache] if isinstance(cache, Eagle3KVCache) else list(cache)
        if len(caches) != len(self.layers):
            raise ValueError(f"{len(caches)} KV caches for {len(self.layers)} draft layers")
        embeds = F.embedding(input_ids, self.embed_tokens).to(hidden.dtype)  # (B, T, H)
        cos, sin = self.rotary_emb(hidden, position_ids)
        for layer, layer_cache in zip(self.layers, caches):
            hidden = layer.forward_cached(embeds, hidden, cos, sin, layer_cache)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(..., H)`` pre-norm hidden -> ``(..., Vd)`` draft-vocab logits."""
        return self.lm_head(self.norm(hidden))

    compute_logits.fused_as = ("norm", "lm_head")  # lm_head(norm(.)): the fused loss may run it (train/losses.py)

    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        ttt_steps: int,
        loss_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        step_head: Callable[[int, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]], Any] | None = None,
    ) -> list[Any]:
        """Unrolled TTT forward.

        Args:
            input_ids: ``(B, T)`` target tokens x_0..x_{T-1} (right-padded).
            aux_hidden_states: ``(B, T, 3 * Ht)``, ``cat(h[L0], h[L1], h[L2])`` at each position.
            ttt_steps: K >= 1 unrolled steps.
            loss_mask: optional ``(B, T)``, 1 on trained (assistant) tokens. When given (and no
                ``step_head``), step k computes logits only at the positions
                :func:`~draftsmith.models.common.ttt_prediction_mask` selects (the lm_head is the
                largest matmul; skipping untrained positions saves it). Boolean selection reads the mask on the host:
                training passes ``step_head`` instead.
            position_ids: optional ``(B, T)`` RoPE positions of step 0; default ``0..T-1``.
                Packed rows restart them at 0 for every document.
            document_ids: optional ``(B, T)`` document per position (packed rows, contiguous
                runs): attention and predictions never cross a document boundary, so a packed
                row computes exactly what its documents compute unpacked.
            step_head: training: ``step_head(k, hidden (B, T, H), logits_fn)`` is called at every
                step inside forward and its results are returned instead of logits (the trainer's
                chunked loss: DDP / FSDP see ``norm`` and ``lm_head`` used in forward, and only
                what the head returns, not ``(M, Vd)`` logits, leaves the module).

        Returns:
            K results of ``step_head``, or K logits tensors: ``(B, T, Vd)`` without ``loss_mask``
            (step k, position t predicts x_{t+k+2}; positions whose inputs run past the end are
            garbage), else ``(M_k, Vd)`` for the ``M_k`` selected positions in row-major order.

        Raises:
            ValueError: ``ttt_steps < 1``.
        """
        if ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {ttt_steps}")
        B, T = input_ids.shape
        hidden = self.fuse(aux_hidden_states)  # (B, T, H)
        base_pos = position_ids
        if base_pos is None:
            base_pos = torch.arange(T, device=input_ids.device).unsqueeze(0).expand(B, T)
        mask = TTTMask.build(T, ttt_steps, input_ids.device, document_ids,
                             resolve_attention_backend(self.attention_backend, input_ids.device),
                             self.config.sliding_window)
        # once per unroll, not per step: the embeddings of x_1 .. x_{T+K-1} (0 past the end, as
        # shift_left pads) and the RoPE angles of positions p + k for every step k; step k reads
        # views of them (fewer launches: one embedding, one cast and one RoPE table per forward)
        ids = F.pad(input_ids[:, 1:], (0, ttt_steps))  # (B, T - 1 + K)
        embeds_all = F.embedding(ids, self.embed_tokens).to(hidden.dtype)  # (B, T - 1 + K, H)
        steps_pos = (base_pos.unsqueeze(1) + torch.arange(ttt_steps, device=input_ids.device)[:, None])  # (B, K, T)
        cos_all, sin_all = self.rotary_emb(hidden, steps_pos.flatten(1))  # (B, K*T, hd)
        cache: list[tuple[tuple[torch.Tensor, torch.Tensor], ...]] = []
        outputs = []
        for k in range(ttt_steps):
            # x_{t+k+1}; near a packed document's end this is the next document's token: only
            # positions whose prediction is masked out (ttt_prediction_mask) ever read it
            if k > 0:
                hidden = self.next_hidden(hidden)  # what step k reads of step k - 1's output
            rope = slice(k * T, (k + 1) * T)
            hidden = self._step(embeds_all[:, k:k + T], hidden, cos_all[:, rope], sin_all[:, rope], cache, mask)
            if step_head is not None:
                outputs.append(step_head(k, hidden, self.compute_logits))
            elif loss_mask is None:
                outputs.append(self.compute_logits(hidden))  # (B, T, Vd)
            else:
                sel = ttt_prediction_mask(loss_mask, k, document_ids)  # (B, T)
                outputs.append(self.compute_logits(hidden[sel]))  # (M_k, Vd)
        return outputs


