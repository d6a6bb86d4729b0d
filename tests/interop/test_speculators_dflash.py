"""speculators 0.9 DFlash, DSpark and DFlash2 checkpoints, both ways (docs/speculators_interop.md,
"DFlash, DSpark and DFlash2").

- speculators -> draftsmith: checkpoints the library builds through its own training entry point
  (``create_transformer_layer_config`` + ``from_training_args``, random weights) and saves with
  ``save_pretrained`` warm-start draftsmith's training method (``draft.init_from``) on the tiny
  target's prepared run (DFlash2, which needs a full-vocab run: the warm-start functions on the
  tiny target): every tensor arrives (rows over the draft vocab by target token id), and the warm
  draft computes the library's block logits on the library's checkpoint;
- draftsmith -> speculators: draftsmith's exports load into the library's own model classes
  (``from_pretrained``), whose training forward computes draftsmith's block logits (DSpark: the
  teacher-forced Markov-corrected logits and the confidence logits; DFlash2: the unary logits and
  the selector's scores of fixed candidates after the true previous token) on the same inputs.

The library's anchors are random; its ``select_anchors`` is replaced by the shared fixed anchors.
draftsmith's DSpark export is the flat ``Qwen3DSparkModel`` layout vLLM reads natively, for which
speculators 0.9 has no reader (its ``from_pretrained`` converts only DFlash layouts), so that
folder is loaded with a ``DSparkSpeculatorConfig`` holding the export's ``config.json`` values.
Without the interop environment every test here skips.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from draftsmith.eval.export import export
from draftsmith.layout import DraftCheckpointConfig, RunLayout
from draftsmith.methods import get_method
from draftsmith.models.dflash.warm_start import (
    DROPPED,
    config_problems,
    fit_problems,
    load_init_weights,
    read_init_draft,
)
from draftsmith.models.dflash2.config import DFlash2Config
from draftsmith.models.dflash2.model import DFlash2DraftModel
from draftsmith.target import TargetInfo

from helpers.tiny import TINY_AUX, randomize_norms

KINDS = ("dflash", "dspark", "dflash2")
BLOCK, LAYERS, RANK, MASK, VD = 4, 2, 8, 500, 128  # VD: the prepared run's data.draft_vocab_size
SELECTOR = {"conv_kernel_size": 2, "conv_group_size": 32, "selector_rank": 16, "selector_top_k": 8}  # DFlash2
EXTRA = {"dflash": {}, "dspark": {"markov_rank": RANK}, "dflash2": SELECTOR}
T, ANCHORS = 24, (2, 7, 11, 19)

# The speculators side. build: a checkpoint of each kind from the library's training entry point
# (DFlash over the run's draft vocab, DSpark over the full vocab), every weight random (norms away
# from one), saved with save_pretrained. run: a folder loaded with from_pretrained (eager attention
# on the CPU), the training forward on the shared inputs at the shared anchors, its block logits
# (and DSpark's confidence logits) saved, its config printed as the library's classes read it.
SPECULATORS = r'''
import json, sys
import torch
from safetensors.torch import load_file, save_file
from speculators.models.dflash import core as dflash_core
from speculators.models.dflash.config import DFlashSpeculatorConfig
from speculators.models.dflash.core import DFlashDraftModel
from speculators.models.dspark import core as dspark_core
from speculators.models.dspark.config import DSparkSpeculatorConfig
from speculators.models.dspark.core import DSparkDraftModel
from speculators.models.dflash2.core import DFlash2DraftModel
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from speculators.train.cli import create_transformer_layer_config

BLOCK, LAYERS, RANK, MASK, AUX, SELECTOR = %(BLOCK)d, %(LAYERS)d, %(RANK)d, %(MASK)d, %(AUX)s, %(SELECTOR)s
CLASSES = {"dflash": DFlashDraftModel, "dspark": DSparkDraftModel, "dflash2": DFlash2DraftModel}


def build(kind, target, vocab, out):
    layer = create_transformer_layer_config(target, num_layers=LAYERS, draft_arch="qwen3", hidden_act=None,
                                            sliding_window=None, full_attention_indices=list(range(LAYERS)))
    args = dict(verifier_name_or_path=target, target_layer_ids=AUX, block_size=BLOCK, mask_token_id=MASK)
    if kind == "dflash":
        v = load_file(vocab)
        model = DFlashDraftModel.from_training_args(layer, t2d=v["t2d"], d2t=v["d2t"],
                                                    draft_vocab_size=v["d2t"].shape[0], **args)
    elif kind == "dspark":
        model = DSparkDraftModel.from_training_args(layer, draft_vocab_size=layer.vocab_size, markov_rank=RANK,
                                                    **args)
    else:
        model = DFlash2DraftModel.from_training_args(layer, draft_vocab_size=layer.vocab_size, **SELECTOR, **args)
    torch.manual_seed({"dflash": 1, "dspark": 2, "dflash2": 5}[kind])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith(("embed_tokens", "verifier_")):
                p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(out)


def run(kind, folder, inputs, out):
    path = f"{folder}/config.json"
    raw = json.load(open(path))
    if "speculators_model_type" in raw:
        config = CLASSES[kind].config_class.from_pretrained(folder)
    else:  # draftsmith's flat Qwen3DSparkModel layout: the library has no reader for it
        layer = {k: v for k, v in raw.items() if k not in ("architectures", "dflash_config", "draftsmith")}
        config = DSparkSpeculatorConfig(
            transformer_layer_config=dict(layer, model_type="qwen3"), draft_vocab_size=raw["draft_vocab_size"],
            block_size=raw["block_size"], aux_hidden_state_layer_ids=raw["aux_hidden_state_layer_ids"],
            mask_token_id=raw["mask_token_id"], sample_from_anchor=raw["sample_from_anchor"],
            markov_rank=raw["markov_rank"], markov_head_type=raw["markov_head_type"],
            enable_confidence_head=raw["enable_confidence_head"],
            confidence_head_with_markov=raw["confidence_head_with_markov"],
            speculators_config=SpeculatorsConfig(
                algorithm="dspark", default_proposal_method="greedy",
                proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=raw["block_size"])],
                verifier=VerifierConfig(name_or_path=raw["draftsmith"]["target_path"], architectures=[])))
    config.transformer_layer_config._attn_implementation = "eager"
    model = CLASSES[kind].from_pretrained(folder, config=config).eval()
    x = load_file(inputs)
    anchors = x["anchors"]
    dflash_core.select_anchors = lambda mask, n, block: (anchors, torch.ones_like(anchors, dtype=torch.bool))
    shared = dict(hidden_states=x["aux"], input_ids=x["input_ids"], loss_mask=torch.ones_like(x["input_ids"]),
                  verifier_last_hidden_states=x["verifier_last"], document_ids=torch.zeros_like(x["input_ids"]),
                  position_ids=x["position_ids"], max_anchors=anchors.shape[0])
    with torch.no_grad():
        if kind == "dflash":
            _, logits, _, _, _ = model._backbone_forward(**shared)
            outputs = {"logits": logits[0]}
        elif kind == "dflash2":
            hidden, logits, _, _, where = model._backbone_forward(**shared)
            previous = model._predecessor_ids(x["input_ids"], where).reshape(1, -1)
            scores = model.candidate_selector.score_candidates(logits, hidden, previous, x["candidates"][None])
            outputs = {"logits": logits[0], "scores": scores[0]}
        else:
            seen = {}

            def capture(logits, targets, confidence, *rest, **kw):
                seen.update(logits=logits[0], confidence=confidence[0])
                return torch.zeros(()), {}

            dspark_core.compute_metrics = capture
            model(**shared)
            outputs = seen
    save_file({k: v.contiguous() for k, v in outputs.items()}, out)
    print(json.dumps(dict(sorted(config.to_dict().items()), transformer_layer_config=None), default=str))


if sys.argv[1] == "build":
    for kind in json.loads(sys.argv[4]):
        build(kind, sys.argv[2], sys.argv[3], f"{sys.argv[5]}/{kind}")
else:
    for kind, folder, out in json.loads(sys.argv[2]):
        run(kind, folder, sys.argv[3], out)
''' % {"BLOCK": BLOCK, "LAYERS": LAYERS, "RANK": RANK, "MASK": MASK, "AUX": json.dumps(TINY_AUX),
       "SELECTOR": repr(SELECTOR)}


def target_tensors(target) -> dict[str, torch.Tensor]:
    return load_file(str(target / "model.safetensors"))


def shared_inputs(vocab_size: int, hidden_size: int) -> dict[str, torch.Tensor]:
    """One row of T tokens (none of them the mask token), its aux states (3 x H), the target's
    final states speculators' forward takes for its own targets, positions, the anchors and
    DFlash2's candidates (K token ids per block slot)."""
    g = torch.Generator().manual_seed(7)
    K = SELECTOR["selector_top_k"]
    return {"input_ids": torch.randint(0, 384, (1, T), generator=g),
            "candidates": torch.randint(0, vocab_size, (len(ANCHORS) * BLOCK, K), generator=g),
            "aux": 3 * torch.randn(1, T, len(TINY_AUX) * hidden_size, generator=g),
            "verifier_last": torch.randn(1, T, hidden_size, generator=g),
            "position_ids": torch.arange(T)[None], "anchors": torch.tensor(ANCHORS)}


