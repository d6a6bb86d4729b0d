"""speculators 0.9 EAGLE-3, EAGLE-3.1 and P-EAGLE checkpoints, both ways (docs/speculators_interop.md).

- speculators -> draftsmith: checkpoints the speculators library builds and saves itself
  (``save_pretrained``, random weights) warm-start a draftsmith draft (``draft.init_from``) with
  every tensor loaded, and draftsmith's export loader computes what the library computes on them;
- draftsmith -> speculators: draftsmith exports load into the library's own model classes
  (``from_pretrained``), which compute draftsmith's logits and hidden states on the same inputs
  (EAGLE-3: three TTT steps; P-EAGLE: one forward over fixed COD elements).

The speculators side runs in the interop interpreter (:data:`SPECULATORS`); tensors travel through
safetensors files. Without that environment every test here skips.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from draftsmith.eval.export import export, load_export
from draftsmith.layout import DraftCheckpointConfig
from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.model import Eagle3DraftModel
from draftsmith.models.eagle3.warm_start import fit_problems, load_init_weights, read_init_draft, warm_config
from draftsmith.models.peagle.config import PEagleConfig
from draftsmith.models.peagle.model import CODElements, PEagleDraftModel
from draftsmith.models.peagle import warm_start as peagle_warm
from draftsmith.target import TargetInfo

from helpers.tiny import TINY_AUX, randomize_norms

KINDS = ("eagle3", "eagle31", "peagle")
VD, T, TTT, MASK = 64, 12, 3, 9
CHAINS = ((2, 3), (5, 3), (8, 2))  # P-EAGLE COD chains (anchor, depths 1..d) after depth 0 at every position

# The speculators side. build: a checkpoint of each kind from the library's own classes, random
# weights (norms away from one, the embedding the target's unless trained), saved with
# save_pretrained. run: each folder loaded with from_pretrained (eager attention on the CPU; the
# verifier's embedding where the folder has none), its forward on the shared inputs, the lm_head
# outputs and last decoder layer outputs saved.
SPECULATORS = r'''
import json, sys
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
from speculators import SpeculatorModel, SpeculatorModelConfig
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.losses import resolve_loss_config
from speculators.models.eagle3 import Eagle3SpeculatorConfig
from speculators.models.eagle3.core import Eagle3DraftModel
from speculators.models.peagle import core as peagle_core
from speculators.models.peagle.config import PEagleSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig

VD, MASK, AUX = %(VD)d, %(MASK)d, %(AUX)s


def build(kind, target, out):
    t = json.load(open(f"{target}/config.json"))
    peagle = kind == "peagle"
    layer = LlamaConfig(vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], intermediate_size=96,
                        num_hidden_layers=2 if peagle else 1, num_attention_heads=t["num_attention_heads"],
                        num_key_value_heads=t["num_key_value_heads"], head_dim=t["head_dim"],
                        max_position_embeddings=t["max_position_embeddings"], rms_norm_eps=t["rms_norm_eps"])
    spec = SpeculatorsConfig(algorithm="peagle" if peagle else "eagle3", default_proposal_method="greedy",
                             proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
                             verifier=VerifierConfig.from_pretrained(target))
    on = kind == "eagle31"  # the library's EAGLE-3.1 defaults: norm_before_fc and norm_output on
    common = dict(transformer_layer_config=layer, draft_vocab_size=VD, eagle_aux_hidden_state_layer_ids=AUX,
                  norm_before_residual=True, norm_before_fc=on, norm_output=on, speculators_config=spec)
    config = PEagleSpeculatorConfig(mask_token_id=MASK, **common) if peagle else Eagle3SpeculatorConfig(**common)
    model = SpeculatorModel.registered_model_class_from_config(config)(config)
    torch.manual_seed({"eagle3": 1, "eagle31": 2, "peagle": 3}[kind])
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
        if not config.embed_requires_grad:  # a frozen embedding is the verifier's
            model.embed_tokens.weight.copy_(load_file(f"{target}/model.safetensors")["model.embed_tokens.weight"])
    ids = torch.randperm(t["vocab_size"])[:VD].sort().values
    t2d = torch.zeros(t["vocab_size"], dtype=torch.bool)
    t2d[ids] = True
    model.load_vocab_mappings(t2d, ids - torch.arange(VD))
    model.save_pretrained(out)


def run(kind, folder, inputs, out):
    config = SpeculatorModelConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "eager"
    model = SpeculatorModel.from_pretrained(folder, config=config)
    if "embed_tokens.weight" not in safe_open(f"{folder}/model.safetensors", "pt").keys():
        # the verifier's embedding, as vLLM shares it: from_pretrained leaves the missing tensor
        # uninitialised (not NaN), so load_verifier_weights() may keep whatever memory held
        verifier = config.speculators_config.verifier.name_or_path
        with torch.no_grad():
            model.embed_tokens.weight.copy_(load_file(f"{verifier}/model.safetensors")["model.embed_tokens.weight"])
    model.eval()
    x = load_file(inputs)
    logits, hidden = [], []
    model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o))
    model.layers[-1].register_forward_hook(lambda m, i, o: hidden.append(o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        if kind == "peagle":
            anchor, depth = x["anchor"], x["depth"]
            peagle_core.generate_cod_sample_indices = lambda **kw: (anchor, depth)
            model(hidden_states=x["aux"], input_ids=x["shifted_ids"], document_ids=x["document_ids"],
                  verifier_last_hidden_states=x["verifier_last"],
                  loss_config=resolve_loss_config("kl_div", "eager"))  # the fused loss needs Triton
        else:
            model(hidden_states=x["aux"], input_ids=x["shifted_ids"], document_ids=x["document_ids"],
                  position_ids=x["position_ids"], ttt_steps=x["ttt_steps"].item())
    save_file({**{f"logits.{k}": v[0].contiguous() for k, v in enumerate(logits)},
               **{f"hidden.{k}": v[0].contiguous() for k, v in enumerate(hidden)}}, out)
    print(json.dumps(dict(sorted(config.to_dict().items()), transformer_layer_config=None), default=str))


if sys.argv[1] == "build":
    for kind in json.loads(sys.argv[3]):
        build(kind, sys.argv[2], f"{sys.argv[4]}/{kind}")
else:
    for kind, folder, out in json.loads(sys.argv[2]):
        run(kind, folder, sys.argv[3], out)
''' % {"VD": VD, "MASK": MASK, "AUX": json.dumps(TINY_AUX)}


def target_embedding(target) -> torch.Tensor:
    return load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"]


def target_info(target) -> TargetInfo:
    c = json.loads((target / "config.json").read_text())
    return TargetInfo(name_or_path=str(target), path=str(target), architectures=c["architectures"],
                      num_hidden_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"],
                      vocab_size=c["vocab_size"], aux_layer_ids=TINY_AUX)


def draftsmith_export(kind: str, target, root):
    """A draftsmith draft of ``kind`` on the tiny target (random weights, norms away from one, the
    target's embedding; P-EAGLE with a trained one), its training checkpoint and its export."""
    torch.manual_seed({"eagle3": 4, "eagle31": 5, "peagle": 6}[kind])
    on = kind == "eagle31"
    base = Eagle3Config.from_target(AutoConfig.from_pretrained(target), draft_vocab_size=VD, aux_layer_ids=TINY_AUX,
                                    norm_before_residual=kind != "peagle", norm_before_fc=on, norm_output=on)
    if kind == "peagle":
        model = PEagleDraftModel(PEagleConfig.from_eagle3(base, num_layers=2, num_depths=4, mask_token_id=MASK,
                                                          train_embeddings=True))
    else:
        model = Eagle3DraftModel(base)
    randomize_norms(model)
    model.init_from_target(target_embedding(target) * (1.5 if kind == "peagle" else 1.0))  # peagle: trained
    ids = torch.randperm(base.vocab_size)[:VD].sort().values
    t2d = torch.zeros(base.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    model.set_vocab_mapping(ids - torch.arange(VD), t2d)
    ckpt = root / "checkpoint"
    ckpt.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt / "model.safetensors"))
    meta = {"ttt_steps": TTT} if kind != "peagle" else {}
    DraftCheckpointConfig(method="peagle" if kind == "peagle" else "eagle3", config=model.config.to_dict(),
                          target={"name_or_path": str(target), "architectures": ["LlamaForCausalLM"]},
                          **meta).write(ckpt)
    return export(ckpt, root / "export", dtype="float32")


