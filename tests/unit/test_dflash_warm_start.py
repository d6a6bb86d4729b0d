"""The DFlash family's warm start (``draft.init_from``, models/dflash/warm_start.py) on folders
written here: speculators 0.9-style ``config.json`` files written by hand are read or refused in
one line naming the file and the method or option; tensors arrive by name, draft-vocab rows by
target token id; a draft that does not fit the run or the recipe is refused, every problem named.
The round trip with speculators' own classes is tests/interop/test_speculators_dflash.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.models.dflash.config import DFlashConfig
from draftsmith.models.dflash.format import expected_dflash_weights
from draftsmith.models.dflash.recipe import DFlashDraftConfig
from draftsmith.models.dflash.model import DFlashDraftModel
from draftsmith.models.dflash.warm_start import (
    InitDraft,
    WarmStartError,
    config_problems,
    fit_problems,
    load_init_weights,
    read_init_draft,
)
from draftsmith.models.dspark.config import DSparkConfig
from draftsmith.models.dspark.format import expected_dspark_weights
from draftsmith.models.dspark.model import DSparkDraftModel
from draftsmith.models.dspark.recipe import DSparkDraftConfig
from draftsmith.target import TargetInfo

from helpers.tiny import dflash_tiny_config, dspark_tiny_config

VERIFIER = {"architectures": ["LlamaForCausalLM"], "name_or_path": "tiny"}


def speculators_config(kind: str = "dflash", **over) -> dict:
    """A ``config.json`` as speculators 0.9's ``save_pretrained`` writes one for the tiny geometry
    of :func:`dflash_tiny_config` (H 32, 2 layers, V 50 -> 20, aux ids [1, 3], blocks of 4)."""
    layer = {"model_type": "qwen3", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
             "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "attention_bias": False,
             "layer_types": ["full_attention", "full_attention"], "use_sliding_window": False,
             "sliding_window": None, "rope_parameters": {"rope_theta": 500.0, "rope_type": "default"}}
    config = {"architectures": ["DFlashDraftModel"], "speculators_model_type": "dflash", "speculators_version": "0.9.0",
              "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                     "verifier": VERIFIER},
              "transformer_layer_config": layer, "draft_vocab_size": 20, "block_size": 4,
              "aux_hidden_state_layer_ids": [1, 3], "mask_token_id": 7, "target_hidden_size": None,
              "sliding_window_non_causal": False, "sample_from_anchor": False, "dtype": "float32"}
    if kind == "dspark":
        config.update(architectures=["DSparkDraftModel"], speculators_model_type="dspark", sample_from_anchor=True,
                      markov_rank=6, markov_head_type="vanilla", enable_confidence_head=True,
                      confidence_head_with_markov=True)
    for key, value in over.items():
        if key in layer:
            layer[key] = value
        else:
            config[key] = value
    return config


def write_folder(path: Path, config: dict, tensors: dict | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def random_tensors(shapes: dict, seed: int = 0, d2t: torch.Tensor | None = None) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {k: torch.randn(s, generator=g) for k, s in shapes.items() if k not in ("d2t", "t2d")}
    if "d2t" in shapes:
        ids = torch.arange(shapes["d2t"][0]) * 2 if d2t is None else d2t  # target ids 0, 2, 4, ...
        out["d2t"] = ids - torch.arange(ids.shape[0])
        out["t2d"] = torch.zeros(shapes["t2d"], dtype=torch.bool)
        out["t2d"][ids] = True
    return out


def run_info(**over) -> TargetInfo:
    return TargetInfo(**{"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 6,
                         "hidden_size": 32, "vocab_size": 50, "aux_layer_ids": [1, 3], **over})


# ------------------------------------------------------------------------------------------
# Refusals: one line naming the file and the method or option


@pytest.mark.parametrize("config,method,words", [
    (speculators_config(speculators_model_type="mtp", architectures=["MTPDraftModel"]), "dflash",
     ["'mtp'", "a method draftsmith does not train", "draft.method dflash"]),
    (speculators_config(speculators_model_type="eagle3"), "dflash", ["a draft of method eagle3", "draft.method dflash"]),
    (speculators_config("dspark"), "dflash", ["a draft of method dspark", "draft.method dflash"]),
    (speculators_config(), "dspark", ["a draft of method dflash", "draft.method dspark"]),
    (speculators_config(sample_from_anchor=True), "dflash", ["sample_from_anchor is true"]),
    (speculators_config(layer_types=["sliding_attention"] * 2, use_sliding_window=True, sliding_window=256),
     "dflash", ["sliding_window_non_causal is false", "windowed layers causally"]),
    (speculators_config("dspark", layer_types=["sliding_attention"] * 2, use_sliding_window=True, sliding_window=256),
     "dspark", ["sliding_window_non_causal is false", "windowed layers causally"]),
    (speculators_config("dspark", sample_from_anchor=False), "dspark", ["sample_from_anchor is false"]),
    (speculators_config("dspark", markov_head_type="gated"), "dspark", ["markov_head_type 'gated'"]),
    (speculators_config("dspark", markov_rank=0), "dspark", ["markov_rank=0"]),
    (speculators_config(mask_token_id=None), "dflash", ["mask_token_id null"]),
])
def test_a_checkpoint_of_another_method_or_an_untrained_option_is_refused_naming_the_file(
        tmp_path, config, method, words):
    folder = write_folder(tmp_path / "ckpt", config)
    with pytest.raises(WarmStartError) as err:
        read_init_draft(folder, method)
    message = str(err.value)
    assert "\n" not in message and str(folder / "config.json") in message
    for word in words:
        assert word in message


def test_speculators_causal_flag_on_full_attention_layers_warm_starts_but_is_no_servable_export(tmp_path):
    """speculators trains full-attention layers bidirectionally whatever sliding_window_non_causal
    says; vLLM would serve that config.json causally, so only the warm start reads it."""
    config = speculators_config()
    cfg = DFlashConfig.from_export(dict(config, sliding_window_non_causal=True))
    folder = write_folder(tmp_path / "ckpt", config, random_tensors(expected_dflash_weights(cfg)))
    init = read_init_draft(folder, "dflash")
    assert init.config == cfg and init.verifier == VERIFIER
    with pytest.raises(ValueError, match="causally"):
        DFlashConfig.from_export(config)


def test_a_missing_folder_or_weights_file_is_named(tmp_path):
    with pytest.raises(WarmStartError, match="no such folder"):
        read_init_draft(tmp_path / "nowhere", "dflash")
    folder = write_folder(tmp_path / "ckpt", speculators_config(sliding_window_non_causal=True))
    with pytest.raises(WarmStartError, match=f"{folder / 'model.safetensors'} missing"):
        read_init_draft(folder, "dflash")


# ------------------------------------------------------------------------------------------
# Tensors by name, draft-vocab rows by target token id


def test_every_tensor_arrives_and_draft_vocab_rows_move_by_target_token(tmp_path):
    cfg = dspark_tiny_config(num_target_layers=None, target_hidden_size=None)
    tensors = random_tensors(expected_dspark_weights(cfg))  # the draft's tokens: target ids 0, 2, ..., 38
    tensors["verifier_norm.weight"] = torch.ones(cfg.hidden_size)  # speculators' frozen verifier copy: dropped
    folder = write_folder(tmp_path / "ckpt", speculators_config("dspark", sliding_window_non_causal=True), tensors)
    init = read_init_draft(folder, "dspark")
    model = DSparkDraftModel(init.config)
    run_ids = torch.arange(20) + 10  # this run's draft vocab: target ids 10..29
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[run_ids] = True
    model.set_vocab_mapping(run_ids - torch.arange(20), t2d)
    before = model.lm_head.weight.detach().clone()
    counts = load_init_weights(model, init)

    state = model.state_dict()
    for name, value in tensors.items():
        if name not in ("d2t", "t2d", "verifier_norm.weight", "lm_head.weight", "markov_head.markov_w2.weight"):
            assert torch.equal(state[name], value), name
    theirs = {int(t): i for i, t in enumerate(torch.arange(20) * 2)}
    for row, token in enumerate(run_ids.tolist()):
        for name, start in (("lm_head.weight", before), ("markov_head.markov_w2.weight", None)):
            if token in theirs:
                assert torch.equal(state[name][row], tensors[name][theirs[token]]), (name, token)
            elif start is not None:
                assert torch.equal(state[name][row], start[row]), (name, token)  # kept its initialisation
    assert counts["rows"] == {"lm_head.weight": 10, "markov_head.markov_w2.weight": 10}


@pytest.mark.parametrize("change", ["missing", "unexpected", "shape"])
def test_a_tensor_set_other_than_the_models_is_refused_naming_the_tensor(tmp_path, change):
    cfg = dflash_tiny_config(num_target_layers=None, target_hidden_size=None)
    tensors = random_tensors(expected_dflash_weights(cfg))
    name = "layers.1.mlp.up_proj.weight"
    if change == "missing":
        del tensors[name]
    elif change == "unexpected":
        name = "layers.1.mlp.g_proj.weight"
        tensors[name] = torch.zeros(3)
    else:
        tensors[name] = torch.zeros(3, 3)
    folder = write_folder(tmp_path / "ckpt", speculators_config(sliding_window_non_causal=True), tensors)
    init = read_init_draft(folder, "dflash")
    model = DFlashDraftModel(init.config)
    with pytest.raises(WarmStartError, match=name.replace(".", r"\.")):
        load_init_weights(model, init)


def test_a_full_vocab_draft_without_lm_head_takes_the_targets_rows(tmp_path):
    """speculators saves no lm_head for a full-vocab draft: its head is the verifier's."""
    cfg = dflash_tiny_config(draft_vocab_size=50, num_target_layers=None, target_hidden_size=None)
    tensors = random_tensors(expected_dflash_weights(cfg))
    del tensors["lm_head.weight"]
    folder = write_folder(tmp_path / "ckpt", speculators_config(sliding_window_non_causal=True, draft_vocab_size=50),
                          tensors)
    init = read_init_draft(folder, "dflash")
    model = DFlashDraftModel(dflash_tiny_config(num_target_layers=None, target_hidden_size=None))
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[:20] = True
    model.set_vocab_mapping(torch.zeros(20, dtype=torch.long), t2d)
    target_rows = torch.randn(20, 32)
    load_init_weights(model, init, target_rows)
    assert torch.equal(model.lm_head.weight, target_rows)
    with pytest.raises(WarmStartError, match=r"missing \['lm_head\.weight'\]"):
        load_init_weights(model, init)


