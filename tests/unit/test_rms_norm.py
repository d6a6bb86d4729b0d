"""models.common.RMSNorm: transformers' LlamaRMSNorm through torch's rms_norm (one fused kernel on
CUDA), with the same values, gradients, dtype promotion and state-dict keys."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from draftsmith.models.common import RMSNorm
from draftsmith.models.eagle3.model import Eagle3DraftModel
from helpers.tiny import eagle3_tiny_config


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                             (torch.bfloat16, torch.bfloat16)])
def test_rms_norm_equals_llamas_values_gradients_and_dtype(x_dtype, w_dtype):
    torch.manual_seed(0)
    ref, ours = LlamaRMSNorm(48, eps=1e-5).to(w_dtype), RMSNorm(48, eps=1e-5).to(w_dtype)
    with torch.no_grad():
        ref.weight.normal_()
    ours.load_state_dict(ref.state_dict())
    x = (3 * torch.randn(2, 5, 48)).to(x_dtype).requires_grad_()
    outs, grads = [], []
    for norm in (ref, ours):
        y = norm(x)
        outs.append(y)
        grads.append(torch.autograd.grad(y.float().square().sum(), [x, norm.weight]))
    assert outs[0].dtype == outs[1].dtype  # bf16 input, fp32 weight -> fp32, as under autocast
    # on the CPU torch decomposes rms_norm into the same ops: bit for bit
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_every_draft_norm_is_the_fused_one():
    """The export keys are checked by test_export_formats; here that no norm of a draft with
    attention is left on transformers' written-out form."""
    model = Eagle3DraftModel(eagle3_tiny_config())
    norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
    assert len(norms) >= 4 and all(type(m) is RMSNorm for m in norms)
