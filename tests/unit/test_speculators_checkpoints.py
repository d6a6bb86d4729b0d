"""speculators 0.9 checkpoints as ``draft.init_from`` without the speculators library
(docs/speculators_interop.md): ``config.json`` files written by hand as the library writes them
(tests/interop/test_speculators_eagle.py has the library write them). Read and warm-started
with every tensor (EAGLE-3 and P-EAGLE, through P-EAGLE's training method); refused in one line
naming the file and the method or option when draftsmith does not train that draft."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.model import Eagle3DraftModel
from draftsmith.models.eagle3.warm_start import WarmStartError, load_init_weights, read_init_draft, warm_config
from draftsmith.models.peagle.config import PEagleConfig
from draftsmith.models.peagle.model import PEagleDraftModel
from draftsmith.models.peagle.recipe import PEagleDraftConfig
from draftsmith.models.peagle.training import PEagleMethod
from draftsmith.models.peagle.warm_start import read_init_peagle
from draftsmith.target import TargetInfo

from helpers.recipes import tiny_recipe
from helpers.tiny import TINY_AUX, randomize_norms

V, H, VD, MASK = 512, 128, 64, 9  # the tiny target's vocab and hidden size


def speculators_config(kind: str = "eagle3", **top) -> dict:
    """``config.json`` as speculators 0.9's ``save_pretrained`` writes an EAGLE-3 (``eagle3``) or
    P-EAGLE (``peagle``) draft of the tiny target's geometry, with ``top`` keys replaced."""
    peagle = kind == "peagle"
    layer = {"attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "head_dim": 64,
             "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02, "intermediate_size": 96,
             "max_position_embeddings": 1024, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 2,
             "num_hidden_layers": 2 if peagle else 1, "num_key_value_heads": 1, "pad_token_id": None,
             "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": 10000.0,
                                                                             "rope_type": "default"},
             "tie_word_embeddings": False, "use_cache": True, "vocab_size": V}
    config = {
        "architectures": ["PEagleDraftModel" if peagle else "Eagle3DraftModel"],
        "auto_map": {"": f"config.{'PEagle' if peagle else 'Eagle3'}SpeculatorConfig"},
        "draft_vocab_size": VD, "dtype": "float32", "eagle_aux_hidden_state_layer_ids": list(TINY_AUX),
        "embed_requires_grad": peagle, "fc_norm": False, "norm_before_fc": False, "norm_before_residual": True,
        "norm_output": False,
        "speculators_config": {"algorithm": kind, "default_proposal_method": "greedy",
                               "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                                     "speculative_tokens": 3, "verifier_accept_k": 1}],
                               "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "tiny"}},
        "speculators_model_type": kind, "speculators_version": "0.9.0", "target_hidden_size": None,
        "tie_word_embeddings": False, "transformer_layer_config": layer, "transformers_version": "5.19.0",
    }
    if peagle:
        config["mask_token_id"] = MASK
    config.update(top)
    return config


def vocab(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:VD].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(VD), t2d


def write_checkpoint(folder, config: dict) -> dict[str, torch.Tensor]:
    """``folder`` with ``config`` and the tensors the library saves for it (its names: the draft's
    state, ``embed_tokens.weight``, ``mask_hidden [1, 1, 3H]``), random; returns the tensors."""
    cfg = (PEagleConfig if config["speculators_model_type"] == "peagle" else Eagle3Config).from_speculators(config)
    torch.manual_seed(1)
    model = randomize_norms((PEagleDraftModel if isinstance(cfg, PEagleConfig) else Eagle3DraftModel)(cfg))
    model.init_from_target(torch.randn(V, H))
    model.set_vocab_mapping(*vocab())
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "embed_tokens"}
    tensors["embed_tokens.weight"] = model.embed_tokens.detach().clone()
    if "mask_hidden" in tensors:
        tensors["mask_hidden"] = tensors["mask_hidden"].reshape(1, 1, -1)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors


def test_an_eagle3_checkpoint_warm_starts_with_every_tensor(tmp_path):
    saved = write_checkpoint(tmp_path / "eagle3", speculators_config(norm_before_fc=True, norm_output=True))
    init = read_init_draft(tmp_path / "eagle3")
    assert (init.config.target_hidden_size, init.config.norm_before_fc, init.config.norm_output) == (H, True, True)
    assert init.verifier == {"architectures": ["LlamaForCausalLM"], "name_or_path": "tiny"}
    model = Eagle3DraftModel(warm_config(init, init.config))
    model.init_from_target(saved["embed_tokens.weight"])
    model.set_vocab_mapping(*vocab())
    assert load_init_weights(model, init)["lm_head_rows_new"] == 0
    state = dict(model.state_dict(), **{"embed_tokens.weight": model.embed_tokens})
    assert set(state) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name


def test_the_peagle_method_warm_starts_from_a_speculators_checkpoint(tiny_target, tmp_path, monkeypatch, caplog):
    saved = write_checkpoint(tmp_path / "peagle", speculators_config("peagle"))
    data = tmp_path / "run" / "data"
    data.mkdir(parents=True)
    TargetInfo(name_or_path=str(tiny_target), path=str(tiny_target), architectures=["LlamaForCausalLM"],
               num_hidden_layers=6, hidden_size=H, vocab_size=V,
               aux_layer_ids=list(TINY_AUX)).write(data / "target.json")
    d2t, t2d = vocab()
    save_file({"d2t": d2t, "t2d": t2d}, str(data / "vocab.safetensors"))
    recipe = tiny_recipe(tiny_target, tmp_path / "prompts.jsonl")
    recipe.draft = PEagleDraftConfig(init_from=str(tmp_path / "peagle"), num_layers=4)
    asked = []  # the mask token the method checks against the data (no tokenised data here)
    monkeypatch.setattr(PEagleMethod, "mask_token_id", lambda self, default=None: asked.append(default) or default)
    with caplog.at_level("WARNING", logger="draftsmith.train"):
        model = PEagleMethod(recipe, tmp_path / "run").build_model()
    assert asked == [MASK] and "num_layers=2 as the draft was trained" in caplog.text
    config = model.config
    assert (config.num_layers, config.train_embeddings, config.mask_token_id, config.num_depths) == (2, True, MASK, 4)
    state = model.state_dict()
    state["embed_tokens.weight"] = state.pop("embed_tokens")
    state["mask_hidden"] = state["mask_hidden"].reshape(1, 1, -1)
    assert set(state) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name


