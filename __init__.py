"""draftsmith: train speculative-decoding draft models (EAGLE-3, Medusa, MLP speculator) for vLLM."""

__version__ = "0.2.0"
