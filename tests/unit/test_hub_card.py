"""The README's Hub command on a tiny run's outputs: the card's front matter and figures, for
each registered method's export layout (no --push, no network)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from draftsmith.cli import hub as hub_cli
from draftsmith.eval import hub
from draftsmith.eval.results import AcceptanceResult, write_acceptance
from draftsmith.recipe import dump_recipe, load_recipe

ROOT = Path(__file__).resolve().parents[2]
REPO = "alice/smollm2-draft"
TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"

# config.json of each method's export, as its format (models/<method>/format.py) writes it
EXPORT_CONFIGS = {
    "eagle3": {
        "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
        "speculators_config": {"algorithm": "eagle3", "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                               "verifier": {"name_or_path": TARGET}},
        "draft_vocab_size": 8192, "target_hidden_size": 576, "eagle_aux_hidden_state_layer_ids": [2, 15, 27],
        "norm_before_residual": True, "transformer_layer_config": {"vocab_size": 49152, "hidden_size": 576},
    },
    "medusa": {
        "architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": 576, "vocab_size": 49152,
        "num_heads": 4, "num_hidden_layers": 1, "truncated_vocab_size": None, "medusa_fc_bias": True,
        "torch_dtype": "float32", "draftsmith": {"verifier": TARGET, "head_decay": 0.8},
    },
    "mlp_speculator": {
        "architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator", "vocab_size": 49152,
        "emb_dim": 576, "inner_dim": 256, "n_predict": 2, "tie_weights": True, "scale_input": True,
        "torch_dtype": "float32", "draftsmith": {"verifier": TARGET, "head_decay": 0.8},
    },
}
RECIPES = {"eagle3": "smollm2_135m.yaml", "medusa": "smollm2_135m_medusa.yaml",
           "mlp_speculator": "smollm2_135m_mlp_speculator.yaml"}


def _run_outputs(tmp_path: Path, method: str) -> dict[str, Path]:
    """What a run leaves for the Hub command: the export, the resolved recipe (with a Hub dataset
    among its sources) and eval/acceptance.py's --out JSON written by its writer."""
    export = tmp_path / "run" / "export" / method
    export.mkdir(parents=True)
    (export / "config.json").write_text(json.dumps(EXPORT_CONFIGS[method]))
    save_file({"w": torch.ones(2, 3)}, str(export / "model.safetensors"))
    recipe = load_recipe(ROOT / "recipes" / RECIPES[method],
                         ["data.sources=[{path: builtin:train}, {path: HuggingFaceH4/ultrachat_200k, max_rows: 500}]"])
    dump_recipe(recipe, tmp_path / "run" / "recipe.yaml")
    k = {"eagle3": 3, "medusa": 4, "mlp_speculator": 2}[method]
    acc = AcceptanceResult(method=method, num_speculative_tokens=k, temperature=0.0, prompts="builtin:eval", num_prompts=56,
                           output_tokens=7000, generate_seconds=70.0, output_tokens_per_s=100.0,
                           counters={"drafts": 1000, "draft_tokens": 1000 * k, "accepted_tokens": 600},
                           num_drafts=1000, num_draft_tokens=1000 * k, num_accepted_tokens=600,
                           acceptance_rate=600 / (1000 * k), mean_acceptance_length=1.6,
                           per_position_acceptance=[0.4, 0.2] + [0.0] * (k - 2))
    return {"export": export, "recipe": tmp_path / "run" / "recipe.yaml",
            "acceptance": write_acceptance(tmp_path / "run" / "eval" / "acceptance.json", {method: acc})}


def _hub_argv(run: dict[str, Path], out: Path) -> list[str]:
    """The README's command line (without --push)."""
    return [str(run["export"]), "--out", str(out), "--repo-id", REPO, "--recipe", str(run["recipe"]),
            "--acceptance", str(run["acceptance"])]


def _card(out: Path) -> tuple[dict, str]:
    _, front, body = (out / "README.md").read_text().split("---\n", 2)
    return yaml.safe_load(front), body