def test_an_untrained_peagle_embedding_is_the_targets(tmp_path):
    write_checkpoint(tmp_path / "peagle", speculators_config("peagle", embed_requires_grad=False))
    init = read_init_peagle(tmp_path / "peagle")
    assert init.config.train_embeddings is False and "embed_tokens" not in init.tensors
    assert init.tensors["mask_hidden"].shape == (3 * H,)


@pytest.mark.parametrize("kind", ["eagle3", "peagle"])
def test_a_full_vocab_checkpoint_without_d2t_t2d_loads_with_the_identity_mapping(tmp_path, kind):
    from draftsmith.eval.export import load_export
    from safetensors.torch import load_file

    config = speculators_config(kind, draft_vocab_size=V)
    d2t, t2d = torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool)
    cfg = (PEagleConfig if kind == "peagle" else Eagle3Config).from_speculators(config)
    model = (PEagleDraftModel if kind == "peagle" else Eagle3DraftModel)(cfg)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k not in ("d2t", "t2d", "embed_tokens")}
    tensors["embed_tokens.weight"] = torch.randn(V, H)
    if kind == "peagle":
        tensors["mask_hidden"] = tensors["mask_hidden"].reshape(1, 1, -1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "model.safetensors"))  # as the library saves it: no vocab mapping
    loaded = load_export(tmp_path)
    assert torch.equal(loaded.d2t, d2t) and torch.equal(loaded.t2d, t2d)
    assert torch.equal(loaded.embed_tokens, load_file(str(tmp_path / "model.safetensors"))["embed_tokens.weight"])


REFUSED = [  # (kind, what the config says, words of the one-line refusal)
    ("eagle3", {"speculators_model_type": "mtp"}, "speculators_model_type 'mtp': draftsmith trains no such draft"),
    ("eagle3", {"speculators_model_type": "medusa_next"}, "speculators_model_type 'medusa_next': draftsmith trains no"),
    ("eagle3", {"speculators_model_type": "peagle", "mask_token_id": MASK},
     "speculators_model_type 'peagle': its method is peagle, and draft.method eagle3 starts from eagle3 drafts only"),
    ("eagle3", {"speculators_model_type": "dflash", "aux_hidden_state_layer_ids": TINY_AUX},
     "its method is dflash, and draft.method eagle3"),
    ("peagle", {"speculators_model_type": "eagle3"},
     "its method is eagle3, and draft.method peagle starts from peagle"),
    ("eagle3", {"layer.model_type": "gemma3"},  # qwen3 is read (draft.layer qwen3, tests/unit/test_eagle3_layers.py)
     "transformer_layer_config.model_type 'gemma3': draftsmith's eagle3 draft is built from Llama or Qwen3 decoder"),
    ("peagle", {"layer.model_type": "qwen3"},
     "transformer_layer_config.model_type 'qwen3': draftsmith's peagle draft is built from Llama decoder layers"),
    ("peagle", {"layer.partial_rotary_factor": 0.5}, "transformer_layer_config.partial_rotary_factor 0.5"),
    ("eagle3", {"layer.rope_parameters": {"rope_theta": 1e4, "rope_type": "default", "partial_rotary_factor": 0.25}},
     "transformer_layer_config.rope_parameters.partial_rotary_factor 0.25"),
    ("eagle3", {"embed_requires_grad": True}, "embed_requires_grad true: the draft trained its own embedding"),
    ("eagle3", {"eagle_aux_hidden_state_layer_ids": [1, 2, 3, 4]}, "aux_layer_ids must name exactly 3 target layers"),
    ("peagle", {"norm_before_fc": True}, "norm_before_fc: EAGLE-3.1 options are for draft.method eagle3"),
    ("peagle", {"fc_norm": True}, "fc_norm: EAGLE-3.1 options are for draft.method eagle3"),
    ("peagle", {"mask_token_id": None}, "mask_token_id None: vLLM's pard_token must be a token id"),
]


@pytest.mark.parametrize("kind, edit, words", REFUSED, ids=[f"{k}-{next(iter(e))}={next(iter(e.values()))}"
                                                             for k, e, _ in REFUSED])
def test_a_draft_draftsmith_does_not_train_is_refused_naming_the_file_and_the_key(tmp_path, kind, edit, words):
    config = copy.deepcopy(speculators_config("peagle" if kind == "peagle" and "speculators_model_type" not in edit
                                              else "eagle3"))
    for key, value in edit.items():
        where, _, name = key.rpartition(".")
        (config["transformer_layer_config"] if where == "layer" else config)[name] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    read = read_init_peagle if kind == "peagle" else read_init_draft
    with pytest.raises(WarmStartError) as info:
        read(tmp_path)
    message = str(info.value)
    assert "\n" not in message and f"draft.init_from: {tmp_path / 'config.json'}: " in message
    assert words in message
