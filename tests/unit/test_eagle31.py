"""EAGLE-3.1 options of the EAGLE-3 draft (``draft.norm_before_fc``, ``draft.fc_norm``,
``draft.norm_output``): off they change nothing, on each adds exactly its tensors and computes
what vLLM's ``llama_eagle3`` computes (the parity itself: tests/with_vllm/test_vllm_eagle31_parity.py),
the export writes and the loader reads them, a tiny draft trains with each, bad input is refused."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.eval.export import export, load_export
from draftsmith.layout import DraftLoadError, ExportError
from draftsmith.models.common import shift_left
from draftsmith.models.eagle3.model import Eagle3DraftModel
from draftsmith.models.eagle3.config import EAGLE31_OPTIONS
from draftsmith.models.eagle3.format import expected_weight_shapes
from draftsmith.recipe import RecipeError, load_recipe
from draftsmith.models.eagle3.training import ttt_plan, ttt_loss
from draftsmith.train.labels import ttt_prediction_masks
from draftsmith.train.losses import TargetDraftHead

from helpers.tiny import eagle3_tiny_config, randomize_norms, write_draft_checkpoint

H, HT = 32, 24  # draft hidden size, target hidden size (different, so the norm widths show)
CASES = {**{k: {k: True} for k in EAGLE31_OPTIONS}, "all_three": dict.fromkeys(EAGLE31_OPTIONS, True)}
ADDED = {"norm_before_fc": {"input_norm.weight": (3 * HT,)},
         "fc_norm": {f"fc_norm.{i}.weight": (HT,) for i in range(3)},
         "norm_output": {}}


def draft(seed: int = 0, **options) -> Eagle3DraftModel:
    """A tiny draft (random norm weights, a target embedding) with the EAGLE-3.1 ``options``."""
    torch.manual_seed(seed)
    model = randomize_norms(Eagle3DraftModel(eagle3_tiny_config(target_hidden_size=HT, **options)))
    model.init_from_target(torch.randn(model.config.vocab_size, H))
    return model


def inputs(B: int = 2, T: int = 10, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (B, T), generator=g), torch.randn(B, T, 3 * HT, generator=g)


def test_defaults_leave_the_tensor_set_config_and_outputs_of_eagle3_unchanged():
    model = draft()
    assert model.config.eagle31_options() == dict.fromkeys(EAGLE31_OPTIONS, False)
    assert model.input_norm is None and model.fc_norm is None
    assert not any(k.startswith(("input_norm", "fc_norm")) for k in model.state_dict())
    assert set(model.state_dict()) - {"embed_tokens"} == set(expected_weight_shapes(model.config))
    verifier = {"name_or_path": "t", "architectures": []}
    # the speculators export writes every key vLLM 0.33's reader reads, false here; the legacy one none
    speculators = model.config.to_speculators(verifier, 3, "float32", "0", {})
    assert {k: speculators[k] for k in EAGLE31_OPTIONS} == dict.fromkeys(EAGLE31_OPTIONS, False)
    assert not set(EAGLE31_OPTIONS) & set(model.config.to_legacy("float32", {}))
    # the EAGLE-3 arithmetic written out: fc(aux), then each step reads the previous pre-norm output
    ids, aux = inputs()
    with torch.no_grad():
        got = model(ids, aux, 3)
        pos, cache, hidden = torch.arange(ids.shape[1]).expand_as(ids), [], model.fc(aux)
        for k in range(3):
            hidden = model.step(shift_left(ids, k + 1), hidden, pos + k, cache)
            assert torch.equal(got[k], model.compute_logits(hidden))


@pytest.mark.parametrize("case", CASES)
def test_each_option_adds_exactly_its_tensors_and_round_trips_through_export(tmp_path, case):
    base, model = set(draft().state_dict()), draft(**CASES[case])
    added = {k: v for option in CASES[case] for k, v in ADDED[option].items()}
    assert {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in base} == added
    assert base <= set(model.state_dict())
    shapes = expected_weight_shapes(model.config)
    assert {k: shapes[k] for k in set(shapes) - base} == added
    for legacy in (False, True):
        out = tmp_path / f"legacy{legacy}"
        write_draft_checkpoint(model, out / "ckpt", "eagle3", {"name_or_path": "tiny"}, ttt_steps=3)
        export(out / "ckpt", out / "export", legacy=legacy, dtype="float32")
        config = json.loads((out / "export" / "config.json").read_text())
        assert {k: config[k] for k in EAGLE31_OPTIONS} == {k: k in CASES[case] for k in EAGLE31_OPTIONS}
        loaded = load_export(out / "export", embed_tokens=model.embed_tokens)
        assert loaded.config.eagle31_options() == model.config.eagle31_options()
        ids, aux = inputs()
        with torch.no_grad():
            for a, b in zip(loaded(ids, aux, 3), model.eval()(ids, aux, 3)):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("case", CASES)
def test_options_compute_the_norms_before_fc_and_feed_the_post_norm_hidden(case):
    model = draft(**CASES[case]).eval()
    cfg, ids, aux = model.config, *inputs()

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    x = aux
    if cfg.norm_before_fc:  # one norm over the whole concatenation
        x = rms(x, model.input_norm.weight)
    if cfg.fc_norm:  # then one norm per aux hidden state
        x = torch.cat([rms(c, n.weight) for c, n in zip(x.split(HT, -1), model.fc_norm)], -1)
    with torch.no_grad():
        g = x @ model.fc.weight.T
        torch.testing.assert_close(model.fuse(aux), g)
        got = model(ids, aux, 3)
        pos, cache, hidden = torch.arange(ids.shape[1]).expand_as(ids), [], g
        for k in range(3):
            out = model.step(shift_left(ids, k + 1), hidden, pos + k, cache)
            torch.testing.assert_close(got[k], model.compute_logits(out))
            hidden = rms(out, model.norm.weight) if cfg.norm_output else out
        # each option changes the draft's predictions (the same weights, options off, differ)
        plain = draft().eval()
        plain.load_state_dict(model.state_dict(), strict=False)
        assert not torch.allclose(plain(ids, aux, 3)[-1], got[-1])


@pytest.mark.parametrize("case", ["eagle3", *CASES])
def test_a_tiny_draft_trains_with_each_option(case):
    model = draft(**CASES.get(case, {})).train()
    head = TargetDraftHead(torch.randn(model.config.draft_vocab_size, H))
    ids, aux = inputs(B=4, T=16)
    final, mask = torch.randn(4, 16, H), torch.ones(4, 16, dtype=torch.long)
    plan = ttt_plan(ttt_prediction_masks(mask, 3))
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(8):
        loss, _ = ttt_loss(model, ids, aux, final, plan, 3, head, 0.8)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.9 * losses[0]
    for name, p in model.named_parameters():  # the option's norms are trained too
        if name.startswith(("input_norm", "fc_norm")):
            assert not torch.equal(p, start[name]), name


def test_recipe_keys_reach_the_draft_and_are_eagle3_only():
    recipe = load_recipe(None, ["draft.norm_before_fc=true", "draft.norm_output=true"])
    assert (recipe.draft.norm_before_fc, recipe.draft.fc_norm, recipe.draft.norm_output) == (True, False, True)
    defaults = load_recipe(None, [])
    assert not any(getattr(defaults.draft, k) for k in EAGLE31_OPTIONS)
    with pytest.raises(RecipeError, match="draft.fc_norm"):
        load_recipe(None, ["draft.fc_norm=maybe"])
    with pytest.raises(RecipeError, match="draft.norm_output"):
        load_recipe(None, ["draft.method=peagle", "draft.norm_output=true"])


def test_bad_input_names_the_option_key_or_tensor(tmp_path):
    with pytest.raises(ValueError, match="fc_norm must be true or false"):
        eagle3_tiny_config(fc_norm="yes")
    model = draft(fc_norm=True)
    write_draft_checkpoint(model, tmp_path / "ckpt", "eagle3", {"name_or_path": "tiny"}, ttt_steps=3)
    out = export(tmp_path / "ckpt", tmp_path / "export", dtype="float32")
    path = out / "config.json"
    good = json.loads(path.read_text())
    # config.json: a non-bool option; an option the weights do not carry; tensors the config does not claim
    for key, value, match in [("fc_norm", "yes", "config.json: fc_norm must be true or false"),
                              ("norm_before_fc", True, r"missing tensors \['input_norm.weight'\]"),
                              ("fc_norm", False, r"unexpected tensors \['fc_norm.0.weight'")]:
        path.write_text(json.dumps({**good, key: value}))
        with pytest.raises(DraftLoadError, match=match):
            load_export(out, embed_tokens=model.embed_tokens)
    # a checkpoint whose config claims an option its weights lack is refused at export
    ckpt = tmp_path / "ckpt" / "draft_config.json"
    meta = json.loads(ckpt.read_text())
    ckpt.write_text(json.dumps({**meta, "config": {**meta["config"], "norm_before_fc": True}}))
    with pytest.raises(ExportError, match=r"missing \['input_norm.weight'\]"):
        export(tmp_path / "ckpt", tmp_path / "export2")
    # an option key vLLM does not have (a misspelling) is refused at export, named
    ckpt.write_text(json.dumps({**meta, "config": {**meta["config"], "norm_input": True}}))
    with pytest.raises(ExportError, match="norm_input"):
        export(tmp_path / "ckpt", tmp_path / "export3")
    # P-EAGLE: vLLM 0.32's peagle reader drops fc_norm / norm_output and the draft has none of them
    from draftsmith.models.peagle.model import PEagleDraftModel
    from draftsmith.models.peagle.config import PEagleConfig

    with pytest.raises(ValueError, match="fc_norm, norm_output: EAGLE-3.1 options are for draft.method eagle3"):
        PEagleConfig.from_eagle3(eagle3_tiny_config(), fc_norm=True, norm_output=True)
    peagle = PEagleDraftModel(PEagleConfig.from_eagle3(eagle3_tiny_config(), mask_token_id=3))
    write_draft_checkpoint(peagle, tmp_path / "peagle", "peagle", {"name_or_path": "tiny"})
    meta_path = tmp_path / "peagle" / "draft_config.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "config": {**meta["config"], "fc_norm": True}}))
    with pytest.raises(ExportError, match="draft_config.json: invalid peagle config .fc_norm: EAGLE-3.1 options"):
        export(tmp_path / "peagle", tmp_path / "peagle_export")


def test_warm_start_keeps_the_exported_options_and_warns_when_the_recipe_differs(tmp_path, caplog):
    from draftsmith.models.eagle3.warm_start import load_init_weights, read_init_draft, warm_config

    model = draft(norm_before_fc=True, fc_norm=True, norm_output=True)
    write_draft_checkpoint(model, tmp_path / "ckpt", "eagle3", {"name_or_path": "tiny"}, ttt_steps=3)
    init = read_init_draft(export(tmp_path / "ckpt", tmp_path / "export", dtype="float32"))
    assert init.config.eagle31_options() == dict.fromkeys(EAGLE31_OPTIONS, True)
    with caplog.at_level("WARNING", logger="draftsmith.train"):
        config = warm_config(init, eagle3_tiny_config(target_hidden_size=HT, norm_output=True))
    assert config.eagle31_options() == dict.fromkeys(EAGLE31_OPTIONS, True)
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "norm_before_fc=True" in warned and "fc_norm=True" in warned and "norm_output" not in warned
    warm = Eagle3DraftModel(config)
    warm.init_from_target(model.embed_tokens)
    warm.set_vocab_mapping(model.d2t, model.t2d)
    load_init_weights(warm, init)
    for name in ("input_norm.weight", "fc_norm.2.weight"):
        assert torch.equal(warm.state_dict()[name], model.state_dict()[name])
