"""The parts of the training loop (:mod:`draftsmith.train.trainer`) that are not the loop itself:
optimizers and schedule (:mod:`.optimizer`), metrics and trackers (:mod:`.metrics`), the
non-finite guard (:mod:`.nonfinite`), the time-budget clock (:mod:`.clock`)."""