def draftsmith_export(kind: str, target, root):
    """A draftsmith draft of ``kind`` on the tiny target (random weights, norms away from one,
    DSpark's Markov head, DFlash2's convolutions and selector away from their identity starts; the
    run's draft vocab size over the target ids 0..VD-1, DFlash2 the full vocab with the target's
    ``lm_head``, the one speculators keeps), its training checkpoint and its export."""
    spec = get_method(kind)
    torch.manual_seed({"dflash": 3, "dspark": 4, "dflash2": 6}[kind])
    target_config = AutoConfig.from_pretrained(target)
    vd = target_config.vocab_size if kind == "dflash2" else VD
    config = spec.config_class.from_target(target_config, draft_vocab_size=vd, aux_layer_ids=TINY_AUX,
                                           num_layers=LAYERS, block_size=BLOCK, mask_token_id=MASK, **EXTRA[kind])
    model = randomize_norms(spec.model_class(config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("markov_head.", "lm_head.", "candidate_selector.")) or "_conv." in name:
                p.normal_(0.0, 0.3 if "base_kernel" in name else 0.1)
        if vd == target_config.vocab_size:  # the library replaces a full-vocab head by the verifier's on load
            model.lm_head.weight.copy_(target_tensors(target)["lm_head.weight"])  # (draft.freeze_lm_head's)
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[:vd] = True
    model.set_vocab_mapping(torch.zeros(vd, dtype=torch.long), t2d)
    ckpt = root / "checkpoint"
    ckpt.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt / "model.safetensors"))
    DraftCheckpointConfig(method=kind, config=config.to_dict(), target={
        "name_or_path": str(target), "path": str(target), "architectures": ["LlamaForCausalLM"]}).write(ckpt)
    return export(ckpt, root / "export", dtype="float32")


