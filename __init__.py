"""draftsmith: train speculative-decoding draft models (EAGLE-3 / 3.1, Medusa, MLP speculator, DFlash,
DFlash2, DSpark, XPress, P-EAGLE; one package each under models/, registered in :mod:`draftsmith.methods`)
for vLLM."""

__version__ = "0.2.0"