@pytest.mark.parametrize("method", ["eagle3", "medusa", "mlp_speculator"])
def test_readme_hub_command_writes_front_matter_for_the_target_license_datasets_and_library(tmp_path, method):
    run = _run_outputs(tmp_path, method)
    proc = subprocess.run([sys.executable, "-m", "draftsmith.cli.hub", *_hub_argv(run, tmp_path / "hub")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    meta, _ = _card(tmp_path / "hub")
    assert meta["base_model"] == TARGET
    assert meta["license"] == "other"  # the target is no local directory with a model card
    assert meta["datasets"] == ["HuggingFaceH4/ultrachat_200k"]  # builtin:train has no Hub id
    assert meta["library_name"] == "vllm"
    assert method in meta["tags"] and "speculative-decoding" in meta["tags"]


def test_eagle3_card_names_the_method_serve_line_and_measured_acceptance(tmp_path):
    run = _run_outputs(tmp_path, "eagle3")
    assert hub_cli.main(_hub_argv(run, tmp_path / "hub")) == 0
    _, body = _card(tmp_path / "hub")
    assert body.startswith(f"\n# EAGLE-3 draft for {TARGET}")
    spec = {"method": "eagle3", "model": REPO, "num_speculative_tokens": 3}
    assert f"vllm serve {TARGET} --speculative-config '{json.dumps(spec)}'" in body
    assert "[2, 15, 27]" in body and "8192 of the target's 49152" in body
    assert "`builtin:train`, `HuggingFaceH4/ultrachat_200k` (first 500 rows)" in body
    assert "| eagle3 | 3 | 0.0 | 56 (`builtin:eval`) | 1.60 | 20.0% | 0.40 / 0.20 / 0.00 |" in body


def test_medusa_card_describes_heads_and_serves_as_medusa(tmp_path):
    run = _run_outputs(tmp_path, "medusa")
    assert hub_cli.main(_hub_argv(run, tmp_path / "hub")) == 0
    _, body = _card(tmp_path / "hub")
    assert body.startswith(f"\n# Medusa draft for {TARGET}")
    assert "- method: Medusa, 4 heads" in body and "EAGLE-3" not in body
    spec = {"method": "medusa", "model": REPO, "num_speculative_tokens": 4}
    assert f"--speculative-config '{json.dumps(spec)}'" in body
    assert "| medusa | 4 | 0.0 | 56 (`builtin:eval`) | 1.60 | 15.0% | 0.40 / 0.20 / 0.00 / 0.00 |" in body


def test_mlp_speculator_card_says_vllm_serve_does_not_run_it_here(tmp_path):
    run = _run_outputs(tmp_path, "mlp_speculator")
    assert hub_cli.main(_hub_argv(run, tmp_path / "hub")) == 0
    _, body = _card(tmp_path / "hub")
    assert body.startswith(f"\n# MLP speculator draft for {TARGET}")
    assert "- method: MLP speculator, 2 stages" in body and "vllm serve" not in body


def test_license_flag_and_the_targets_own_card_set_the_license(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny\n")
    cfg = dict(EXPORT_CONFIGS["medusa"], draftsmith={"verifier": str(target)})
    assert "license: apache-2.0" in hub.model_card(cfg, REPO)
    assert "license: mit" in hub.model_card(cfg, REPO, card_license="mit")


def test_an_attachment_of_another_schema_is_refused_naming_the_file(tmp_path):
    run = _run_outputs(tmp_path, "eagle3")
    bad = tmp_path / "results.json"
    bad.write_text(json.dumps({"meta": {}, "configs": {"eagle3": {"status": "maybe"}}}))
    with pytest.raises(hub.HubError, match="results.json: cannot read the serving results"):
        hub.prepare_folder(run["export"], tmp_path / "hub", REPO, serve=bad)


def test_dflash_and_peagle_exports_get_their_own_card_text():
    from draftsmith.models.dflash.config import DFlashConfig
    from draftsmith.models.peagle.config import PEagleConfig

    verifier = {"name_or_path": TARGET, "architectures": ["LlamaForCausalLM"]}
    dflash = DFlashConfig(hidden_size=576, intermediate_size=1536, num_layers=2, num_attention_heads=9,
                          num_key_value_heads=3, head_dim=64, vocab_size=49152, draft_vocab_size=8192,
                          aux_layer_ids=[2, 15, 27], block_size=8, mask_token_id=5)
    peagle = PEagleConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                          head_dim=64, vocab_size=49152, draft_vocab_size=8192, aux_layer_ids=[2, 15, 27],
                          num_layers=2, num_depths=4, mask_token_id=5)
    cards = {"dflash": hub.model_card(dflash.to_speculators(verifier, 7, "bfloat16", "0.3.0", {}), REPO),
             "peagle": hub.model_card(peagle.to_speculators(verifier, 3, "bfloat16", "0.3.0", {"num_depths": 4}),
                                       REPO)}
    assert "# DFlash draft for" in cards["dflash"] and "arXiv:2602.06036" in cards["dflash"]
    assert "block of 8 positions" in cards["dflash"] and "num_speculative_tokens 7" in cards["dflash"]
    assert '"method": "dflash"' in cards["dflash"]
    assert "# P-EAGLE draft for" in cards["peagle"] and "arXiv:2602.01469" in cards["peagle"]
    assert "up to 4 tokens" in cards["peagle"] and "default num_speculative_tokens 3" in cards["peagle"]
    assert '"parallel_drafting": true' in cards["peagle"]


def test_card_says_when_the_profile_measured_no_drafts():
    from draftsmith.eval.profile import build_profile

    prof = build_profile({"method": "medusa", "num_speculative_tokens": 2, "temperature": 0.7,
                          "counters": {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "per_pos": [0, 0]}}, TARGET)
    card = hub.model_card(EXPORT_CONFIGS["medusa"], REPO, profile=prof)
    assert "AL — at K = 2" in card and "temperature 0.7" in card and "no drafts were measured" in card
    assert "| 1 | 0.000 | 0.000 | 0 / 0 |" in card
