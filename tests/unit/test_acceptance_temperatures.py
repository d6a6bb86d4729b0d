"""``draftsmith acceptance`` at several temperatures: one engine generates the prompts once per
temperature, each temperature's figures come from its own counter difference, the first (served)
temperature's figures are the top level's and the profile's, and a recipe served at T > 0 is
measured at T = 0 as well (no engine started: a stand-in ``vllm.LLM`` and worker process)."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from draftsmith.cli import acceptance as acceptance_cli
from draftsmith.cli.acceptance import build_parser, served_temperatures
from draftsmith.eval import acceptance
from draftsmith.vllm_bridge import spec_config
from draftsmith.eval.profile import read_profile
from draftsmith.eval.results import read_acceptance

from test_acceptance import FakeWorkerProcess, export_dir

# accepted tokens per prompt at each temperature: the stand-in engine accepts less when it samples
ACCEPTED = {0.0: [2, 1, 0], 1.0: [1, 0, 0]}


class CumulativeLLM:
    """vLLM's counters are cumulative over the engine's life: each ``chat`` adds one draft per
    prompt, three draft tokens, and ``ACCEPTED[temperature]`` per position."""

    def __init__(self, **kwargs):
        self.totals = {"drafts": 0, "draft_tokens": 0, "per_pos": [0, 0, 0]}
        self.temperatures: list[float] = []

    def chat(self, convs, params, use_tqdm=True):
        t = params["temperature"]
        self.temperatures.append(t)
        self.totals["drafts"] += len(convs)
        self.totals["draft_tokens"] += 3 * len(convs)
        self.totals["per_pos"] = [a + len(convs) * b for a, b in zip(self.totals["per_pos"], ACCEPTED[t])]
        CumulativeLLM.last = self
        return [types.SimpleNamespace(prompt_token_ids=[1, 2, 3], outputs=[types.SimpleNamespace(token_ids=[5] * (2 + int(t)))])
                for _ in convs]

    def get_metrics(self):
        m = lambda name, **kw: types.SimpleNamespace(name=name, **kw)  # noqa: E731
        return [m("vllm:spec_decode_num_drafts", value=self.totals["drafts"]),
                m("vllm:spec_decode_num_draft_tokens", value=self.totals["draft_tokens"]),
                m("vllm:spec_decode_num_accepted_tokens", value=sum(self.totals["per_pos"])),
                m("vllm:spec_decode_num_accepted_tokens_per_pos", values=list(self.totals["per_pos"]))]


@pytest.fixture
def cumulative_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = CumulativeLLM, lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setattr("draftsmith.eval.acceptance.configure_vllm_env", lambda engine=None: None)


def test_one_engine_measures_each_temperature_from_its_own_counters(tmp_path, cumulative_vllm):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) + "\n" for i in range(4)))
    result = tmp_path / "result.json"
    args = build_parser().parse_args(["--worker", "--result", str(result), "--target", "tiny-target", "--draft",
                                      str(export_dir(tmp_path, "eagle3")), "--prompts", str(prompts), "--k", "3",
                                      "--temperature", "1,0", "--engine-json", "{}"])
    acceptance.worker(args)
    assert CumulativeLLM.last.temperatures == [1.0, 0.0]  # the served temperature first, one engine
    r = json.loads(result.read_text())
    # the top level is T=1's alone (1 accepted per draft), not the engine's totals over both passes
    assert r["temperature"] == 1.0 and r["counters"]["drafts"] == 4 and r["counters"]["per_pos"] == [4, 0, 0]
    assert r["mean_acceptance_length"] == pytest.approx(2.0) and r["output_tokens"] == 12
    by_t = r["by_temperature"]
    assert set(by_t) == {"1.0", "0.0"}  # JSON keys; the model parses them back to floats
    assert by_t["0.0"]["counters"]["per_pos"] == [8, 4, 0] and by_t["0.0"]["mean_acceptance_length"] == pytest.approx(4.0)
    assert by_t["0.0"]["per_position_acceptance"] == [2.0, 1.0, 0.0] and by_t["0.0"]["output_tokens"] == 8
    assert by_t["1.0"]["mean_acceptance_length"] == pytest.approx(2.0)


def test_one_temperature_writes_no_by_temperature(tmp_path, cumulative_vllm):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    result = tmp_path / "result.json"
    args = build_parser().parse_args(["--worker", "--result", str(result), "--target", "t", "--draft",
                                      str(export_dir(tmp_path, "eagle3")), "--prompts", str(prompts),
                                      "--engine-json", "{}"])
    acceptance.worker(args)
    r = json.loads(result.read_text())
    assert r["temperature"] == 0.0 and "by_temperature" not in r and r["mean_acceptance_length"] == pytest.approx(4.0)


@pytest.mark.parametrize("flag, recipe_t, want", [
    (None, None, (0.0,)), (None, 0.0, (0.0,)), (None, 1.0, (1.0, 0.0)), (None, 0.7, (0.7, 0.0)),
    ((0.0, 1.0), 1.0, (0.0, 1.0)),  # the flag wins, in its order
])
def test_served_temperature_and_greedy_by_default(flag, recipe_t, want):
    assert served_temperatures(flag, recipe_t) == want


@pytest.mark.parametrize("text, message", [("1,1", "repeats a temperature"), ("0,-1", "out of range"),
                                           ("0,x", "is not a number")])
def test_bad_temperature_lists_are_usage_errors(text, message, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--target", "t", "--temperature", text])
    assert exc.value.code == 2 and message in capsys.readouterr().err


class TwoTemperatureWorker(FakeWorkerProcess):
    """The stand-in worker, answering with figures for each temperature it was asked for."""

    def __init__(self, cmd, **kwargs):
        super().__init__(cmd, **kwargs)
        temps = [float(t) for t in cmd[cmd.index("--temperature") + 1].split(",")]
        path = Path(cmd[cmd.index("--result") + 1])
        r = json.loads(path.read_text())
        r["temperature"] = temps[0]
        if len(temps) > 1:
            r["by_temperature"] = {str(t): {"temperature": t, **acceptance.summarise(
                {"drafts": 4, "draft_tokens": 12, "accepted_tokens": 4 - 2 * i, "per_pos": [4 - 2 * i, 0, 0]}, 3)}
                for i, t in enumerate(temps)}
        path.write_text(json.dumps(r))


def test_a_recipe_served_at_t1_is_measured_at_t1_and_t0(tmp_path, monkeypatch, capsys):
    draft, target = export_dir(tmp_path, "eagle3"), tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 8192, "hidden_size": 64, "vocab_size": 256, "num_hidden_layers": 4}))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("name: t\ntarget: {name_or_path: t}\ndata: {sources: [{path: builtin:train}]}\n"
                      "draft: {method: eagle3}\neval: {temperature: 1.0}\n")
    FakeWorkerProcess.commands = []
    monkeypatch.setattr(subprocess, "Popen", TwoTemperatureWorker)
    out = tmp_path / "acceptance.json"
    assert acceptance_cli.main(["--recipe", str(recipe), "--target", str(target), "--draft", str(draft),
                                "--out", str(out)]) == 0
    (cmd,) = FakeWorkerProcess.commands
    assert cmd[cmd.index("--temperature") + 1] == "1,0"
    printed = capsys.readouterr().out
    assert "eagle3 T=1 AL" in printed and "eagle3 T=0 AL" in printed
    r = read_acceptance(out)["eagle3"]
    assert r.temperature == 1.0 and sorted(r.by_temperature) == [0.0, 1.0]
    assert r.by_temperature[0.0].num_accepted_tokens == 2 and r.by_temperature[1.0].num_accepted_tokens == 4
    # the profile describes the served temperature's measurement
    assert read_profile(draft / "speculation_profile.json").measurement_conditions["temperature"] == 1.0


def fake_simulator(monkeypatch, record):
    """Stands in for ``draftsmith simulate``'s simulator; returns the list of ``record(temps,
    draft_sampling)`` of each call."""
    seen = []

    def fake_simulate(draft, data, k, temps, batch_size, draft_sampling):
        seen.append(record(temps, draft_sampling))
        return {"val_sim_al": 1.5, **{f"val_sim_rate_{i}": 0.1 for i in range(k)}, "num_sequences": 1,
                "val_chains": 1.0, **{f"val_sim_al_t{t:g}": 1.2 for t in temps if t}}

    monkeypatch.setattr("draftsmith.eval.simulate.simulator", lambda: fake_simulate)
    return seen


@pytest.mark.parametrize("argv, want", [
    ([], (0.0,)),
    (["--recipe", "RECIPE"], (1.0, 0.0)),  # the served temperature first, then greedy
    (["--recipe", "RECIPE", "--temperatures", "0.7"], (0.7,)),  # the flag wins
])
def test_simulate_measures_the_recipes_served_temperature_and_t0(tmp_path, monkeypatch, argv, want):
    from draftsmith.cli import simulate as simulate_cli

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("name: t\neval: {temperature: 1.0}\n")
    seen = fake_simulator(monkeypatch, lambda temps, draft_sampling: temps)
    argv = [str(recipe) if a == "RECIPE" else a for a in argv]
    assert simulate_cli.main(["--draft", str(tmp_path), "--data", str(tmp_path), *argv]) == 0
    assert seen == [want]


@pytest.mark.parametrize("recipe_text, argv, want", [
    ("name: t\n", [], "greedy"),
    ("name: t\neval: {temperature: 1.0, draft_sampling: probabilistic}\n", ["--recipe", "RECIPE"], "sample"),
    ("name: t\neval: {draft_sampling: probabilistic}\n", ["--recipe", "RECIPE", "--draft-sampling", "greedy"], "greedy"),
    ("name: t\n", ["--draft-sampling", "probabilistic"], "sample"),  # vLLM's name for drafts sampled from q
])
def test_simulate_drafts_as_the_recipe_serves(tmp_path, monkeypatch, recipe_text, argv, want):
    from draftsmith.cli import simulate as simulate_cli

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(recipe_text)
    seen = fake_simulator(monkeypatch, lambda temps, draft_sampling: draft_sampling)
    argv = [str(recipe) if a == "RECIPE" else a for a in argv]
    assert simulate_cli.main(["--draft", str(tmp_path), "--data", str(tmp_path), *argv]) == 0
    assert seen == [want]


@pytest.mark.parametrize("sets, want", [
    ([], [0.0]),
    (["eval.temperature=1.0"], [1.0, 0.0]),  # validation simulates the served temperature first, then greedy
    (["eval.temperature=1.0", "train.eval_temperatures=[0.7]"], [0.7]),  # the train key wins
])
def test_validation_and_the_soft_mask_follow_the_served_temperature(sets, want):
    from draftsmith.recipe import load_recipe
    from draftsmith.train.losses import AcceptSpec

    recipe = load_recipe(None, [*sets, "draft.accept_weighting=soft"])
    assert recipe.validation_temperatures == want
    assert AcceptSpec.from_recipe(recipe).temperature == want[0]


@pytest.mark.parametrize("sets, want", [
    ([], "greedy"),
    (["eval.draft_sampling=probabilistic"], "sample"),  # validation simulates the draft as it is served
    (["eval.draft_sampling=probabilistic", "train.eval_draft_sampling=greedy"], "greedy"),  # the train key wins
])
def test_validation_simulates_the_served_draft_sampling(sets, want):
    from draftsmith.recipe import load_recipe

    assert load_recipe(None, sets).validation_draft_sampling == want


def test_the_gpt_oss_recipes_are_measured_at_t1_and_t0():
    from draftsmith.recipe import load_recipe
    from draftsmith.resources import shipped_recipe_names

    for name in shipped_recipe_names():
        if name.startswith("gptoss"):
            assert load_recipe(name).validation_temperatures == [1.0, 0.0], name


def test_the_recipes_served_at_t1_draft_probabilistically_where_vllm_can():
    """Every shipped recipe served at T > 0 whose method's vLLM proposer reads draft_sample_method
    drafts probabilistically (docs/temperature.md); the others stay greedy, and each recipe's setting
    builds a speculative config."""
    from draftsmith.methods import get_method
    from draftsmith.recipe import load_recipe
    from draftsmith.resources import shipped_recipe_names

    for name in shipped_recipe_names():
        recipe = load_recipe(name)
        spec = get_method(recipe.draft.method)
        if not spec.servable:
            continue
        spec_config.for_export(spec, "d", 3, recipe.eval.draft_sampling)  # raises where vLLM cannot
        if recipe.eval.temperature > 0 and spec.vllm_method in spec_config.PROBABILISTIC_METHODS:
            assert recipe.eval.draft_sampling == "probabilistic", name
