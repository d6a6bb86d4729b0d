"""Where the transformers target runs: ``load_target(..., device)`` and the default device of
a process (``target.default_device``). CPU only; accelerators are simulated."""

from __future__ import annotations

import torch
from accelerate import PartialState

from draftsmith import target as tgt


def test_load_target_places_the_parameters_on_the_device(tiny_target):
    model, _ = tgt.load_target(tiny_target, device="cpu")
    assert {p.device for p in model.parameters()} == {torch.device("cpu")}
    assert model.device == torch.device("cpu")


def test_the_default_device_is_this_processs_accelerator(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert tgt.default_device(None) == PartialState().device
    assert tgt.default_device("cpu") == torch.device("cpu")
    assert tgt.default_device("cuda:3") == torch.device("cuda", 3)  # named devices are taken as given


def _fake_accelerator(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: count)


def test_a_rank_of_a_multi_process_job_gets_its_local_device_without_joining_the_rendezvous(monkeypatch):
    # accelerate's state not created yet: PartialState() would block until every rank joins
    def join(*args, **kwargs):
        raise AssertionError("PartialState() called: this rank would wait for the others")

    monkeypatch.setattr(PartialState, "_shared_state", {})
    monkeypatch.setattr(PartialState, "__init__", join)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    _fake_accelerator(monkeypatch, count=8)
    assert tgt.default_device(None) == torch.device("cuda", 5)
    _fake_accelerator(monkeypatch, count=1)  # one visible GPU per process (CUDA_VISIBLE_DEVICES)
    assert tgt.default_device(None) == torch.device("cuda", 0)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    assert tgt.default_device(None) == torch.device("cpu")
