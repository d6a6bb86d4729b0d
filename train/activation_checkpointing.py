"""Activation checkpointing applied to a draft from outside (``draft.gradient_checkpointing``).

:func:`apply_activation_checkpointing` wraps each block of ``model.layers`` (torchtitan's
``apply_ac``, per block): a wrapped block keeps only its inputs for backward and runs its forward
again there (``torch.utils.checkpoint``, non-reentrant). Same loss and gradients, less activation
memory (the attention and MLP intermediates of every block call: all K TTT steps of EAGLE-3,
every layer of DFlash and P-EAGLE), about one more block forward per call in time. Without
gradients (validation, inference) a wrapped block runs plainly.

The wrapper (``torch.distributed``'s ``checkpoint_wrapper``) keeps the block's state-dict keys
(``layers.0.self_attn...``), so checkpoints, export and resume see the same tensors, and forwards
attribute access to the block (``forward_cached``, ``self_attn``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def _checkpoint_with_grad(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    if torch.is_grad_enabled():
        return checkpoint(module, *args, use_reentrant=False, **kwargs)
    return module(*args, **kwargs)


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Wrap every block of ``model.layers`` (an ``nn.ModuleList``) in place; returns ``model``.

    Call it before ``accelerator.prepare`` (FSDP then shards the blocks inside the wrappers).

    Raises:
        TypeError: ``model`` has no ``layers`` ``ModuleList`` (Medusa heads, MLP speculator).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper

    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no `layers` ModuleList of blocks to checkpoint")
    for i, block in enumerate(layers):
        if not isinstance(block, CheckpointWrapper):
            layers[i] = checkpoint_wrapper(block, checkpoint_fn=_checkpoint_with_grad)
    return model


def apply_recipe_checkpointing(model: nn.Module, draft_config: Any) -> nn.Module:
    """:func:`apply_activation_checkpointing` when the recipe's draft section asks for it
    (``draft.gradient_checkpointing``; the sections without the key, Medusa's and the MLP
    speculator's, never do). The trainer and the memory benchmarks build the draft through this
    one rule. Returns ``model``."""
    if getattr(draft_config, "gradient_checkpointing", False):
        apply_activation_checkpointing(model)
    return model
