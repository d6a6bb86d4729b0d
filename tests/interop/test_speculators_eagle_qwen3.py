"""A speculators 0.9 EAGLE-3 checkpoint with a Qwen3 draft layer (``transformer_layer_config`` a
``Qwen3Config``: per-head ``q_norm`` / ``k_norm``) warm-starts a draftsmith ``draft.layer: qwen3``
draft (docs/speculators_interop.md).

The library builds the checkpoint from its own classes (random weights, norms away from one, the
verifier's embedding) and saves it with ``save_pretrained``, then runs its own forward (three TTT
steps, eager attention) on shared inputs. draftsmith reads the folder as ``draft.init_from`` does
(:func:`read_init_draft`, checked against the run's target with :func:`fit_problems`), loads every
tensor into a fresh draft (:func:`load_init_weights`) and must compute the library's logits and
last-layer hidden states at every step. Runs in the interop environment (``make interop``).
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from draftsmith.models.eagle3.model import Eagle3DraftModel
from draftsmith.models.eagle3.warm_start import fit_problems, load_init_weights, read_init_draft, warm_config
from draftsmith.target import TargetInfo

from helpers.tiny import TINY_AUX

VD, T, TTT = 64, 12, 3

SCRIPT = r'''
import json, sys
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config
from speculators import SpeculatorModel, SpeculatorModelConfig
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig

target, out, inputs, result = sys.argv[1:5]
VD, AUX = %(VD)d, %(AUX)s
t = json.load(open(f"{target}/config.json"))
layer = Qwen3Config(vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], intermediate_size=96, num_hidden_layers=1,
                    num_attention_heads=t["num_attention_heads"], num_key_value_heads=t["num_key_value_heads"],
                    head_dim=t["head_dim"], max_position_embeddings=t["max_position_embeddings"],
                    rms_norm_eps=t["rms_norm_eps"], rope_theta=1000000.0)
spec = SpeculatorsConfig(algorithm="eagle3", default_proposal_method="greedy",
                         proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
                         verifier=VerifierConfig.from_pretrained(target))
config = Eagle3SpeculatorConfig(transformer_layer_config=layer, draft_vocab_size=VD, eagle_aux_hidden_state_layer_ids=AUX,
                                norm_before_residual=True, speculators_config=spec)
model = SpeculatorModel.registered_model_class_from_config(config)(config)
torch.manual_seed(11)
embed = load_file(f"{target}/model.safetensors")["model.embed_tokens.weight"]
with torch.no_grad():
    for name, p in model.named_parameters():
        p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    model.embed_tokens.weight.copy_(embed)
ids = torch.randperm(t["vocab_size"])[:VD].sort().values
t2d = torch.zeros(t["vocab_size"], dtype=torch.bool)
t2d[ids] = True
model.load_vocab_mappings(t2d, ids - torch.arange(VD))
model.save_pretrained(out)

config = SpeculatorModelConfig.from_pretrained(out)
config.transformer_layer_config._attn_implementation = "eager"
model = SpeculatorModel.from_pretrained(out, config=config).eval()
with torch.no_grad():
    model.embed_tokens.weight.copy_(embed)
x = load_file(inputs)
logits, hidden = [], []
model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o))
model.layers[-1].register_forward_hook(lambda m, i, o: hidden.append(o[0] if isinstance(o, tuple) else o))
with torch.no_grad():
    model(hidden_states=x["aux"], input_ids=x["shifted_ids"], document_ids=x["document_ids"],
          position_ids=x["position_ids"], ttt_steps=x["ttt_steps"].item())
save_file({**{f"logits.{k}": v[0].contiguous() for k, v in enumerate(logits)},
           **{f"hidden.{k}": v[0].contiguous() for k, v in enumerate(hidden)}}, result)
print(type(model.layers[0]).__name__)
''' % {"VD": VD, "AUX": json.dumps(TINY_AUX)}


def test_speculators_qwen3_layer_checkpoint_warm_starts_and_computes_what_the_library_computes(
        tiny_target, tmp_path, in_speculators):
    c = json.loads((tiny_target / "config.json").read_text())
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, c["vocab_size"], (1, T), generator=g)
    inputs = {"input_ids": x, "shifted_ids": torch.cat([x[:, 1:], torch.zeros(1, 1, dtype=x.dtype)], 1),
              "aux": 3 * torch.randn(1, T, 3 * c["hidden_size"], generator=g), "position_ids": torch.arange(T)[None],
              "document_ids": torch.zeros(1, T, dtype=torch.long), "ttt_steps": torch.tensor(TTT)}
    save_file(inputs, str(tmp_path / "inputs.safetensors"))
    folder, result = tmp_path / "speculators_qwen3", tmp_path / "result.safetensors"
    layer_class = in_speculators(SCRIPT, str(tiny_target), str(folder), str(tmp_path / "inputs.safetensors"),
                                 str(result)).strip().splitlines()[-1]
    assert "Qwen3" in layer_class  # the library built its Qwen3 first layer
    theirs = load_file(str(result))

    init = read_init_draft(folder)
    assert init.config.layer == "qwen3" and init.config.rope_theta == 1000000.0
    assert {"layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"} <= set(init.tensors)
    info = TargetInfo(name_or_path=str(tiny_target), path=str(tiny_target), architectures=c["architectures"],
                      num_hidden_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"],
                      vocab_size=c["vocab_size"], aux_layer_ids=TINY_AUX)
    assert fit_problems(init, info, init.tensors["d2t"]) == []
    model = Eagle3DraftModel(warm_config(init, init.config))
    model.init_from_target(load_file(str(tiny_target / "model.safetensors"))["model.embed_tokens.weight"])
    model.set_vocab_mapping(init.tensors["d2t"].long(), init.tensors["t2d"].bool())
    loaded = load_init_weights(model, init)
    assert loaded["lm_head_rows"] == VD and loaded["tensors"] == len(model.state_dict()) - 3  # all but lm_head, d2t, t2d
    with torch.no_grad():
        steps = model.eval()(inputs["input_ids"], inputs["aux"], TTT, position_ids=inputs["position_ids"],
                             step_head=lambda k, h, logits: (h, logits(h)))
    assert len(theirs) == 2 * TTT
    for k, (hidden, logits) in enumerate(steps):
        torch.testing.assert_close(logits[0], theirs[f"logits.{k}"], rtol=1e-5, atol=1e-5, msg=f"logits.{k}")
        torch.testing.assert_close(hidden[0], theirs[f"hidden.{k}"], rtol=1e-5, atol=1e-5, msg=f"hidden.{k}")
