"""XPress against its references, on one draftsmith export of a tiny draft for the tiny target:

- speculators 0.9.0 loads the export (``XPressDraftModel.from_pretrained`` with the export's
  ``speculators_config.json`` and its key mapping): every tensor arrives under speculators' name,
  and speculators' own refiner gives the same refined logits, the same Jacobi tokens pass by pass
  and the same loss (its ``compute_metrics`` with ``{"ce": 0.1, "tv": 0.9}``) on the same inputs,
  within fp32 tolerance;
- vLLM 0.33.0's ``qwen3_xpress.py`` (its sources, read, not installed): the refiner tensors its
  ``load_weights`` maps and the config keys it reads are the export's, and its ``XPressRefinerHead``
  (torch only: the Triton kernels are not called) built from the export computes the same bias.

The maxima of the absolute differences are printed (``pytest -s``).
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from draftsmith.eval.export import export
from draftsmith.models.dflash.training import block_labels, slot_weights
from draftsmith.models.xpress.config import XPressConfig
from draftsmith.models.xpress.format import SPECULATORS_CONFIG, SPECULATORS_KEY_MAPPING, load_xpress
from draftsmith.models.xpress.model import XPressDraftModel
from draftsmith.models.xpress.training import XPressLossSpec, xpress_loss
from draftsmith.train.losses import TargetDraftHead

from helpers.tiny import write_draft_checkpoint

BK, RANK = 5, 8
SPEC = XPressLossSpec()  # speculators' defaults: {"ce": 0.1, "tv": 0.9}, 0.3 x 3 rounds, 0.6 drafter term
GAMMA = 4.0

SPECULATORS_SIDE = r'''
import json, sys
import torch
from safetensors.torch import load_file, save_file
from speculators.losses import resolve_loss_config
from speculators.models.xpress import XPressDraftModel, XPressSpeculatorConfig
from speculators.models.xpress.metrics import compute_metrics

export, io, passes, gamma, cw, rounds, bw = sys.argv[1:8]
raw = json.load(open(f"{export}/speculators_config.json"))
model = XPressDraftModel.from_pretrained(export, config=XPressSpeculatorConfig(**raw),
                                         key_mapping=raw["draftsmith"]["key_mapping"]).eval()
x = load_file(f"{io}/inputs.safetensors")
out = {f"state.{k}": v.contiguous() for k, v in model.state_dict().items()}
head = model.refiner_head
# from_pretrained builds the model without running the constructor's buffer init, so the refiner's
# non-persistent causal_tril may hold garbage (it does under transformers 5.19): give it the value
# XPressRefinerHead.__init__ gives it
tril = torch.tril(torch.ones(model.block_size, model.block_size))
out["causal_tril_was_intact"] = torch.tensor([bool(torch.equal(head.causal_tril, tril))])
head.causal_tril.copy_(tril)
with torch.no_grad():
    # the refiner on given pre-norm block states and predecessors
    hidden = model.norm(x["hidden"])
    base = model.lm_head(hidden)
    hcache = head.hidden_cache(hidden)
    out["refined"] = base + head.block_bias(x["prev"], hcache=hcache)
    # the Jacobi recurrence of the consistency rounds: slot 0 the anchor, prev = [before, pred[:-1]]
    before, anchor, pred = x["prev"][:, :1], x["prev"][:, 1:2], base.argmax(-1)
    for j in range(int(passes) + 1):
        out[f"jacobi.{j}"] = pred[:, 1:].clone()
        pred[:, :1] = anchor
        pred = (base + head.block_bias(torch.cat([before, pred[:, :-1]], 1), hcache=hcache)).argmax(-1)

    # the loss of anchor blocks: one packed row, anchors given, block states from draftsmith's drafter
    ids, docs, anchors = x["input_ids"], x["document_ids"], x["anchors"]
    A, B = anchors.shape[0], x["blocks"].shape[1]
    pos = (anchors[:, None] + torch.arange(B)).clamp(max=ids.shape[1] - 1)
    tokens = ids[0, pos]
    am1_pos = (anchors - 1).clamp(min=0)
    am1_ok = (anchors > 0) & (docs[0, am1_pos] == docs[0, anchors])
    am1 = torch.where(am1_ok, ids[0, am1_pos], tokens[:, 0])[:, None]
    hidden = model.norm(x["blocks"])
    base = model.lm_head(hidden)
    hcache = head.hidden_cache(hidden)
    tf = (base + head.block_bias(torch.cat([am1, tokens[:, :-1]], 1), hcache=hcache)).view(1, A * B, -1)
    rounds_out, pred = [], base.argmax(-1)
    for _ in range(int(rounds)):
        pred[:, :1] = tokens[:, :1]
        refined = base + head.block_bias(torch.cat([am1, pred[:, :-1]], 1), hcache=hcache)
        rounds_out.append(refined.view(1, A * B, -1))
        pred = refined.argmax(-1)
    loss, metrics = compute_metrics(tf, rounds_out, base.view(1, A * B, -1), x["targets"][None], x["loss_mask"][None],
                                    B, loss_config=resolve_loss_config('{"ce": 0.1, "tv": 0.9}', "eager"),
                                    gamma=float(gamma), consistency_weight=float(cw), base_anchor_weight=float(bw))
    out["loss"] = loss.reshape(1)
    for key in ("tf_loss_sum", "consistency_loss_sum", "base_anchor_loss_sum", "ce_loss_sum", "tv_loss_sum"):
        out[key] = metrics[key].reshape(1).float()
save_file(out, f"{io}/speculators.safetensors")
print(type(model).__name__)
'''


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


@pytest.fixture(scope="module")
def draft(tiny_target, tmp_path_factory) -> tuple[Path, XPressDraftModel, nn.Module]:
    """``(export, the export loaded by draftsmith, the target)``: a random XPress draft for the tiny
    target (its embedding, lm_head and final norm, as training starts it), the refiner large enough
    to change the drafted tokens."""
    from transformers import AutoModelForCausalLM

    where = tmp_path_factory.mktemp("xpress")
    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    tc = target.config
    cfg = XPressConfig.from_target(tc, tc.vocab_size, [1, 3, 4], 1, BK, 3, xpress_rank=RANK, xpress_mlp_ratio=2,
                                   num_jacobi_passes=BK - 1, xpress_topc=0)
    torch.manual_seed(0)
    model = XPressDraftModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
        model.init_from_target(target.get_input_embeddings().weight, target.lm_head.weight, target.model.norm.weight)
        V = cfg.vocab_size
        model.set_vocab_mapping(torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    write_draft_checkpoint(model, where / "ckpt", "xpress", {"name_or_path": str(tiny_target), "path": str(tiny_target),
                                                            "architectures": ["LlamaForCausalLM"]})
    out = export(where / "ckpt", where / "export", dtype="float32")
    return out, load_xpress(out, target.get_input_embeddings().weight.detach()), target


@pytest.fixture(scope="module")
def compared(draft, in_speculators, tmp_path_factory):
    """Draftsmith's side computed here and speculators' in its environment, on the same inputs."""
    out, model, target = draft
    cfg = model.config
    io = tmp_path_factory.mktemp("io")
    g = torch.Generator().manual_seed(1)
    T = 28
    ids = torch.randint(10, cfg.vocab_size, (1, T), generator=g)
    docs = torch.tensor([[0] * 12 + [1] * (T - 12)])
    mask = torch.ones(1, T, dtype=torch.long)
    mask[0, :2] = 0
    mask[0, -3:] = 0
    anchors = torch.tensor([[2, 7, 12, 16, 20]])  # 12 starts the second document
    valid = torch.ones_like(anchors, dtype=torch.bool)
    aux = torch.randn(1, T, 3 * cfg.target_hidden_size, generator=g)
    final = torch.randn(1, T, cfg.hidden_size, generator=g)
    head = TargetDraftHead(target.lm_head.weight.detach())
    weights = slot_weights(BK, GAMMA)
    with torch.no_grad():
        total, metrics = xpress_loss(model, ids, aux, final, mask, anchors, valid, head, weights, SPEC,
                                     document_ids=docs)
        blocks = model.block_hidden(ids, aux, anchors, valid, document_ids=docs)[0]  # (A, Bk, H)
    pos, lab = block_labels(anchors, valid, mask, BK, docs)
    targets = head(final[0, (pos[0] - 1).clamp_min(0)]).reshape(-1, cfg.vocab_size)  # p_{a+k-1}
    hidden = torch.randn(3, BK, cfg.hidden_size, generator=g)
    prev = torch.randint(0, cfg.vocab_size, (3, BK), generator=g)
    save_file({"hidden": hidden, "prev": prev, "input_ids": ids, "document_ids": docs, "anchors": anchors[0],
               "blocks": blocks.contiguous(), "targets": targets, "loss_mask": lab[0].reshape(-1).float()},
              str(io / "inputs.safetensors"))
    printed = in_speculators(SPECULATORS_SIDE, str(out), str(io), str(BK), str(GAMMA), str(SPEC.consistency_weight),
                             str(SPEC.rounds), str(SPEC.base_anchor_weight))
    assert printed.strip().splitlines()[-1] == "XPressDraftModel"
    theirs = load_file(str(io / "speculators.safetensors"))
    if not bool(theirs["causal_tril_was_intact"]):
        print("speculators: XPressDraftModel.from_pretrained left refiner_head.causal_tril uninitialised (reset)")
    return {"theirs": theirs, "hidden": hidden, "prev": prev, "total": total, "metrics": metrics}


def test_speculators_loads_every_exported_tensor_under_its_own_name(draft, compared):
    out, _, target = draft
    theirs = compared["theirs"]
    for name, tensor in load_file(str(out / "model.safetensors")).items():
        mapped = name
        for pattern, replacement in SPECULATORS_KEY_MAPPING.items():
            mapped, hit = re.subn(pattern, replacement, name)
            if hit:
                break
        assert torch.equal(theirs[f"state.{mapped}"], tensor), name
    # the drafter's lm_head and embedding, which speculators reloads from the verifier, are the target's
    assert torch.equal(theirs["state.lm_head.weight"], target.lm_head.weight.detach())
    assert torch.equal(theirs["state.embed_tokens.weight"], target.get_input_embeddings().weight.detach())


def test_refined_logits_equal_speculators(draft, compared):
    _, model, _ = draft
    with torch.no_grad():
        ours = model.refined_logits(compared["hidden"], compared["prev"])
    diff = maxdiff(ours, compared["theirs"]["refined"])
    print(f"xpress refined logits: max |draftsmith - speculators| = {diff:.3g}")
    torch.testing.assert_close(ours, compared["theirs"]["refined"], rtol=1e-5, atol=1e-5)


def test_each_jacobi_pass_drafts_speculators_tokens(draft, compared):
    _, model, _ = draft
    hidden, prev = compared["hidden"], compared["prev"]
    head = model.xpress_head
    with torch.no_grad():
        normed = model.norm(hidden)
        base, hcache = model.lm_head(normed), head.hidden_cache(normed)
        passes = [head.jacobi(base, hcache, prev[:, 1], prev[:, 0], k) for k in range(BK + 1)]
    for k, ours in enumerate(passes):
        assert torch.equal(ours, compared["theirs"][f"jacobi.{k}"]), k
    assert not torch.equal(passes[0], passes[-1])  # the refiner changes the drafter's tokens
    assert torch.equal(passes[BK - 1], passes[BK])  # Bk-1 passes settle the block


def test_the_loss_equals_speculators_compute_metrics(compared):
    theirs, metrics = compared["theirs"], compared["metrics"]
    pairs = {"loss": ("loss", compared["total"]), "tf_loss": ("tf_loss_sum", metrics["tf_loss"]),
             "consistency_loss": ("consistency_loss_sum", metrics["consistency_loss"]),
             "base_anchor_loss": ("base_anchor_loss_sum", metrics["base_anchor_loss"]),
             "ce_loss": ("ce_loss_sum", metrics["ce_loss"]), "tv_loss": ("tv_loss_sum", metrics["tv_loss"])}
    for ours_name, (their_name, value) in pairs.items():
        diff = abs(float(value) - float(theirs[their_name]))
        print(f"xpress {ours_name}: draftsmith {float(value):.6f}, speculators {float(theirs[their_name]):.6f}, "
              f"|diff| {diff:.3g}")
        assert float(value) == pytest.approx(float(theirs[their_name]), rel=1e-4, abs=1e-6), ours_name


# -- vLLM 0.33.0's qwen3_xpress.py, read from its sources


def _module(vllm_next_src: Path, relative: str) -> tuple[str, ast.Module]:
    source = (vllm_next_src / "vllm" / relative).read_text()
    return source, ast.parse(source)


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def test_the_refiner_tensors_and_keys_vllm_033_reads_are_the_exports(draft, vllm_next_src):
    out, _, _ = draft
    source, tree = _module(vllm_next_src, "model_executor/models/qwen3_xpress.py")
    head = _class(tree, "XPressRefinerHead")
    key_map = next(ast.literal_eval(n.value) for n in head.body
                   if isinstance(n, ast.Assign) and n.targets[0].id == "HYBRID_KEY_MAP")
    # load_weights: "xpress_head." + a HYBRID_KEY_MAP key (mix.L read raw, then folded)
    exported = {n for n in load_file(str(out / "model.safetensors")) if n.startswith("xpress_head.")}
    assert exported == {f"xpress_head.{k}" for k in key_map}
    model_reads = set(re.findall(r'getattr\(config, "(xpress_\w+)"', source))
    speculator, _ = _module(vllm_next_src, "v1/worker/gpu/spec_decode/xpress/speculator.py")
    reads = model_reads | set(re.findall(r'getattr\(hf, "(xpress_\w+)"', speculator))
    config = json.loads((out / "config.json").read_text())
    assert reads - {"xpress_compile_head"} <= set(config), sorted(reads - set(config))
    assert config["architectures"][0] in ast.literal_eval(
        re.search(r"XPRESS_ARCHITECTURES = frozenset\((\{.*?\})\)",
                  (vllm_next_src / "vllm/config/speculative.py").read_text()).group(1))
    algos = (vllm_next_src / "vllm/transformers_utils/configs/speculators/algos.py").read_text()
    assert '"xpress"' not in algos  # why config.json is the native layout, not speculators'
    assert json.loads((out / SPECULATORS_CONFIG).read_text())["speculators_model_type"] == "xpress"


def test_vllm_033s_refiner_head_built_from_the_export_computes_the_same_bias(draft, vllm_next_src):
    out, model, _ = draft
    cfg = model.config
    source, tree = _module(vllm_next_src, "model_executor/models/qwen3_xpress.py")
    namespace = {"torch": torch, "nn": nn, "F": F, "_topk": None, "kernels": None}
    exec(compile(ast.Module([_class(tree, "XPressRefinerHead")], []), "qwen3_xpress.py", "exec"), namespace)
    vllm_head = namespace["XPressRefinerHead"](vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                               block_size=cfg.block_size, rank=cfg.xpress_rank,
                                               mlp_hidden=cfg.mlp_hidden, max_num_reqs=4, topc=0)
    # as Qwen3XPressForCausalLM.load_weights: names through HYBRID_KEY_MAP, mix.L folded after loading
    weights = {k.removeprefix("xpress_head."): v for k, v in load_file(str(out / "model.safetensors")).items()
               if k.startswith("xpress_head.")}
    raw = weights.pop("mix.L")
    loaded = vllm_head.load_state_dict({vllm_head.HYBRID_KEY_MAP[k]: v for k, v in weights.items()}, strict=False)
    assert loaded.missing_keys == ["mix_L"] and not loaded.unexpected_keys
    vllm_head.fold_from_raw_(raw)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, BK, cfg.hidden_size, generator=g)
    prev = torch.randint(0, cfg.vocab_size, (3, BK), generator=g)
    with torch.no_grad():
        normed = model.norm(hidden)
        theirs = vllm_head.refine_bias(prev, vllm_head.hidden_cache(normed))
        ours = model.xpress_head.bias(prev, model.xpress_head.hidden_cache(normed))
    print(f"xpress bias: max |draftsmith - vLLM 0.33 XPressRefinerHead| = {maxdiff(ours, theirs):.3g}")
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