def assert_fp32_close(ours: torch.Tensor, theirs: torch.Tensor, msg: str) -> None:
    """Equal up to float32 rounding: within 1e-5 of the largest magnitude (DFlash2's convolutions
    sum in another order than the library's)."""
    scale = max(1.0, float(theirs.abs().max()))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * scale, msg=msg)


@torch.no_grad()
def draftsmith_outputs(kind: str, model, inputs) -> dict[str, torch.Tensor]:
    """``model``'s block logits ``(A * BLOCK, Vd)`` at the shared anchors (DSpark: teacher-forced,
    Markov-corrected), DSpark's confidence logits ``(A * BLOCK,)`` and DFlash2's selector scores
    ``(A * BLOCK, K)`` of the shared candidates after the true previous token (the anchor's own
    for slot 0)."""
    ids, aux, anchors = inputs["input_ids"], inputs["aux"], inputs["anchors"][None]
    valid = torch.ones_like(anchors, dtype=torch.bool)
    hidden = model.block_hidden(ids, aux, anchors, valid, inputs["position_ids"])  # (1, A, BLOCK, H)
    if kind == "dflash":
        return {"logits": model.compute_logits(hidden).flatten(0, 2)}
    if kind == "dflash2":
        normed = model.norm(hidden).flatten(0, 2)
        logits, candidates = model.lm_head(normed), inputs["candidates"]
        slots = anchors[0, :, None] + torch.arange(BLOCK)
        previous = ids[0, torch.cat([slots[:, :1], slots[:, :-1]], 1)].flatten()  # x_a, x_a, x_{a+1}, ...
        scores = model.candidate_selector.edge_scores(previous[:, None], candidates, logits.gather(1, candidates),
                                                      normed)[:, 0]
        return {"logits": logits, "scores": scores}
    prev = ids[0, anchors[0, :, None] + torch.arange(BLOCK)][None]  # the block's own tokens x_{a+k}
    markov = model.markov_embed(prev)
    return {"logits": model.markov_logits(hidden, markov).flatten(0, 2),
            "confidence": model.confidence_logit(hidden, markov).flatten()}


