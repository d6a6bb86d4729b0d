"""The tiny target's recipes (EAGLE-3 and the other methods on :data:`PROMPTS`) and a trained,
exported tiny draft."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from draftsmith.data_prep.prepare import prepare
from draftsmith.eval.export import export
from draftsmith.models.dflash.recipe import DFlashDraftConfig
from draftsmith.models.dflash2.recipe import DFlash2DraftConfig
from draftsmith.models.medusa.recipe import MedusaDraftConfig
from draftsmith.models.mlp_speculator.recipe import MLPSpeculatorDraftConfig
from draftsmith.recipe import dump_recipe, load_recipe
from draftsmith.train.checkpoint import find_checkpoints
from draftsmith.models.eagle3.training import Eagle3Method
from draftsmith.train.trainer import fit

from helpers import REPO
from helpers.tiny import CPU_VLLM, TINY_AUX, write_jsonl

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))  # every shipped recipe

PROMPTS = [
    "Translate to French: good morning.", "Write a haiku about autumn.", "What is the capital of Italy?",
    "Summarize: the meeting moved to Tuesday.", "def add(a, b): explain this.", "Return JSON with name and age.",
    "Name a quick brown animal.", "Why do foxes jump?",
]


def write_prompts(path: Path) -> Path:
    """:data:`PROMPTS` as a prompts file (ids ``p0``, ``p1``, ...)."""
    return write_jsonl(path, [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)])


def tiny_recipe(tiny_target: Path, prompts: Path, **train):
    overrides = [
        f"target.name_or_path={tiny_target}",
        f"data.sources=[{{path: {prompts}}}]",
        "data.eval_prompts=null",
        "data.regenerate.engine=transformers",
        "data.regenerate.max_new_tokens=24",
        "data.regenerate.temperatures=[0.0, 0.7]",
        f"data.aux_layer_ids={TINY_AUX}",
        "data.draft_vocab_size=128",
        "data.max_length=96",
        "data.sequences_per_shard=3",
        "draft.ttt_steps=3",
        "train.batch_size=8",
        "train.lr=0.003",
        "train.warmup_ratio=0.0",
        "train.log_every=1",
        "train.checkpoint_every=1000",
        f"vllm={json.dumps(CPU_VLLM)}",
    ] + [f"train.{k}={v}" for k, v in train.items()]
    return load_recipe(None, overrides)


def tiny_deployed_draft(tiny_target: Path, root: Path, max_steps: int = 5):
    """``(recipe, run dir, prompts file, export)``: the tiny target's draft prepared, trained
    ``max_steps`` steps on :data:`PROMPTS` and exported to ``root/export``."""
    run = root / "run"
    prompts = write_prompts(root / "prompts.jsonl")
    recipe = tiny_recipe(tiny_target, prompts, max_steps=max_steps)
    prepare(recipe, run)
    fit(recipe, Eagle3Method(recipe, run), run, progress=False)
    return recipe, run, prompts, export(find_checkpoints(run / "checkpoints")[-1], root / "export")


def medusa_recipe(tiny_target: Path, prompts: Path, **train):
    recipe = tiny_recipe(tiny_target, prompts, **train)
    recipe.draft = MedusaDraftConfig(num_heads=3, num_layers=1)
    return recipe


def mlp_recipe(tiny_target: Path, prompts: Path, **spec):
    recipe = tiny_recipe(tiny_target, prompts, max_steps=20, lr=0.01)
    recipe.draft = MLPSpeculatorDraftConfig(n_predict=3, inner_dim=64, **spec)
    return recipe


def dflash_recipe(tiny_target: Path, where: Path, section: type = DFlashDraftConfig, **draft):
    """The tiny target's block-drafting recipe (1 layer, blocks of 4, 40 steps), written to
    ``where/tiny_<method>.yaml``: DFlash, or with ``section=DSparkDraftConfig`` DSpark."""
    prompts = write_prompts(where / "prompts.jsonl")
    recipe = tiny_recipe(tiny_target, prompts, max_steps=40)
    recipe.draft = section(**{"num_layers": 1, "block_size": 4, "num_anchors": 64, "freeze_lm_head": False, **draft})
    recipe.name = f"tiny_{recipe.draft.method}"
    path = where / f"{recipe.name}.yaml"
    dump_recipe(recipe, path)
    return recipe, path


def dflash2_recipe(tiny_target: Path, where: Path, **draft):
    """The tiny target's DFlash2 recipe: :func:`dflash_recipe`'s, over the whole vocab (512)."""
    recipe, _ = dflash_recipe(tiny_target, where)
    recipe.data.draft_vocab_size = 512
    recipe.draft = DFlash2DraftConfig(**{"num_layers": 1, "block_size": 4, "num_anchors": 64, "freeze_lm_head": False,
                                         "conv_group_size": 32, "selector_rank": 16, "selector_top_k": 8, **draft})
    recipe.name = "tiny_dflash2"
    path = where / "tiny_dflash2.yaml"
    dump_recipe(recipe, path)
    return recipe, path


def peagle_recipe(tiny_target: Path, prompts: Path):
    """The tiny target's P-EAGLE recipe (2 layers, 3 depths, 30 steps) on ``prompts``."""
    base = tiny_recipe(tiny_target, prompts, max_steps=30)
    return load_recipe(None, [f"{k}={v}" for k, v in {
        "target.name_or_path": tiny_target, "data.sources": f"[{{path: {prompts}}}]", "data.eval_prompts": "null",
        "data.regenerate.engine": "transformers", "data.regenerate.max_new_tokens": 24,
        "data.regenerate.temperatures": "[0.0, 0.7]", "data.aux_layer_ids": base.data.aux_layer_ids,
        "data.draft_vocab_size": 128, "data.max_length": 96, "data.sequences_per_shard": 3,
        "draft": "{method: peagle, num_layers: 2, num_depths: 3}",
        "train.batch_size": 8, "train.lr": 0.003, "train.warmup_ratio": 0.0, "train.log_every": 1,
        "train.checkpoint_every": 1000, "train.max_steps": 30}.items()])


def small_recipe(tiny_target: Path, tmp_path: Path):
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
                                         {"role": "assistant", "content": f"The answer is {2 * i}, of course."}]}
            for i in range(5)]
    data = write_jsonl(tmp_path / "chats.jsonl", rows)
    return load_recipe(None, [
        f"target.name_or_path={tiny_target}",
        f"data.sources=[{{path: {data}}}]",
        "data.eval_prompts=null",
        "data.regenerate.enabled=false",
        "data.hidden_states_engine=transformers",
        "data.hidden_states_dtype=float32",
        f"data.aux_layer_ids={TINY_AUX}",
        "data.draft_vocab_size=128",
        "data.max_length=64",
        "data.sequences_per_shard=2",
    ])


def train_with_launch_module(recipe_path: Path, run: Path) -> None:
    """``python -m draftsmith.train RECIPE --run-dir RUN`` in a child process (the users' launch
    module, the method from the recipe); fails the test with the end of its stderr unless it exits 0."""
    proc = subprocess.run([sys.executable, "-m", "draftsmith.train", str(recipe_path), "--run-dir", str(run)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
