"""The draft-method registry (draftsmith.methods): every registered method exports and loads
back with its own functions, unknown names are errors that list the known ones, and the
registry's facts agree with the classes it points to."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from draftsmith.methods import UnknownMethodError, get_method, method_of_export, registered_methods
from draftsmith.models.dflash.config import DFlashConfig
from draftsmith.models.dspark.config import DSparkConfig
from draftsmith.models.dflash2.config import DFlash2Config
from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.medusa.model import MedusaConfig
from draftsmith.models.mlp_speculator.model import MLPSpeculatorConfig
from draftsmith.models.mtp.config import MTPConfig
from draftsmith.models.peagle.config import PEagleConfig
from draftsmith.models.xpress.config import XPressConfig
from draftsmith.eval.export import export, load_export
from draftsmith.recipe import draft_sections, load_recipe

from helpers.tiny import write_draft_checkpoint

H, V, VD = 32, 64, 48

TINY_CONFIGS = {
    "eagle3": Eagle3Config(hidden_size=H, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=16, vocab_size=V, draft_vocab_size=VD, aux_layer_ids=[0, 1, 2]),
    "medusa": MedusaConfig(hidden_size=H, vocab_size=V, num_heads=2, num_layers=1),
    "mlp_speculator": MLPSpeculatorConfig(emb_dim=H, inner_dim=H, vocab_size=V, n_predict=2),
    "dflash": DFlashConfig(hidden_size=H, intermediate_size=64, num_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=16, vocab_size=V, draft_vocab_size=VD,
                           aux_layer_ids=[1, 2, 3], block_size=4, mask_token_id=5, num_target_layers=6),
    "dflash2": DFlash2Config(hidden_size=H, intermediate_size=64, num_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=16, vocab_size=V, draft_vocab_size=V,
                             aux_layer_ids=[1, 2, 3], block_size=4, mask_token_id=5, num_target_layers=6,
                             conv_group_size=8, selector_rank=4, selector_top_k=3),
    "peagle": PEagleConfig(hidden_size=H, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=16, vocab_size=V, draft_vocab_size=VD, aux_layer_ids=[0, 1, 2], num_layers=2,
                           num_depths=3, mask_token_id=5),
    "dspark": DSparkConfig(hidden_size=H, intermediate_size=64, num_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=16, vocab_size=V, draft_vocab_size=VD,
                           aux_layer_ids=[1, 2, 3], block_size=4, mask_token_id=5, num_target_layers=6, markov_rank=8),
    "xpress": XPressConfig(hidden_size=H, intermediate_size=64, num_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=16, vocab_size=V, draft_vocab_size=V,
                           aux_layer_ids=[1, 2, 3], block_size=4, mask_token_id=5, num_target_layers=6,
                           xpress_rank=4, xpress_topc=8),
    # a DeepSeek-V3 target's MTP layer: MLA and a MoE of 4 experts in 2 groups
    "mtp": MTPConfig("deepseek_v3", {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                                     "hidden_size": H, "vocab_size": V, "num_hidden_layers": 2,
                                     "num_nextn_predict_layers": 1, "intermediate_size": 64,
                                     "moe_intermediate_size": 16, "n_routed_experts": 4, "n_shared_experts": 1,
                                     "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
                                     "first_k_dense_replace": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
                                     "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                                     "qk_rope_head_dim": 8, "v_head_dim": 8}),
}
# the methods whose drafts share the target's embedding (the loader takes it as its second argument)
SHARED_EMBEDDING = {"eagle3", "dflash", "peagle", "dspark", "dflash2", "xpress"}


def test_every_method_has_a_tiny_config_here():
    assert set(TINY_CONFIGS) == set(registered_methods())


@pytest.mark.parametrize("name", registered_methods())
def test_export_round_trips_through_the_registered_exporter_and_loader(tmp_path, name):
    spec = get_method(name)
    torch.manual_seed(0)
    model = spec.model_class(TINY_CONFIGS[name])
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    embed = torch.randn(V, H)
    if name in SHARED_EMBEDDING:
        vd = model.config.draft_vocab_size
        model.set_vocab_mapping(torch.arange(vd) if vd < V else torch.zeros(V, dtype=torch.long), torch.arange(V) < vd)
        model.init_from_target(embed)
    ckpt = tmp_path / "ckpt"
    target = {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"], "hidden_size": H, "vocab_size": V}
    state = write_draft_checkpoint(model, ckpt, name, target)

    out = export(ckpt, tmp_path / "export", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert method_of_export(config) is spec
    loaded = load_export(out, embed) if name in SHARED_EMBEDDING else load_export(out)

    assert type(loaded) is spec.model_class
    reloaded = loaded.state_dict()
    for k, v in state.items():
        torch.testing.assert_close(reloaded[k], v, msg=f"{name}: {k} differs after export + load")


def test_unknown_method_is_an_error_listing_the_registered_names():
    with pytest.raises(UnknownMethodError, match="'eagle4'.*eagle3, medusa, mlp_speculator, dflash, peagle, dspark, dflash2"):
        get_method("eagle4")


def test_unknown_export_format_is_an_error_listing_the_registered_names():
    with pytest.raises(UnknownMethodError, match="model_type 'llama'.*eagle3, medusa, mlp_speculator, dflash, peagle, dspark, dflash2"):
        method_of_export({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})


@pytest.mark.parametrize("name", registered_methods())
def test_model_class_has_the_fsdp_blocks_it_declares(name):
    spec = get_method(name)
    assert type(TINY_CONFIGS[name]) is spec.config_class
    model = spec.model_class(TINY_CONFIGS[name])
    present = {type(m).__name__ for m in model.modules()}
    assert set(spec.model_class._no_split_modules) <= present


@pytest.mark.parametrize("name", registered_methods())
def test_training_method_is_the_methods_own_and_one_launch_module_trains_every_method(name):
    spec = get_method(name)
    assert spec.training_method.name == name
    assert importlib.util.find_spec("draftsmith.train.__main__") is not None  # accelerate launch -m draftsmith.train


def test_every_registered_method_has_one_draft_section():
    sections = draft_sections()
    assert tuple(sections) == registered_methods()
    assert all(sections[m].model_fields["method"].default == m for m in sections)


@pytest.mark.parametrize("name", registered_methods())
def test_the_draft_union_picks_the_methods_section(name):
    spec = get_method(name)
    assert spec.recipe_config is draft_sections()[name]
    recipe = load_recipe(None, [f"draft.method={name}"])
    assert type(recipe.draft) is spec.recipe_config and recipe.draft.method == name

@pytest.mark.parametrize("name", registered_methods())
def test_every_method_has_a_model_card_and_every_part_attached(name):
    spec = get_method(name)
    card = spec.format.card
    assert card.title and card.summary and name not in (card.title, card.summary)
    assert callable(spec.proposer_factory) and callable(spec.parameter_estimator)
    assert (spec.target_check is None) == (spec.format.fit is None)
