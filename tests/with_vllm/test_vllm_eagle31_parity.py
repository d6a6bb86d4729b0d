"""Parity of OUR EAGLE-3.1 draft options (``norm_before_fc``, ``fc_norm``, ``norm_output``;
models/eagle3/model.py) with vLLM 0.32's ``llama_eagle3``, built from OUR export.

As tests/with_vllm/test_vllm_eagle3_parity.py (machinery in tests/helpers/vllm_parity.py): a tiny
random draft with the options on (every norm weight random) is exported with ``eval/export.py``,
vLLM's own ``Eagle3LlamaForCausalLM`` is built from the export as its engine builds it, and both run
the first TTT step on the same inputs. Compared: the fused ``g`` (vLLM's ``combine_hidden_states``:
``input_norm`` over ``cat(aux)``, then ``fc_norm.{i}`` per aux state, then ``fc``), the hidden state
handed to the next draft step (vLLM's ``aux_output``: post-norm with ``norm_output``, ours
``next_hidden``) and the draft-vocab logits. The mutation test flips one option in the exported
``config.json`` and checks that parity then fails: vLLM reads each key, and our export writes the
one vLLM acts on.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from draftsmith.models.eagle3.config import EAGLE31_OPTIONS

from helpers.vllm_parity import (
    assert_parity,
    eagle3_draft_config,
    export_eagle3_draft,
    random_eagle3_draft,
    run_eagle3_both,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]

CASES = {**{k: {k: True} for k in EAGLE31_OPTIONS}, "all_three": dict.fromkeys(EAGLE31_OPTIONS, True)}


@pytest.mark.parametrize("legacy", [False, True], ids=["speculators", "legacy"])
@pytest.mark.parametrize("case", CASES)
def test_eagle31_option_matches_vllm_llama_eagle3(vllm_env, tmp_path, case, legacy):
    model, embed = random_eagle3_draft(eagle3_draft_config(**CASES[case]))
    export_dir = export_eagle3_draft(model, embed, tmp_path, legacy)
    config = json.loads((export_dir / "config.json").read_text())
    assert {k: config[k] for k in EAGLE31_OPTIONS} == model.config.eagle31_options()
    outs = run_eagle3_both(model, export_dir, vllm_env)
    assert_parity(outs)
    assert outs["logits"][0].abs().max() > 1.0  # a real signal, not zeros on both sides


def _flip(export_dir: Path, key: str) -> None:
    path = export_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg[key] = not cfg.get(key, False)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("was_on", [True, False], ids=["on_to_off", "off_to_on"])
@pytest.mark.parametrize("option", EAGLE31_OPTIONS)
def test_parity_fails_when_the_exported_option_is_flipped(vllm_env, tmp_path, option, was_on):
    model, embed = random_eagle3_draft(eagle3_draft_config(**{option: was_on}))
    export_dir = export_eagle3_draft(model, embed, tmp_path)
    assert_parity(run_eagle3_both(model, export_dir, vllm_env))  # the unflipped export agrees
    _flip(export_dir, option)
    if option == "fc_norm" and was_on:
        # vLLM builds no fc_norm and refuses the export's fc_norm.{i} tensors outright
        with pytest.raises(ValueError, match="no module or parameter named 'fc_norm'"):
            run_eagle3_both(model, export_dir, vllm_env)
        return
    # norm_before_fc / fc_norm: vLLM fuses with or without the norm (off -> on: its norm weights
    # stay at their initial ones), so g differs; norm_output: it hands the next step the other
    # of pre-norm / post-norm hidden, so only `hidden` differs
    with pytest.raises(AssertionError, match="hidden:" if option == "norm_output" else "g:"):
        assert_parity(run_eagle3_both(model, export_dir, vllm_env))
