"""A draft method added from outside draftsmith (issue 42): one package plus one entry point.

In ``tmp_path`` a third-party package ``toy_draft/`` (Medusa-like heads, registered as ``toy``)
and its ``toy_draft-0.1.dist-info/`` (``entry_points.txt``: ``[draftsmith.methods] toy =
toy_draft``) are written and put on ``PYTHONPATH``; a fresh interpreter then loads a recipe with
``draft.method: toy``, prepares the tiny target's data, trains a few steps, exports, and loads the
export back through the registry (:func:`draftsmith.eval.export.load_export`,
:func:`draftsmith.eval.spec_decode.load_draft`). Bad input: a second package registering
``dflash`` fails at import with one line naming both packages, and a recipe naming a method that
is not installed lists the installed ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"

TOY = {
    "__init__.py": '''
        """A toy draft method: Medusa-like heads under another name and export layout."""

        from draftsmith.methods import DraftMethodSpec, register

        register(DraftMethodSpec(
            name="toy", package=__name__, vllm_method="medusa", servable=False,
            parts={
                "recipe_config": ".recipe:ToyDraftConfig",
                "config_class": ".model:ToyConfig",
                "model_class": ".model:ToyModel",
                "format": ".format:TOY_FORMAT",
                "training_method": ".training:ToyMethod",
                "parameter_estimator": ".training:parameter_estimate",
                "proposer_factory": ".proposer:toy_proposer",
            }))
        ''',
    "recipe.py": '''
        from typing import Literal

        from pydantic import Field

        from draftsmith.draft_section import HeadsSection


        class ToyDraftConfig(HeadsSection):
            method: Literal["toy"] = Field("toy", description="Draft architecture (draftsmith.methods).")
            num_heads: int = Field(2, ge=1, le=8, description="Heads K; head k predicts x_{t+k+2}.")
        ''',
    "model.py": '''
        from dataclasses import dataclass

        from draftsmith.models.medusa.model import MedusaConfig, MedusaModel


        @dataclass
        class ToyConfig(MedusaConfig):
            pass


        class ToyModel(MedusaModel):
            pass
        ''',
    "format.py": '''
        import json
        from pathlib import Path

        from draftsmith.layout import ExportError
        from draftsmith.models.common import DraftCard, DraftFormat, checkpoint_model, load_head_export

        from .model import ToyConfig, ToyModel


        def shapes(cfg):
            H, V = cfg.hidden_size, cfg.vocab_size
            out = {}
            for k in range(cfg.num_heads):
                for layer in range(cfg.num_layers):
                    out[f"blocks.{k}.layers.{layer}.weight"] = (H, H)
                    out[f"blocks.{k}.layers.{layer}.bias"] = (H,)
                out[f"lm_heads.{k}.weight"] = (V, H)
            return out


        def export_toy(ckpt, dtype, version):
            cfg = ckpt.config
            model = checkpoint_model(ckpt, ToyModel(cfg), shapes(cfg), cfg.hidden_size, cfg.vocab_size)
            return model.state_dict(), {"model_type": "toy_heads", **cfg.to_dict(), "torch_dtype": dtype}


        def load_toy(directory, embed_tokens=None, lm_head=None):
            config = json.loads((Path(directory) / "config.json").read_text())
            if config.get("model_type") != "toy_heads":
                raise ExportError(f"{directory}: not a toy export")
            fields = {k: config[k] for k in ("hidden_size", "vocab_size", "num_heads", "num_layers")}
            return load_head_export(Path(directory), ToyModel(ToyConfig(**fields)), "")


        TOY_FORMAT = DraftFormat(
            layout="Toy", detect=lambda config: config.get("model_type") == "toy_heads", export=export_toy,
            load=load_toy, card=DraftCard("Toy", "Toy heads", lambda config: [], lambda config: config.get("num_heads")))
        ''',
    "training.py": '''
        from draftsmith.train.method_base import HeadMethod

        from .model import ToyConfig, ToyModel


        class ToyMethod(HeadMethod):
            name = "toy"

            def __init__(self, recipe, run_dir):
                super().__init__(recipe, run_dir)
                H, V = self.check_target_vocab()
                self.num_heads = recipe.draft.num_heads
                self.config = ToyConfig(hidden_size=H, vocab_size=V, num_heads=self.num_heads, num_layers=1)

            def build_model(self):
                return ToyModel(self.config)

            def head_forward(self, model, final, tokens, head_fn):
                return model(final, head_fn=head_fn)

            def draft_config(self):
                return self.config.to_dict()


        def parameter_estimate(recipe, cfg, vocab_size):
            K, H = recipe.draft.num_heads, cfg.hidden_size
            counts = {"heads": K * (H * H + H + vocab_size * H), "frozen_embedding": 0}
            return counts, K * recipe.train.batch_size * recipe.data.max_length * vocab_size * 4 * 3
        ''',
    "proposer.py": '''
        import torch

        from draftsmith.eval.spec_decode import Proposer, head_export

        from .format import load_toy


        class ToyProposer(Proposer):
            def __init__(self, model):
                self.model = model
                self.max_k = int(model.config.num_heads)

            @torch.no_grad()
            def propose(self, states, next_tokens, k, temperature, generator):
                weight = next(self.model.parameters())
                logits = self.model(states[-1:].to(weight.device, weight.dtype).view(1, 1, -1))[:k, 0, 0]
                return self._chain(lambda i, prev: logits[i].float(), k, temperature, generator)


        def toy_proposer(path, target_model=None):
            return ToyProposer(head_export(load_toy, path))
        ''',
}

RUN = '''
import json, sys
from pathlib import Path

import yaml

from helpers.recipes import tiny_recipe, write_prompts
from draftsmith.data_prep.prepare import prepare
from draftsmith.eval.export import export, load_export
from draftsmith.eval.spec_decode import load_draft
from draftsmith.methods import get_method, method_of_export, registered_methods
from draftsmith.recipe import load_recipe
from draftsmith.train.checkpoint import find_checkpoints
from draftsmith.train.trainer import fit

tiny_target, root = Path(sys.argv[1]), Path(sys.argv[2])
tree = tiny_recipe(tiny_target, write_prompts(root / "prompts.jsonl"), max_steps=4, lr=0.01).model_dump(mode="json")
tree["draft"] = {"method": "toy", "num_heads": 2}
(root / "toy.yaml").write_text(yaml.safe_dump(tree))
recipe = load_recipe(root / "toy.yaml")
spec = get_method(recipe.draft.method)
run = root / "run"
prepare(recipe, run)
result = fit(recipe, spec.training_method(recipe, run), run, progress=False)
out = export(find_checkpoints(run / "checkpoints")[-1], root / "export")
config = json.loads((out / "config.json").read_text())
model = load_export(out)
proposer = load_draft(out)
print(json.dumps({"methods": registered_methods(), "steps": result.steps, "type": type(recipe.draft).__name__,
                  "export_method": method_of_export(config).name, "model": type(model).__name__,
                  "proposer": type(proposer).__name__, "max_k": proposer.max_k}))
'''


def write_package(root: Path, name: str, files: dict[str, str], entry_point: str) -> int:
    """``root/name/`` with ``files`` and ``root/name-0.1.dist-info`` declaring ``entry_point``
    in the ``draftsmith.methods`` group; returns the files of the package written."""
    (root / name).mkdir(parents=True)
    for file, text in files.items():
        (root / name / file).write_text(textwrap.dedent(text).lstrip())
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[draftsmith.methods]\n{entry_point}\n")
    return len(files)


def python(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=root, timeout=900)


@pytest.mark.integration
def test_a_method_from_outside_trains_exports_and_loads_back(tiny_target, tmp_path):
    packages = tmp_path / "site"
    files = write_package(packages, "toy_draft", TOY, "toy = toy_draft")
    # what adding a method takes: the package's files plus one entry-point line
    assert (files, len((packages / "toy_draft-0.1.dist-info" / "entry_points.txt").read_text().splitlines()) - 1) == (6, 1)
    (tmp_path / "run.py").write_text(RUN)
    proc = python(packages, str(tmp_path / "run.py"), str(tiny_target), str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"methods": ["eagle3", "medusa", "mlp_speculator", "dflash", "peagle", "dspark", "dflash2",
                               "xpress", "mtp", "toy"],
                   "steps": 4, "type": "ToyDraftConfig", "export_method": "toy", "model": "ToyModel",
                   "proposer": "ToyProposer", "max_k": 2}
    assert json.loads((tmp_path / "export" / "config.json").read_text())["model_type"] == "toy_heads"


def test_a_second_package_registering_a_taken_name_is_one_warning_and_the_builtin_stays(tmp_path):
    init = TOY["__init__.py"].replace('name="toy"', 'name="dflash"')
    write_package(tmp_path, "clash_draft", {"__init__.py": init}, "dflash = clash_draft")
    proc = python(tmp_path, "-c", "from draftsmith.methods import get_method, registered_methods; "
                                  "print(get_method('dflash').package, 'eagle3' in registered_methods())")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["draftsmith.models.dflash", "True"]
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("method plug-in 'dflash' (entry point draftsmith.methods: dflash = clash_draft") and \
        line.endswith("was not loaded: ValueError: draft method 'dflash' is registered by both "
                      "draftsmith.models.dflash and clash_draft"), line


def test_a_package_registering_twice_is_one_warning_and_its_method_is_not_loaded(tmp_path):
    init = textwrap.dedent(TOY["__init__.py"])
    write_package(tmp_path, "twice_draft", {"__init__.py": init + init.split("\n\n", 2)[2]}, "toy = twice_draft")
    proc = python(tmp_path, "-c", "from draftsmith.methods import registered_methods; print(registered_methods())")
    assert proc.returncode == 0, proc.stderr
    assert "'toy'" not in proc.stdout and "'eagle3'" in proc.stdout
    [line] = proc.stderr.strip().splitlines()
    assert line.endswith("was not loaded: ValueError: draft method 'toy' is registered twice by twice_draft"), line


def test_a_recipe_naming_a_method_not_installed_lists_the_installed_ones(tmp_path):
    from draftsmith.recipe import RecipeError, load_recipe

    (tmp_path / "recipe.yaml").write_text("draft:\n  method: toy\n")

    with pytest.raises(RecipeError) as exc:
        load_recipe(tmp_path / "recipe.yaml")
    assert str(exc.value) == (f"{tmp_path / 'recipe.yaml'}: invalid recipe: draft: Input tag 'toy' found using "
                              "'method' does not match any of the expected tags: 'eagle3', 'medusa', "
                              "'mlp_speculator', 'dflash', 'peagle', 'dspark', 'dflash2', 'xpress', 'mtp'")
