"""``draft.aux_noise_std``: Gaussian noise on the aux hidden states the draft reads in training
(``TargetDataMethod.training_states``), never on the target's states (the labels). The
validation path with the noise on: tests/integration/test_aux_noise_training.py."""

from __future__ import annotations

import pytest
import torch

from draftsmith.models.dflash.recipe import DFlashDraftConfig
from draftsmith.models.eagle3.recipe import Eagle3DraftConfig
from draftsmith.models.peagle.recipe import PEagleDraftConfig
from draftsmith.models.eagle3.training import Eagle3Method
from draftsmith.models.peagle.training import PEagleMethod


class _Recipe:  # the one recipe key training_states reads
    def __init__(self, std: float):
        self.draft = Eagle3DraftConfig(aux_noise_std=std)


def _method(cls, std: float):
    method = cls.__new__(cls)  # no run directory: training_states needs only the recipe and the batch
    method.recipe = _Recipe(std)
    return method


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"aux_hidden_states": (torch.randn(2, 64, 3 * 32, generator=g) * 4).to(torch.bfloat16),
            "final_hidden_states": torch.randn(2, 64, 32, generator=g).to(torch.bfloat16)}


def test_default_is_off_for_every_draft_vocab_method():
    for section in (Eagle3DraftConfig, DFlashDraftConfig, PEagleDraftConfig):
        assert section().aux_noise_std == 0.0
    with pytest.raises(ValueError, match="aux_noise_std"):
        Eagle3DraftConfig(aux_noise_std=-0.1)


@pytest.mark.parametrize("cls", [Eagle3Method, PEagleMethod])
def test_off_hands_the_draft_the_stored_states_unchanged(cls):
    model = torch.nn.Linear(3, 3)
    batch = _batch()
    rng = torch.get_rng_state()
    aux, final = _method(cls, 0.0).training_states(model, batch)
    assert torch.equal(torch.get_rng_state(), rng)  # off draws nothing: the run is the same as before the key
    assert aux.dtype == torch.float32 and torch.equal(aux, batch["aux_hidden_states"].float())
    assert final is batch["final_hidden_states"]


@pytest.mark.parametrize("std", [0.05, 0.5])
def test_on_perturbs_the_draft_input_by_the_set_std_and_not_the_target(std):
    model = torch.nn.Linear(3, 3)
    batch = _batch()
    clean = batch["aux_hidden_states"].float()
    method = _method(Eagle3Method, std)
    aux, final = method.training_states(model, batch)
    noise = aux - clean
    assert noise.std().item() == pytest.approx(std, rel=0.03)
    assert abs(noise.mean().item()) < 5 * std / noise.numel() ** 0.5  # zero mean, within 5 standard errors
    assert final is batch["final_hidden_states"]  # the labels come from the clean final states
    assert torch.equal(batch["aux_hidden_states"].float(), clean)  # the batch itself is not modified
    again, _ = method.training_states(model, batch)
    assert not torch.equal(again, aux)  # fresh noise every call
    torch.manual_seed(7)
    a, _ = method.training_states(model, batch)
    torch.manual_seed(7)
    b, _ = method.training_states(model, batch)
    assert torch.equal(a, b)  # drawn from torch's seeded generator: a seeded run is reproducible