def shared_inputs(vocab_size: int, hidden_size: int) -> dict[str, torch.Tensor]:
    """One row of T tokens and aux states, the EAGLE-shifted ids speculators takes (its data
    pipeline shifts; draftsmith shifts inside), positions, and P-EAGLE's fixed COD elements."""
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, vocab_size, (1, T), generator=g)
    anchors = list(range(T)) + [a for a, d in CHAINS for _ in range(d)]
    depths = [0] * T + [k for _, d in CHAINS for k in range(1, d + 1)]
    return {"input_ids": x, "shifted_ids": torch.cat([x[:, 1:], torch.zeros(1, 1, dtype=x.dtype)], 1),
            "aux": 3 * torch.randn(1, T, 3 * hidden_size, generator=g), "position_ids": torch.arange(T)[None],
            "document_ids": torch.zeros(1, T, dtype=torch.long), "ttt_steps": torch.tensor(TTT),
            "anchor": torch.tensor(anchors), "depth": torch.tensor(depths),
            "verifier_last": torch.randn(1, T, hidden_size, generator=g)}


@torch.no_grad()
def draftsmith_outputs(kind: str, folder, target, inputs) -> dict[str, torch.Tensor]:
    """The export loader's draft of ``folder`` on ``inputs``: ``logits.k`` / ``hidden.k`` per TTT
    step (EAGLE-3), ``logits.0`` / ``hidden.0`` over the COD elements (P-EAGLE)."""
    model = load_export(folder, embed_tokens=target_embedding(target))
    if kind == "peagle":
        elements = CODElements.from_rows([(inputs["anchor"].tolist(), inputs["depth"].tolist())])
        hidden = model(inputs["input_ids"], inputs["aux"], elements)
        return {"logits.0": model.compute_logits(hidden)[0], "hidden.0": hidden[0]}
    steps = model(inputs["input_ids"], inputs["aux"], TTT, position_ids=inputs["position_ids"],
                  step_head=lambda k, h, logits: (h, logits(h)))
    return {**{f"logits.{k}": logits[0] for k, (_, logits) in enumerate(steps)},
            **{f"hidden.{k}": hidden[0] for k, (hidden, _) in enumerate(steps)}}


