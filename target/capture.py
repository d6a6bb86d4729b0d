"""Target hidden-state capture: forward pre-hooks on the aux layers, and the capture engines.

Capture follows vLLM's EAGLE-3 convention: aux id ``L`` is the
residual stream *after L decoder layers*, i.e. the input of decoder layer ``L`` (``L=0``
is the embedding output); it is taken with a forward pre-hook on ``layers[L]``, which works
for any decoder stack (Llama, Qwen, gpt-oss). The final state is the base model's
``last_hidden_state`` (after the final norm); the target ``lm_head`` is never run.
``target/vllm_capture.py`` is the second capture engine (vLLM); both are run by
:func:`draftsmith.data_prep.hidden_states.generate_hidden_states`.
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol

import torch


def decoder_layers(model: Any) -> torch.nn.ModuleList:
    """The decoder layer list of a transformers causal LM (``model.model.layers``)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find decoder layers on {type(model).__name__}")
    return layers


class AuxHiddenStateCapture:
    """Context manager: pre-hooks on the aux layers record their input hidden states.

    ``captured[L]`` is ``(B, T, H)`` after a forward pass.
    """

    def __init__(self, model: Any, layer_ids: list[int]):
        self.layers = decoder_layers(model)
        self.layer_ids = list(layer_ids)
        self.captured: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> "AuxHiddenStateCapture":
        for L in self.layer_ids:
            def hook(module, args, kwargs, L=L):
                self.captured[L] = args[0] if args else kwargs["hidden_states"]

            self._handles.append(self.layers[L].register_forward_pre_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


@torch.no_grad()  # not inference_mode: online training feeds these tensors to autograd
def capture_batch(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target's base model once.

    Args:
        input_ids / attention_mask: ``(B, T)``, right-padded.
        layer_ids: three ascending aux ids.

    Returns:
        ``(aux (B, T, 3H), final (B, T, H))``.
    """
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    with AuxHiddenStateCapture(model, layer_ids) as cap:
        out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    aux = torch.cat([cap.captured[L] for L in layer_ids], dim=-1)
    return aux, out.last_hidden_state


class CaptureEngine(Protocol):
    """What ``generate_hidden_states`` runs: yields ``(j, aux (T_j, 3H), final (T_j, H))`` once
    for every record ``j`` of ``records`` (any order; the shard stores them in that order), for
    the layer ids the engine was built with, in any float dtype and on any device: the shard
    writer encodes them on that device and copies them to the host on its own thread, while the
    engine computes the next batch. Yielding per sequence lets the writer stream each one to
    disk at once, so no shard is ever assembled in memory. An engine may have ``close()``
    (release GPUs, stop workers); ``generate_hidden_states`` calls it when it is done."""

    name: str

    def capture(self, records: list[dict]) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]: ...


class TransformersCapture:
    """The transformers engine: ``capture_batch`` over length-sorted batches of at most
    ``batch_tokens`` padded tokens; yields each record's rows of the batch, on the model's
    device (views: the batch stays alive until the writer has copied its rows)."""

    name = "transformers"

    def __init__(self, model: Any, layer_ids: list[int], batch_tokens: int = 4096):
        self.model, self.layer_ids, self.batch_tokens = model, list(layer_ids), batch_tokens

    def capture(self, records: list[dict]) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        device = next(self.model.parameters()).device
        for batch in _length_batches(records, self.batch_tokens):
            T = max(len(records[j]["input_ids"]) for j in batch)
            ids = torch.zeros(len(batch), T, dtype=torch.long)
            att = torch.zeros(len(batch), T, dtype=torch.long)
            for b, j in enumerate(batch):
                n = len(records[j]["input_ids"])
                ids[b, :n] = torch.tensor(records[j]["input_ids"])
                att[b, :n] = 1
            aux, fin = capture_batch(self.model, ids.to(device), att.to(device), self.layer_ids)
            for b, j in enumerate(batch):
                n = len(records[j]["input_ids"])
                yield j, aux[b, :n], fin[b, :n]


class LazyCapture:
    """A ``CaptureEngine`` built by ``factory()`` on the first ``capture`` call, so a rerun with
    every shard on disk never loads the target (or starts vLLM)."""

    def __init__(self, name: str, factory: Any):
        self.name, self._factory, self._engine = name, factory, None

    def capture(self, records: list[dict]) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        if self._engine is None:
            self._engine = self._factory()
        yield from self._engine.capture(records)

    def close(self) -> None:
        """Close the built engine, if any and if it has ``close()``; idempotent."""
        engine, self._engine = self._engine, None
        close = getattr(engine, "close", None)
        if close is not None:
            close()


def _length_batches(chunk: list[dict], batch_tokens: int) -> Iterator[list[int]]:
    order = sorted(range(len(chunk)), key=lambda j: len(chunk[j]["input_ids"]))
    batch: list[int] = []
    for j in order:
        T = len(chunk[j]["input_ids"])
        if batch and T * (len(batch) + 1) > batch_tokens:
            yield batch
            batch = []
        batch.append(j)
    if batch:
        yield batch
