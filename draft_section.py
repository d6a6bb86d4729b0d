"""The shared bases of the recipe's per-method ``draft`` sections (torch-free): each method
package's ``recipe.py`` derives its section from one of them, and :mod:`draftsmith.recipe`
builds the ``draft`` union from the registered sections (:mod:`draftsmith.methods`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DraftSection(_Strict):
    """Base of the per-method ``draft`` sections. ``draft`` is a discriminated union on
    ``method`` (:data:`draftsmith.recipe.DraftConfig`): each method's keys sit directly under ``draft``, the keys
    of its training too (``ttt_steps``, ``loss``, ``head_decay`` ...: only where they apply)."""

    method: str = Field(description="Draft architecture (draftsmith.methods).")  # each section's Literal

    def check_recipe(self, recipe: "Recipe") -> None:
        """Cross-section checks of this method (raise ValueError); the default has none."""


# the divergences of train/losses.py (divergence()), named here so the recipe loads without torch
LossName = Literal["forward_kl", "reverse_kl", "jsd", "tv", "lk_alpha", "lk_lambda"]


class DraftVocabSection(DraftSection):
    """The keys shared by the drafts that predict over the draft vocab with their own
    ``lm_head`` and are distilled from the target's distribution (eagle3, dflash, peagle): how
    that head starts, the divergence, and gradient checkpointing of the draft's layers."""

    init_lm_head_from_target: bool = Field(
        True, description="Start lm_head from the target lm_head's draft-vocab rows and norm from its final norm.")
    freeze_lm_head: bool = Field(
        False, description="Keep lm_head at the target's draft-vocab rows (needs init_lm_head_from_target); "
                           "halves the trainable parameters of a small-vocab draft, a regulariser on small data.")
    loss: LossName = Field(
        "forward_kl", description="Divergence between the target's distribution over the draft vocab and the "
        "draft's (train/losses.py): forward_kl (the anchors'), reverse_kl, jsd, tv (1 - acceptance rate), "
        "lk_alpha (-log acceptance rate) or lk_lambda (adaptive KL + (1 - acceptance)), the LK losses of "
        "arXiv:2602.23881.")
    lk_kl_scale: float = Field(1.0, ge=0, description="lk_lambda: KL weight at zero acceptance.")
    lk_kl_decay: float = Field(3.0, ge=0, description="lk_lambda: KL weight decays as exp(-lk_kl_decay * acceptance).")
    distill_temperature: float = Field(
        1.0, gt=0, description="The target's logits are divided by this before the softmax that gives the training "
        "distribution p (Hinton et al.'s distillation temperature, on the target side only; the draft's logits are "
        "not scaled). Below 1 sharpens p toward the target's argmax, the token greedy (T=0) verification accepts; "
        "1: the target's own distribution, the one vLLM samples from at T=1.")
    gradient_checkpointing: bool = Field(
        False, description="Recompute each draft decoder layer in backward (less activation memory, about one "
        "more forward of the layers per step; eagle3: per TTT step).")
    aux_noise_std: float = Field(
        0.0, ge=0, description="Training only: add Gaussian noise of this standard deviation (absolute, in the "
        "units of the target's hidden states) to the aux hidden states the draft reads, fresh every micro-batch; "
        "the target's distribution (labels) and validation see the clean states. 0: off. A regulariser against "
        "memorising a small set (the speculators trainer's --noise-std, there uniform in [-std, std]).")

    @model_validator(mode="after")
    def _frozen_head_is_initialised(self) -> "DraftVocabSection":
        if self.freeze_lm_head and not self.init_lm_head_from_target:
            raise ValueError("draft.freeze_lm_head needs draft.init_lm_head_from_target (a frozen random lm_head)")
        return self


#: the sliding window's unit (tokens): flex_attention's block size, so the windowed block mask
#: skips whole 128 x 128 tiles (a window of any other length leaves a third partial tile per row)
SLIDING_WINDOW_UNIT = 128


def sliding_window_problem(window: int | None, max_positions: int | None) -> str | None:
    """The one-line complaint about ``draft.sliding_window`` = ``window`` for a target whose
    context window is ``max_positions`` tokens (None: unknown, not checked), or None when it is
    fine (None = no window, every layer attends to the whole context)."""
    if window is None:
        return None
    if window <= 0 or window % SLIDING_WINDOW_UNIT:
        return (f"draft.sliding_window {window}: must be a positive multiple of {SLIDING_WINDOW_UNIT} tokens "
                "(flex_attention's block size)")
    if max_positions is not None and window > max_positions:
        return (f"draft.sliding_window {window} is larger than the target's context ({max_positions} tokens, "
                "max_position_embeddings): the window would never slide")
    return None


class SlidingWindowSection(BaseModel):
    """``draft.sliding_window`` (EAGLE-3 / 3.1 and the DFlash family): every draft attention layer
    sees only the last ``sliding_window`` positions of the context, as speculators 0.9 trains by
    default (2048) and vLLM serves from the export's ``sliding_window`` / ``layer_types``."""

    sliding_window: int | None = Field(
        None, description="Tokens each draft attention layer looks back over (a positive multiple of 128, at most "
        "the target's context); null: the whole context. A draft trained on short sequences then sees at long "
        "context the distances it was trained on (draftsmith long-context measures it).")

    @model_validator(mode="after")
    def _window_is_a_multiple(self):
        problem = sliding_window_problem(self.sliding_window, None)
        if problem:
            raise ValueError(problem)
        return self