@pytest.fixture(scope="module")
def interop(tiny_target, tmp_path_factory, two_sided):
    """Both sides' folders, the speculators library's outputs on each (``root/out_{side}_{kind}``)
    and its config as its own classes read it: ``{"root", "configs": {(side, kind): dict},
    (side, kind): folder}``, side ``speculators`` or ``draftsmith`` (two interop runs in all)."""
    c = json.loads((tiny_target / "config.json").read_text())
    return two_sided(SPECULATORS, [str(tiny_target)], KINDS,
                     lambda kind, out: draftsmith_export(kind, tiny_target, out),
                     shared_inputs(c["vocab_size"], c["hidden_size"]), tmp_path_factory.mktemp("speculators_interop"))


@pytest.mark.parametrize("kind", KINDS)
def test_draft_init_from_loads_every_tensor_of_a_speculators_checkpoint(interop, tiny_target, kind):
    folder = interop[("speculators", kind)]
    saved = load_file(str(folder / "model.safetensors"))
    info = target_info(tiny_target)
    base = Eagle3Config.from_target(AutoConfig.from_pretrained(tiny_target), draft_vocab_size=VD,
                                    aux_layer_ids=TINY_AUX)
    if kind == "peagle":
        init = peagle_warm.read_init_peagle(folder)
        run = PEagleConfig.from_eagle3(base, num_layers=2, num_depths=4, mask_token_id=init.config.mask_token_id)
        model = PEagleDraftModel(peagle_warm.warm_config(init, run))
        assert (model.config.num_layers, model.config.mask_token_id, model.config.train_embeddings) == (2, MASK, True)
    else:
        init = read_init_draft(folder)
        model = Eagle3DraftModel(warm_config(init, base))
        on = kind == "eagle31"
        assert model.config.eagle31_options() == {"norm_before_fc": on, "fc_norm": False, "norm_output": on}
    assert model.config.intermediate_size == 96 and model.config.norm_before_residual is True
    assert fit_problems(init, info, saved["d2t"]) == []
    model.init_from_target(target_embedding(tiny_target))  # what the run installs before the warm start
    model.set_vocab_mapping(saved["d2t"], saved["t2d"])
    (peagle_warm.load_init_weights if kind == "peagle" else load_init_weights)(model, init)

    state = dict(model.state_dict(), **{"embed_tokens.weight": model.embed_tokens})
    state["mask_hidden"] = state.get("mask_hidden", torch.empty(0)).reshape(1, 1, -1)
    state.pop("embed_tokens", None)
    assert set(state) - {"mask_hidden"} <= set(saved) and set(saved) <= set(state)  # one name each way
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("side", ["speculators", "draftsmith"])
def test_both_libraries_compute_the_same_draft_from_either_sides_folder(interop, tiny_target, kind, side):
    inputs = load_file(str(interop["root"] / "inputs.safetensors"))
    theirs = load_file(str(interop["root"] / f"out_{side}_{kind}.safetensors"))
    ours = draftsmith_outputs(kind, interop[(side, kind)], tiny_target, inputs)
    assert set(theirs) == set(ours) and len(ours) == (2 if kind == "peagle" else 2 * TTT)
    for name in sorted(ours):
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-5, msg=f"{side} {kind} {name}")


def test_the_library_reads_draftsmiths_config_keys_as_draftsmith_wrote_them(interop):
    for kind in KINDS:
        config = interop["configs"][("draftsmith", kind)]  # speculators' own config class, as loaded
        on = kind == "eagle31"
        assert config["speculators_model_type"] == ("peagle" if kind == "peagle" else "eagle3")
        assert (config["norm_before_fc"], config["fc_norm"], config["norm_output"]) == (on, False, on)
        assert config["eagle_aux_hidden_state_layer_ids"] == TINY_AUX and config["draft_vocab_size"] == VD
        assert config["norm_before_residual"] is (kind != "peagle")
        if kind == "peagle":
            assert config["mask_token_id"] == MASK and config["embed_requires_grad"] is True
