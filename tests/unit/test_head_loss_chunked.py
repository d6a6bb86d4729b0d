"""Medusa heads / MLP-speculator stages: the chunked per-head cross-entropy computed inside the
model's forward (``HeadMethod.compute_loss``) equals the unchunked reference
(:func:`~draftsmith.train.losses.head_loss` on the ``(K, M, V)`` logits) in value, metrics and
gradients; the batch plan is computed on the CPU and picklable; a planned step reads nothing
back from the device and never holds more than one chunk of ``(rows, V)`` logits."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from draftsmith.models.medusa.model import MedusaConfig, MedusaModel
from draftsmith.models.mlp_speculator.model import MLPSpeculator, MLPSpeculatorConfig
from draftsmith.train.labels import head_targets

from helpers.reference_losses import head_loss
from draftsmith.models.medusa.training import MedusaMethod
from draftsmith.models.mlp_speculator.training import MLPSpeculatorMethod

H, V, K = 16, 40, 3  # H != V and D != V: only logits (and their gradients) have V as last dim
DECAY = 0.7


def make_method(kind: str, chunk: int | None = 5, **cfg):
    """A head method without a run directory: what compute_loss reads, set by hand."""
    cls = MedusaMethod if kind == "medusa" else MLPSpeculatorMethod
    method = object.__new__(cls)
    method.recipe = SimpleNamespace(train=SimpleNamespace(loss_chunk_rows=chunk),
                                    draft=SimpleNamespace(head_decay=DECAY, stage2_start_step=None))
    method.accelerator, method.num_heads, method.step = None, K, 0
    if kind == "medusa":
        method.config = MedusaConfig(hidden_size=H, vocab_size=V, num_heads=K, num_layers=2)
    else:
        method.config = MLPSpeculatorConfig(emb_dim=H, inner_dim=24, vocab_size=V, n_predict=K, **cfg)
    return method


def make_model(method) -> torch.nn.Module:
    torch.manual_seed(0)
    if isinstance(method, MedusaMethod):
        model = MedusaModel(method.config)
        with torch.no_grad():  # ResBlocks start as the identity: make them matter
            for p in model.blocks.parameters():
                p.normal_(0, 0.3)
    else:
        model = MLPSpeculator(method.config)
    return model.train()


def make_batch(B: int = 3, T: int = 14, packed: bool = False, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) < 0.6).long()
    mask[:, :2] = 0  # a prompt
    mask[-1, T - 3:] = 0  # padding
    batch = {"input_ids": ids, "loss_mask": mask, "attention_mask": torch.ones_like(ids),
             "aux_hidden_states": torch.zeros(B, T, 3 * H),
             "final_hidden_states": torch.randn(B, T, H, generator=g)}
    if packed:  # two documents per row
        batch["document_ids"] = (torch.arange(T) >= T // 2).long().expand(B, T).contiguous()
    return batch


def reference(method, model, batch, denominators=None):
    """The unchunked path: gather, (K, M, V) logits, head_loss (what compute_loss did before)."""
    t = head_targets(batch["input_ids"], batch["loss_mask"], K, batch.get("document_ids"))
    final = batch["final_hidden_states"][t.positions].unsqueeze(1)  # (M, 1, H)
    if isinstance(method, MedusaMethod):
        logits = model(final).squeeze(2)
    else:
        logits = model(final, t.tokens[:, : K + 1]).squeeze(2)
    return head_loss(logits, t.labels, t.label_mask, DECAY, denominators)


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


CASES = [("medusa", {}), ("mlp", {}), ("mlp", {"tie_weights": True, "scale_input": True})]


@pytest.mark.parametrize("kind,cfg", CASES)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("planned", [False, True])
@pytest.mark.parametrize("chunk", [None, 4])
def test_chunked_head_loss_equals_the_reference(kind, cfg, packed, planned, chunk):
    method = make_method(kind, chunk, **cfg)
    model = make_model(method)
    batch = make_batch(packed=packed)
    want, m = reference(method, model, batch)
    want.backward()
    want_grads = grads(model)
    if planned:
        batch = method.batch_plan()(batch)
        assert isinstance(batch["head_rows"], int) and isinstance(batch["head_counts"], list)
        assert batch["head_counts"] == m.tokens
    loss, metrics = method.compute_loss(model, batch)
    loss.backward()
    got_grads = grads(model)
    if kind == "mlp":
        assert metrics.pop("stage") == 1.0  # a host number
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    assert set(got_grads) == set(want_grads) and len(got_grads) == len(list(model.parameters()))
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in metrics.values())
    assert set(metrics) == {"loss"} | {f"{s}_{k}" for s in ("loss", "acc") for k in range(K)}
    for k in range(K):
        assert metrics[f"loss_{k}"].item() == pytest.approx(m.loss[k], rel=1e-5, abs=1e-6)
        assert metrics[f"acc_{k}"].item() == pytest.approx(m.acc[k], abs=1e-6)


@pytest.mark.parametrize("kind", ["medusa", "mlp"])
def test_data_parallel_denominators_replace_the_local_counts(kind):
    method = make_method(kind)
    model = make_model(method)
    batch = make_batch()
    t = head_targets(batch["input_ids"], batch["loss_mask"], K)
    denominators = t.label_mask.sum(1).float() * 2.0 + 1.0  # as if other ranks had more tokens
    want, m = reference(method, model, batch, denominators)
    want.backward()
    want_grads = grads(model)
    seen = []

    def global_denominators(counts):
        seen.append(counts.clone())
        return denominators

    method.global_denominators = global_denominators
    loss, metrics = method.compute_loss(model, method.batch_plan()(batch))
    loss.backward()
    torch.testing.assert_close(seen[0], t.label_mask.sum(1).float())
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for name, g in grads(model).items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    assert metrics["loss_1"].item() == pytest.approx(m.loss[1], rel=1e-5)


@pytest.mark.parametrize("kind", ["medusa", "mlp"])
def test_a_batch_without_labels_gives_zero_and_reaches_every_head(kind):
    method = make_method(kind)
    model = make_model(method)
    batch = make_batch()
    batch["loss_mask"].zero_()
    plan = method.batch_plan()(batch)
    assert plan["head_rows"] == 0 and plan["head_counts"] == [0] * K
    loss, metrics = method.compute_loss(model, plan)
    loss.backward()
    metrics.pop("stage", None)
    assert loss.item() == 0.0 and all(v.item() == 0.0 for v in metrics.values())
    heads = model.lm_heads if kind == "medusa" else model.head
    # DDP needs a gradient (here zero) for every head's weights, even without a position
    assert all(h.weight.grad is not None and not h.weight.grad.any() for h in heads)


def test_plan_is_picklable_cpu_and_matches_head_targets():
    method = make_method("mlp")
    plan_fn = pickle.loads(pickle.dumps(method.batch_plan()))
    batch = make_batch(packed=True)
    plan = plan_fn(batch)
    t = head_targets(batch["input_ids"], batch["loss_mask"], K, batch["document_ids"])
    assert plan["input_ids"] is batch["input_ids"]  # the batch travels on with its plan
    assert plan["head_index"].dtype == torch.int64 and plan["head_index"].device.type == "cpu"
    assert plan["head_index"].tolist() == t.positions.flatten().nonzero().squeeze(1).tolist()
    assert torch.equal(plan["head_tokens"], t.tokens) and torch.equal(plan["head_labels"], t.labels)
    assert torch.equal(plan["head_label_mask"], t.label_mask)
    assert plan["head_rows"] == int(t.positions.sum()) and plan["head_counts"] == t.label_mask.sum(1).tolist()


# .item() / float() / int() / bool() / .tolist() of a scalar dispatch _local_scalar_dense;
# x[mask] dispatches index (or index_put_) with a bool index, which reads the count back
SYNCING = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
           "aten._unique2.default", "aten.unique_consecutive.default"}


WEIGHT_T = {(H, V), (24, V)}  # lm_head.weight.t(): H (Medusa) or D = 24 (MLP speculator) rows


class Watch(TorchDispatchMode):
    """Records host-reading ops and the largest tensor whose last dim is V: logits and their
    gradients (weights are (V, H) / (V, D), embeddings' gradients (V, D); the transposed weights
    (H, V) / (D, V) that linear dispatches are skipped)."""

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []
        self.largest_v = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        bool_index = name.startswith(("aten.index.", "aten.index_put")) and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] if i is not None)
        if name in SYNCING or bool_index:
            self.syncs.append(name)
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == V and tuple(t.shape) not in WEIGHT_T:
                self.largest_v = max(self.largest_v, t.numel())
        return out


@pytest.mark.parametrize("kind", ["medusa", "mlp"])
def test_a_planned_step_reads_nothing_back_and_keeps_one_chunk_of_logits(kind):
    chunk = 4
    method = make_method(kind, chunk)
    model = make_model(method)
    batch = method.batch_plan()(make_batch(B=4, T=24, packed=True))
    M = batch["head_rows"]
    assert M > 4 * chunk  # several chunks per head
    mode = Watch()
    with mode:
        loss, metrics = method.compute_loss(model, batch)
        loss.backward()
    assert mode.syncs == []
    assert 0 < mode.largest_v <= chunk * V  # one (chunk, V) tensor at a time
    ref = Watch()
    with ref:
        want, _ = reference(method, model, batch)
        want.backward()
    assert ref.largest_v >= K * M * V  # the reference builds every head's logits at once