@pytest.fixture(scope="module")
def interop(prepared, tiny_target, tmp_path_factory, two_sided):
    """The speculators checkpoints (built over the prepared run's draft vocab), the draftsmith
    exports, and the library's outputs on each: ``{"root", "run", "recipe", "configs": {(side,
    kind): dict}, (side, kind): folder}`` (two interop runs in all)."""
    recipe, run, _ = prepared
    c = json.loads((tiny_target / "config.json").read_text())
    sides = two_sided(SPECULATORS, [str(tiny_target), str(RunLayout(run).data.vocab)], KINDS,
                      lambda kind, out: draftsmith_export(kind, tiny_target, out),
                      shared_inputs(c["vocab_size"], c["hidden_size"]), tmp_path_factory.mktemp("speculators_dflash"))
    return {"run": run, "recipe": recipe, **sides}


def target_info(target) -> TargetInfo:
    c = json.loads((target / "config.json").read_text())
    return TargetInfo(name_or_path=str(target), path=str(target), architectures=c["architectures"],
                      num_hidden_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"],
                      vocab_size=c["vocab_size"], aux_layer_ids=TINY_AUX)


def warm_model(interop, target, kind: str) -> tuple[torch.nn.Module, list[int]]:
    """The draft of ``kind`` warm-started from the speculators checkpoint, and its draft tokens
    (target ids). DFlash and DSpark: this run's training method (``draft.init_from``) builds it;
    DFlash2 (a full-vocab run; the prepared one has a draft vocab of VD): the same steps, the warm
    start's functions on the tiny target."""
    folder = interop[("speculators", kind)]
    section = get_method(kind).recipe_config(num_layers=LAYERS, block_size=BLOCK, num_anchors=16,
                                             freeze_lm_head=False, init_from=str(folder), **EXTRA[kind])
    if kind != "dflash2":
        recipe = interop["recipe"].model_copy(deep=True)
        recipe.draft = section
        method = get_method(kind).training_method(recipe, interop["run"])
        assert method.config.mask_token_id == MASK  # the draft's mask token, not one chosen for the run
        return method.build_model(), (torch.arange(VD) + method.d2t).tolist()
    init = read_init_draft(folder, kind)
    V = init.config.vocab_size
    assert fit_problems(init, target_info(target), torch.zeros(V, dtype=torch.long)) == []
    config = DFlash2Config.from_target(AutoConfig.from_pretrained(target), draft_vocab_size=V, aux_layer_ids=TINY_AUX,
                                       num_layers=LAYERS, block_size=BLOCK, mask_token_id=MASK, **SELECTOR)
    assert config_problems(init, config, section) == []
    model = DFlash2DraftModel(config)
    head = target_tensors(target)
    model.init_from_target(head["model.embed_tokens.weight"])
    model.set_vocab_mapping(torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    load_init_weights(model, init, head["lm_head.weight"])
    return model, list(range(V))


@pytest.mark.parametrize("kind", KINDS)
def test_draft_init_from_loads_every_tensor_of_a_speculators_checkpoint(interop, tiny_target, kind):
    saved = load_file(str(interop[("speculators", kind)] / "model.safetensors"))
    model, ours = warm_model(interop, tiny_target, kind)
    state = model.state_dict()
    assert not set(saved) & set(DROPPED) and set(saved) <= set(state)
    assert set(state) - set(saved) == (set() if kind == "dflash" else {"lm_head.weight", "d2t", "t2d"})
    for name, tensor in saved.items():
        if name == "markov_head.markov_w2.weight":  # the library's full vocab -> this run's, by token
            tensor = tensor[ours]
        assert torch.equal(state[name], tensor), name
    if kind != "dflash":  # speculators saves no lm_head over a full vocab: the verifier's rows
        assert torch.equal(state["lm_head.weight"], target_tensors(tiny_target)["lm_head.weight"][ours])
    assert (torch.arange(len(ours)) + state["d2t"]).tolist() == ours and int(state["t2d"].sum()) == len(ours)


@pytest.mark.parametrize("kind", KINDS)
def test_the_warm_draft_computes_the_speculators_checkpoints_block_logits(interop, tiny_target, kind):
    inputs = load_file(str(interop["root"] / "inputs.safetensors"))
    theirs = load_file(str(interop["root"] / f"out_speculators_{kind}.safetensors"))
    model, tokens = warm_model(interop, tiny_target, kind)
    ours = draftsmith_outputs(kind, model.eval(), inputs)
    if kind == "dspark":  # the library's full vocab -> this run's draft vocab
        theirs["logits"] = theirs["logits"][:, tokens]
    assert set(ours) == set(theirs)
    for name in sorted(ours):
        assert_fp32_close(ours[name], theirs[name], f"{kind} {name}")


@pytest.mark.parametrize("kind", KINDS)
def test_speculators_computes_the_block_logits_of_a_draftsmith_export(interop, tiny_target, kind):
    inputs = load_file(str(interop["root"] / "inputs.safetensors"))
    theirs = load_file(str(interop["root"] / f"out_draftsmith_{kind}.safetensors"))
    model = get_method(kind).format.load(interop[("draftsmith", kind)],
                                         target_tensors(tiny_target)["model.embed_tokens.weight"])
    ours = draftsmith_outputs(kind, model, inputs)
    assert set(ours) == set(theirs) and ours["logits"].shape[0] == len(ANCHORS) * BLOCK
    for name in sorted(ours):
        assert_fp32_close(ours[name], theirs[name], f"{kind} {name}")


def test_the_library_reads_draftsmiths_config_keys_as_draftsmith_wrote_them(interop):
    config = interop["configs"][("draftsmith", "dflash")]  # speculators' own config class, as loaded
    assert config["speculators_model_type"] == "dflash" and config["sample_from_anchor"] is False
    assert config["sliding_window_non_causal"] is True  # vLLM: dflash_config.causal false
    assert (config["block_size"], config["mask_token_id"], config["draft_vocab_size"]) == (BLOCK, MASK, VD)
    assert config["aux_hidden_state_layer_ids"] == TINY_AUX
    two = interop["configs"][("draftsmith", "dflash2")]
    assert two["speculators_model_type"] == "dflash2" and {key: two[key] for key in SELECTOR} == SELECTOR
    spark = interop["configs"][("speculators", "dspark")]
    assert spark["sample_from_anchor"] is True and spark["markov_rank"] == RANK