#: the methods whose loss applies draft.accept_weighting (EAGLE-3's TTT loss, DFlash's dflash_loss,
#: DSpark's dspark_loss, XPress's xpress_loss, P-EAGLE's per-depth loss over its COD chains)
ACCEPT_WEIGHTING_METHODS = ("eagle3", "dflash", "dflash2", "dspark", "xpress", "peagle")
AcceptWeighting = Literal["none", "hard", "soft"]


def opd_unsupported(method: str | None) -> str:
    """The one line refusing ``draft.opd`` (the ``draftsmith opd`` stage) for draft.method ``method``."""
    return (f"draft.opd: on-policy distillation is not supported by draft.method {method} "
            f"(supported: {', '.join(OPD_METHODS)})")


def accept_weighting_field() -> Any:
    """The ``draft.accept_weighting`` field (declared by each section that takes it, beside its
    position decay)."""
    return Field(
        "none", description="Weight the loss of draft position k (eagle3: TTT step k; dflash, dflash2, xpress: block "
        "slot k; dspark: block slot k, the anchor's slot 0 included; peagle: depth k of a COD chain) by whether the chain "
        "reaches it at inference: a "
        "detached product over the positions j < k of the same chain of hard, [draft argmax == target argmax] (Spec-AUF's cut after the first miss, arXiv:2607.01893), or "
        "soft, the expected acceptance sum min(p_T, q_T) at the served temperature T = train.eval_temperatures[0] "
        "(null: eval.temperature; T = 0: hard). Unreached rows weigh 0 and still count in the normalisation. "
        "DSpark weights its CE and divergence terms, not the confidence head's BCE; XPress its three parts, by the "
        "teacher-forced refined logits' chain. none: the fixed position decay alone.")


#: the methods whose loss applies draft.opd (on-policy distillation's split, the same chains as
#: draft.accept_weighting): EAGLE-3's TTT steps, the block slots of DFlash / DFlash2 / DSpark / XPress, P-EAGLE's depths
OPD_METHODS = ACCEPT_WEIGHTING_METHODS
OpdSplit = Literal["none", "hard", "soft"]


def opd_field() -> Any:
    """The ``draft.opd`` field (declared beside ``draft.accept_weighting``)."""
    return Field(
        "none", description="On-policy distillation loss (Draft-OPD, arXiv:2605.29343; set by draftsmith opd): draft "
        "position k of a chain counts as accepted when the draft's own earlier positions of that chain were accepted "
        "(hard: argmax hits; soft: expected acceptance sum min(p_T, q_T) at the served T = "
        "train.eval_temperatures[0] or eval.temperature, a weight in [0, 1]). Accepted positions train on draft.loss (forward KL by default), the others on reverse "
        "KL(q || p) weighted opd_gamma**k (dspark: in place of its divergence term, at distill_weight; xpress: of "
        "each part's divergence terms, at their summed loss_weights). none: off. Not with draft.accept_weighting.")


def opd_gamma_field() -> Any:
    """The ``draft.opd_gamma`` field."""
    return Field(0.8, gt=0, le=1, description="draft.opd: the rejected positions' reverse KL at draft position k "
                 "(0-based) weighs opd_gamma**k, on top of the method's position weight.")


class AcceptWeightingSection(BaseModel):
    """The check of ``draft.accept_weighting`` (:func:`accept_weighting_field`; EAGLE-3's TTT steps,
    the DFlash family's block slots, P-EAGLE's depths): the loss of a later draft position weighted by whether the
    draft's own earlier positions of the same chain would have been accepted (docs/training.md,
    "Acceptance-aware loss"). A section of a method not in :data:`ACCEPT_WEIGHTING_METHODS` that
    inherits the key (a method built on DFlash whose loss does not apply it) refuses any value but ``none``."""

    @model_validator(mode="after")
    def _accept_weighting_method(self):
        method = getattr(self, "method", None)
        if self.accept_weighting != "none" and method not in ACCEPT_WEIGHTING_METHODS:
            raise ValueError(f"draft.accept_weighting: {self.accept_weighting} is not supported by draft.method "
                             f"{method} (supported: {', '.join(ACCEPT_WEIGHTING_METHODS)})")
        opd = getattr(self, "opd", "none")
        if opd != "none" and method not in OPD_METHODS:
            raise ValueError(opd_unsupported(method))
        if opd != "none" and self.accept_weighting != "none":
            raise ValueError(f"draft.opd={opd} and draft.accept_weighting={self.accept_weighting}: on-policy "
                             "distillation splits the positions itself; set draft.accept_weighting=none")
        return self


class HeadsSection(DraftSection):
    """The key shared by the drafts of several heads trained on hard labels (medusa,
    mlp_speculator): the loss weight of later heads."""

    head_decay: float = Field(
        0.8, gt=0, le=1, description="Loss weight head_decay**k of head k (mlp_speculator: stage k; Medusa: 0.8).")