# ------------------------------------------------------------------------------------------
# Fit with the run and the recipe


def test_a_draft_for_other_layers_another_target_or_other_tokens_is_refused_with_every_problem():
    cfg = dflash_tiny_config(num_target_layers=None, target_hidden_size=None)
    init = InitDraft(cfg, random_tensors(expected_dflash_weights(cfg)), Path("ckpt"), VERIFIER)  # tokens 0, 2, .., 38
    evens, odds = torch.arange(20) * 2, torch.arange(20) * 2 + 1
    assert fit_problems(init, run_info(), evens - torch.arange(20)) == []
    problems = fit_problems(init, run_info(aux_layer_ids=[1, 4], architectures=["Qwen3ForCausalLM"]),
                            odds - torch.arange(20))
    assert len(problems) == 3
    assert "aux layer ids [1, 3] != [1, 4]" in problems[1] and "Qwen3ForCausalLM" in problems[0]
    assert problems[2] == "its draft vocab shares no token with this run's"


def test_recipe_keys_and_geometry_other_than_the_drafts_are_named():
    theirs = dflash_tiny_config(num_layers=2, block_size=4)
    ours = dflash_tiny_config(num_layers=1, block_size=8, intermediate_size=48, draft_vocab_size=10,
                              max_position_embeddings=8192)  # the draft vocab and RoPE's limit are the run's
    problems = config_problems(InitDraft(theirs, {}, Path("ckpt"), {}), ours, DFlashDraftConfig(num_layers=1,
                                                                                                block_size=8))
    assert problems == ["intermediate_size 64 != 48, this run's (draftsmith builds the draft's layers with the "
                        "target's geometry)",
                        "draft.num_layers=1 but the draft has num_layers=2 (set draft.num_layers)",
                        "draft.block_size=8 but the draft has block_size=4 (set draft.block_size)"]
    spark = DSparkConfig(**theirs.to_dict(), markov_rank=6)
    assert config_problems(InitDraft(spark, {}, Path("ckpt"), {}), DSparkConfig(**theirs.to_dict(), markov_rank=32),
                           DSparkDraftConfig(markov_rank=32)) == [
        "draft.markov_rank=32 but the draft has markov_rank=6 (set draft.markov_rank)"]


def test_a_speculators_dspark_config_is_read_as_dspark_by_the_export_tools():
    from draftsmith.methods import method_of_export
    from draftsmith.models.dspark.format import dspark_fit

    config = speculators_config("dspark")  # sliding_window_non_causal false: vLLM's DSpark reader ignores it
    assert method_of_export(config).name == "dspark" and method_of_export(speculators_config()).name == "dflash"
    cfg = DSparkConfig.from_export(config)
    assert (cfg.markov_rank, cfg.confidence_head, cfg.confidence_head_with_markov, cfg.block_size) == (6, True, True, 4)
    fit = dspark_fit(config)
    assert (fit.aux_layer_ids, fit.verifier, fit.aux_min) == ([1, 3], VERIFIER, 1)
