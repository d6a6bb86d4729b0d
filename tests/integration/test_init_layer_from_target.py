"""``draft.init_layer_from_target``: the EAGLE-3 draft layer starts from a target decoder layer.

With the next-token embedding's columns zeroed and the plain residual (``norm_before_residual:
false``), the freshly built draft layer must compute exactly what the target's own layer computes
on the same input, which the target run itself supplies (forward hooks on the tiny target)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from draftsmith.recipe import Recipe
from draftsmith.models.eagle3.training import Eagle3Method

pytestmark = pytest.mark.integration


def _method(recipe: Recipe, run, **draft) -> Eagle3Method:
    r = recipe.model_copy(deep=True)
    for key, value in draft.items():
        setattr(r.draft, key, value)
    return Eagle3Method(r, run)


def test_draft_layer_computes_the_target_layer(prepared):
    recipe, run, _ = prepared
    method = _method(recipe, run, init_layer_from_target=-1, norm_before_residual=False)
    n = int(method.target_info.num_hidden_layers)
    target = AutoModelForCausalLM.from_pretrained(method.target_dir, torch_dtype=torch.float32).eval()
    seen = {}
    target.model.layers[n - 1].register_forward_hook(
        lambda mod, args, kwargs, out: seen.update(x=kwargs.get("hidden_states", args[0] if args else None),
                                                   y=out[0] if isinstance(out, tuple) else out),
        with_kwargs=True)
    ids = torch.arange(3, 19).unsqueeze(0)
    with torch.no_grad():
        target(input_ids=ids)

    torch.manual_seed(0)
    model = method.build_model().eval()
    H = model.config.hidden_size
    with torch.no_grad():
        for proj in (model.layers[0].self_attn.q_proj, model.layers[0].self_attn.k_proj, model.layers[0].self_attn.v_proj):
            proj.weight[:, :H] = 0  # the next token's embedding reads nothing
        out = model.step(ids, seen["x"], torch.arange(ids.shape[1]).unsqueeze(0), [])
    torch.testing.assert_close(out, seen["y"], rtol=1e-5, atol=1e-5)

    torch.manual_seed(0)
    random = _method(recipe, run, norm_before_residual=False).build_model()
    with torch.no_grad():
        out = random.step(ids, seen["x"], torch.arange(ids.shape[1]).unsqueeze(0), [])
    assert (out - seen["y"]).abs().max() > 1e-2  # the default start is not the target's layer


def test_copied_and_kept_parts(prepared):
    recipe, run, _ = prepared
    torch.manual_seed(0)
    base = _method(recipe, run).build_model()
    torch.manual_seed(0)
    method = _method(recipe, run, init_layer_from_target=0)
    index, tensors = method.target_layer(0)
    model = method.build_model()
    layer, kept = model.layers[0], base.layers[0]
    H = model.config.hidden_size
    assert index == 0
    for name in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(getattr(layer.self_attn, name).weight[:, H:], tensors[f"self_attn.{name}.weight"])
        assert torch.equal(getattr(layer.self_attn, name).weight[:, :H], getattr(kept.self_attn, name).weight[:, :H])
    assert torch.equal(layer.self_attn.o_proj.weight, tensors["self_attn.o_proj.weight"])
    assert torch.equal(layer.mlp.down_proj.weight, tensors["mlp.down_proj.weight"])
    assert torch.equal(layer.hidden_norm.weight, tensors["input_layernorm.weight"])
    assert torch.equal(layer.post_attention_layernorm.weight, tensors["post_attention_layernorm.weight"])
    assert torch.equal(layer.input_layernorm.weight, kept.input_layernorm.weight)
    assert torch.equal(model.fc.weight, base.fc.weight) and torch.equal(model.lm_head.weight, base.lm_head.weight)


def test_bad_layer_index_and_two_starts_are_refused(prepared):
    recipe, run, _ = prepared
    n = int(_method(recipe, run).target_info.num_hidden_layers)
    with pytest.raises(ValueError, match=rf"init_layer_from_target={n}: the target has {n} decoder layers"):
        _method(recipe, run, init_layer_from_target=n).build_model()
    with pytest.raises(ValidationError, match="set one"):
        Recipe.model_validate({**recipe.model_dump(), "draft": {**recipe.draft.model_dump(), "init_from": "x",
                                                                "init_layer_from_target": -1}})


def test_shape_mismatch_names_the_tensor(prepared):
    recipe, run, _ = prepared
    method = _method(recipe, run, init_layer_from_target=-1)
    model = method.build_model()
    _, tensors = method.target_layer(-1)
    extra = {**tensors, "self_attn.q_norm.weight": torch.ones(4)}
    assert model.init_layer_from_target(extra) == ["self_attn.q_norm.weight"]  # reported, not silently dropped
    assert model.init_layer_from_target(tensors) == []
    tensors["mlp.up_proj.weight"] = tensors["mlp.up_proj.weight"][:-1]
    with pytest.raises(ValueError, match=r"mlp\.up_proj\.weight has shape"):
        model.init_layer_from_target(tensors)
    del tensors["mlp.up_proj.weight"]
    with pytest.raises(KeyError, match=r"mlp\.up_proj\.weight"):
        model.init_layer_from_target(tensors)


def test_init_fc_last_aux_passes_the_highest_aux_state(prepared):
    recipe, run, _ = prepared
    model = _method(recipe, run, init_fc="last_aux").build_model()
    Ht = model.config.target_hidden_size
    aux = torch.randn(2, 5, 3 * Ht)
    with torch.no_grad():
        torch.testing.assert_close(model.fuse(aux), aux[..., 2 * Ht:], rtol=0, atol=0)
        random = _method(recipe, run).build_model()
        assert (random.fuse(aux) - aux[..., 2 * Ht:]).abs().max() > 1e-2
    with pytest.raises(ValidationError, match="set one"):
        Recipe.model_validate({**recipe.model_dump(), "draft": {**recipe.draft.model_dump(), "init_from": "x",
                                                                "init_fc": "last_aux"}})
