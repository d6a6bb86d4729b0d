"""The time-budget learning-rate schedule: warmup, then cosine over the budget's progress."""

from __future__ import annotations

import pytest
from draftsmith.train.components.optimizer import budget_lr_factor


def test_budget_schedule_is_warmup_then_cosine_over_progress():
    assert budget_lr_factor(0.0, 0.1, 0.0) == 0.0
    assert budget_lr_factor(0.05, 0.1, 0.0) == pytest.approx(0.5)
    assert budget_lr_factor(0.1, 0.1, 0.0) == pytest.approx(1.0)
    assert budget_lr_factor(0.55, 0.1, 0.0) == pytest.approx(0.5)  # half-way through the cosine
    assert budget_lr_factor(1.0, 0.1, 0.2) == pytest.approx(0.2)  # ends at min_lr_ratio
    assert budget_lr_factor(3.0, 0.0, 0.0) == pytest.approx(0.0)  # past the budget: clamped
