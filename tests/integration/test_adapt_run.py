"""``draftsmith adapt`` continues a deployed tiny draft on the traffic it served, with replay of
its original data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from draftsmith.cli import adapt as adapt_cli
from safetensors.torch import load_file

from helpers import folder_digest
from helpers.fake_inputs import served, write_log


@pytest.mark.integration
def test_adapt_continues_the_deployed_draft_on_its_traffic_with_replay(tiny_target, tmp_path):
    from draftsmith.models.eagle3.format import load_eagle3
    from draftsmith.recipe import dump_recipe
    from helpers.recipes import tiny_deployed_draft

    recipe, base, _, deployed = tiny_deployed_draft(tiny_target, tmp_path, max_steps=6)
    before = folder_digest(deployed)
    recipe_file = tmp_path / "recipe.yaml"
    dump_recipe(recipe, recipe_file)

    # "served traffic": the target's own replies (regen.jsonl) to other prompts, through the log schema
    regen = [json.loads(line) for line in (base / "data" / "regen.jsonl").read_text().splitlines()]
    rows = [served(i, "", r["messages"][-1]["content"], messages=[{"role": "user", "content": f"[{i}] " +
                                                                  r["messages"][0]["content"]}])
            for i, r in enumerate(regen)]
    rows.append(served(99, "cut", "half a", finish="length"))
    log = write_log(tmp_path / "traffic.jsonl", rows, tail='{"version": 1, "id": "trunc')
    run = tmp_path / "adapt"
    code = adapt_cli.main(["--log", str(log), "--deployed", str(deployed), "--recipe", str(recipe_file),
                           "--replay", str(base / "data" / "regen.jsonl"), "--replay-share", "0.25",
                           "--run-dir", str(run), "--holdout", "0.2", "--min-conversations", "4",
                           "--budget-minutes", "20", "--set", "train.max_steps=4"])
    assert code == 0
    result = json.loads((run / "adapt.json").read_text())
    n = result["conversations"]
    assert n["traffic_train"] + n["heldout"] == len(regen) + 1  # the reply cut by max_tokens too
    assert n["replay"] == round(n["traffic_train"] * 0.25 / 0.75)
    assert result["traffic"]["skipped"] == {"unparseable line": 1} and result["traffic"]["cut"] == 1
    held = [json.loads(line)["messages"][0]["content"] for line in (run / "traffic" / "heldout.jsonl").open()]
    trained = [json.loads(line)["messages"][0]["content"] for line in (run / "traffic" / "train.jsonl").open()]
    assert len(held) == n["heldout"] and not set(held) & set(trained)
    from draftsmith.layout import DataPaths, read_tokenized

    assert len(read_tokenized(DataPaths(run / "data"))["input_ids"]) == n["traffic_train"] + n["replay"]
    # the served replies were used as they are: no regeneration, the adapted recipe says so
    assert "enabled: false" in (run / "adapt_recipe.yaml").read_text()
    # the new draft loads, differs from the deployed one, and the deployment was not touched
    out = Path(result["out"])
    cfg = json.loads((out / "config.json").read_text())["transformer_layer_config"]
    model = load_eagle3(out, embed_tokens=torch.zeros(cfg["vocab_size"], cfg["hidden_size"]))
    assert model.config.aux_layer_ids == json.loads((deployed / "config.json").read_text())[
        "eagle_aux_hidden_state_layer_ids"]
    new, old = load_file(str(out / "model.safetensors")), load_file(str(deployed / "model.safetensors"))
    assert any(not torch.equal(new[k], old[k]) for k in ("fc.weight", "layers.0.mlp.down_proj.weight"))
    assert folder_digest(deployed) == before
    assert result["cpu_seconds"] > 0 and result["wall_seconds"] > 0
    shutil.rmtree(run / "data")
