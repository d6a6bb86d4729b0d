"""eval/acceptance.py picks vLLM's speculative_config, the target check and the result's method
name from the draft-method registry, for every method vLLM serves (no engine started here: the
worker runs with a stand-in ``vllm.LLM``, the parent with a stand-in worker process)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from draftsmith.eval import acceptance
from draftsmith.cli import acceptance as acceptance_cli
from draftsmith.cli.acceptance import build_parser
from draftsmith.eval.acceptance import DraftMismatchError, draft_method, vllm_speculative_config
from draftsmith.eval.profile import read_profile
from draftsmith.methods import get_method
from draftsmith.vllm_bridge import spec_config

VERIFIER = {"name_or_path": "tiny-target", "architectures": ["LlamaForCausalLM"]}
LAYER = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
         "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "rope_theta": 10000.0}

# config.json of each export format, as docs/formats.md gives them (tiny sizes)
CONFIGS = {
    "peagle": {
        "architectures": ["PEagleSpeculator"], "speculators_model_type": "peagle",
        "speculators_config": {"algorithm": "peagle", "verifier": VERIFIER,
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4}]},
        "transformer_layer_config": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **LAYER},
        "draft_vocab_size": 128, "target_hidden_size": 64, "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
        "mask_token_id": 3,
    },
    "dflash_speculators": {
        "architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
        "speculators_config": {"algorithm": "dflash", "verifier": VERIFIER},
        "transformer_layer_config": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **LAYER},
        "draft_vocab_size": 256, "target_hidden_size": 64, "block_size": 8, "aux_hidden_state_layer_ids": [1, 2, 3],
        "mask_token_id": 3, "sliding_window_non_causal": True,
    },
    "dflash_native": {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", **LAYER, "draft_vocab_size": 256,
        "block_size": 8, "num_target_layers": 4, "target_hidden_size": 64,
        "dflash_config": {"mask_token_id": 3, "target_layer_ids": [0, 1, 2], "causal": False},
    },
    "eagle3": {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "speculators_config": {"algorithm": "eagle3", "verifier": VERIFIER},
        "transformer_layer_config": {"model_type": "llama", **LAYER, "num_hidden_layers": 1},
        "draft_vocab_size": 128, "target_hidden_size": 64, "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
    },
    "mlp_speculator": {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
                       "emb_dim": 64, "inner_dim": 64, "vocab_size": 256, "n_predict": 3},
}


def export_dir(tmp_path: Path, fmt: str) -> Path:
    out = tmp_path / fmt
    out.mkdir()
    (out / "config.json").write_text(json.dumps(CONFIGS[fmt]))
    return out


def test_peagle_export_is_served_as_eagle3_with_parallel_drafting(tmp_path):
    draft = export_dir(tmp_path, "peagle")
    for method in ("draft", "peagle"):
        assert vllm_speculative_config(method, draft, 4) == (
            "peagle", {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 4, "parallel_drafting": True})


@pytest.mark.parametrize("fmt", ["dflash_speculators", "dflash_native"])
def test_dflash_export_is_served_as_dflash(tmp_path, fmt):
    draft = export_dir(tmp_path, fmt)
    for method in ("draft", "dflash"):
        assert vllm_speculative_config(method, draft, 7) == (
            "dflash", {"method": "dflash", "model": str(draft), "num_speculative_tokens": 7})


def test_method_eagle3_still_names_an_eagle3_export(tmp_path):
    draft = export_dir(tmp_path, "eagle3")
    want = ("eagle3", {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3})
    assert vllm_speculative_config("eagle3", draft, 3) == vllm_speculative_config("draft", draft, 3) == want


def test_ngram_and_none_need_no_draft():
    assert vllm_speculative_config("none", None, 3) == ("none", None)
    assert vllm_speculative_config("ngram", None, 5, ngram_min=1, ngram_max=3) == (
        "ngram", {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 1})


@pytest.mark.parametrize("method, fmt", [("eagle3", "peagle"), ("peagle", "eagle3"), ("dflash", "peagle"),
                                         ("medusa", "dflash_native")])
def test_naming_another_method_than_the_exports_is_refused(tmp_path, method, fmt):
    draft = export_dir(tmp_path, fmt)
    with pytest.raises(DraftMismatchError, match=f"config.json: an export of method '{fmt.split('_')[0]}', not '{method}'"):
        draft_method(method, draft)


def test_drafts_vllm_does_not_serve_are_refused_naming_the_file(tmp_path):
    with pytest.raises(ValueError, match="needs a draft directory"):
        draft_method("draft", None)
    with pytest.raises(ValueError, match="config.json missing"):
        draft_method("draft", tmp_path)
    with pytest.raises(ValueError, match="mlp_speculator/config.json.*not a draft vLLM serves"):
        draft_method("draft", export_dir(tmp_path, "mlp_speculator"))
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="odd/config.json"):
        draft_method("eagle3", tmp_path / "odd")


def test_cli_method_defaults_to_the_exports_own_and_lists_every_served_method():
    p = build_parser()
    assert p.parse_args(["--target", "t"]).method == "draft"
    assert p.parse_args(["--target", "t", "--method", "eagle3"]).method == "eagle3"
    choices = next(a for a in p._actions if a.dest == "method").choices
    assert choices == ["draft", "eagle3", "medusa", "dflash", "peagle", "dspark", "dflash2", "xpress", "mtp", "ngram",
                       "none"]  # mlp_speculator: not served
    undocumented = [a.option_strings[0] for a in p._actions if a.option_strings and not (a.help and a.help.strip())]
    assert undocumented == []


class FakeLLM:
    """Stands in for ``vllm.LLM``: records its arguments, answers two tokens per prompt (a
    ``RequestOutput`` with a three-token prompt) and spec-decode counters of 4 drafts with 3 accepted tokens
    once it has generated (vLLM's counters are cumulative from 0)."""

    created: list[dict] = []

    def __init__(self, **kwargs):
        FakeLLM.created.append(kwargs)
        self.generated = False

    def chat(self, convs, params, use_tqdm=True):
        self.generated = True
        return [types.SimpleNamespace(prompt_token_ids=[1, 2, 3], outputs=[types.SimpleNamespace(token_ids=[5, 6])])
                for _ in convs]

    def get_metrics(self):
        if not self.generated:
            return []
        metric = lambda name, **kw: types.SimpleNamespace(name=name, **kw)  # noqa: E731
        return [metric("vllm:spec_decode_num_drafts", value=4), metric("vllm:spec_decode_num_draft_tokens", value=16),
                metric("vllm:spec_decode_num_accepted_tokens", value=3),
                metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=[2, 1, 0, 0])]


@pytest.fixture
def fake_vllm(monkeypatch):
    FakeLLM.created = []
    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = FakeLLM, lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setattr("draftsmith.eval.acceptance.configure_vllm_env", lambda engine=None: None)
    return FakeLLM


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"}]}) + "\n"
                            for i in range(2)))
    return path


@pytest.mark.parametrize("fmt, name, want", [
    ("peagle", "peagle", {"method": "eagle3", "num_speculative_tokens": 4, "parallel_drafting": True}),
    ("dflash_speculators", "dflash", {"method": "dflash", "num_speculative_tokens": 4}),
])
def test_worker_starts_vllm_with_the_registrys_speculative_config(tmp_path, fake_vllm, prompts, fmt, name, want):
    draft = export_dir(tmp_path, fmt)
    result = tmp_path / "result.json"
    args = build_parser().parse_args(["--worker", "--result", str(result), "--target", "tiny-target", "--draft",
                                      str(draft), "--prompts", str(prompts), "--k", "4", "--engine-json", "{}"])
    acceptance.worker(args)
    (kwargs,) = fake_vllm.created
    assert kwargs["speculative_config"] == {**want, "model": str(draft)}
    assert kwargs["model"] == "tiny-target" and kwargs["disable_log_stats"] is False
    r = json.loads(result.read_text())
    assert r["method"] == name and r["num_speculative_tokens"] == 4 and r["num_prompts"] == 2
    assert r["mean_acceptance_length"] == pytest.approx(1 + 3 / 4)
    assert r["per_position_acceptance"] == [0.5, 0.25, 0.0, 0.0]
    # what the speculation profile records of the measurement
    assert r["max_new_tokens"] == 256 and r["seed"] == 0 and r["measured_at"].endswith("+00:00")
    assert r["prompt_tokens"] == {"total": 6, "min": 3, "max": 3, "mean": 3.0}  # 2 prompts of 3 tokens
    assert re.fullmatch(r"[0-9a-f]{64}", r["prompts_sha256"])


def test_worker_drafts_probabilistically_when_asked(tmp_path, fake_vllm, prompts):
    """--draft-sampling probabilistic reaches vLLM's speculative_config as draft_sample_method and the
    result records it; the default writes no such key (vLLM's own default, greedy)."""
    draft = export_dir(tmp_path, "peagle")
    for flag, want in ([], None), (["--draft-sampling", "probabilistic"], "probabilistic"):
        result = tmp_path / "result.json"
        args = build_parser().parse_args(["--worker", "--result", str(result), "--target", "t", "--draft", str(draft),
                                          "--prompts", str(prompts), "--engine-json", "{}", *flag])
        acceptance.worker(args)
        assert fake_vllm.created[-1]["speculative_config"].get("draft_sample_method") == want
        assert json.loads(result.read_text())["draft_sampling"] == (want or "greedy")
    with pytest.raises(ValueError, match="draft_sampling 'sample'"):
        spec_config.for_export(get_method("eagle3"), "d", 3, "sample")
    with pytest.raises(ValueError, match="vLLM's medusa proposer drafts greedily only"):
        spec_config.for_export(get_method("medusa"), "d", 3, "probabilistic")


def test_serve_bench_serves_the_draft_with_its_draft_sampling_and_ngram_without(tmp_path):
    from draftsmith.eval.serving.run import configurations

    draft = export_dir(tmp_path, "peagle")
    configs = {c.name: c.spec for c in configurations(draft, 3, ngram=True, draft_sampling="probabilistic")}
    assert configs["peagle"]["draft_sample_method"] == "probabilistic"
    assert "draft_sample_method" not in configs["ngram"] and configs["baseline"] is None
    assert "draft_sample_method" not in {c.name: c.spec for c in configurations(draft, 3)}["peagle"]


class FakeWorkerProcess:
    """Stands in for the worker subprocess ``measure`` starts: records its command line and writes
    the result file that worker would."""

    commands: list[list[str]] = []

    def __init__(self, cmd, **kwargs):
        FakeWorkerProcess.commands.append(cmd)
        self.args, self.returncode = cmd, 0
        method = cmd[cmd.index("--method") + 1]
        counters = {"drafts": 4, "draft_tokens": 12, "accepted_tokens": 3, "per_pos": [2, 1, 0]}
        Path(cmd[cmd.index("--result") + 1]).write_text(json.dumps(
            {"method": method, "num_speculative_tokens": 3, "temperature": 0.0, "prompts": "builtin:eval",
             "num_prompts": 1, "output_tokens": 2, "generate_seconds": 1.0, "output_tokens_per_s": 2.0,
             "counters": counters, **acceptance.summarise(counters, 3), "outputs": [[5, 6]]}))

    def poll(self):
        return self.returncode

    def wait(self):
        return self.returncode


def test_measure_runs_the_methods_target_check_then_the_worker_with_its_registry_name(tmp_path, monkeypatch):
    draft, target = export_dir(tmp_path, "peagle"), tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")  # main checks the target exists before any engine starts
    checked = []
    spec = get_method("peagle")
    assert spec.target_check is not None  # the eval layer's parts are attached
    monkeypatch.setitem(spec.parts, "target_check", lambda export, tgt: checked.append((export, tgt)))
    FakeWorkerProcess.commands = []
    monkeypatch.setattr(subprocess, "Popen", FakeWorkerProcess)
    out = tmp_path / "acceptance.json"
    assert acceptance_cli.main(["--target", str(target), "--draft", str(draft), "--compare-ngram", "--out", str(out)]) == 0
    assert checked == [(draft, target)]
    assert [c[c.index("--method") + 1] for c in FakeWorkerProcess.commands] == ["peagle", "ngram"]
    assert list(json.loads(out.read_text())) == ["peagle", "ngram"]
    # the draft's measurement (not ngram's) goes into the export and beside --out
    prof = read_profile(draft / "speculation_profile.json")
    assert prof.method == "peagle" and prof.num_speculative_tokens == 3 and prof.max_supported_k == 4
    assert prof.counts.accepted_per_position == [2, 1, 0] and prof.mean_accept_length == pytest.approx(1.75)
    assert prof.measurement_conditions["temperature"] == 0.0
    assert read_profile(tmp_path / "acceptance.speculation_profile.json") == prof


def test_ngram_writes_its_profile_beside_out_not_into_the_draft(tmp_path, monkeypatch):
    draft, target = export_dir(tmp_path, "eagle3"), tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    monkeypatch.setattr(subprocess, "Popen", FakeWorkerProcess)
    out = tmp_path / "ngram.json"
    assert acceptance_cli.main(["--target", str(target), "--draft", str(draft), "--method", "ngram",
                                "--out", str(out)]) == 0
    assert not (draft / "speculation_profile.json").exists()
    assert read_profile(tmp_path / "ngram.speculation_profile.json").method == "ngram"


def test_measure_refuses_a_draft_its_target_check_rejects_before_starting_vllm(tmp_path, monkeypatch):
    draft = export_dir(tmp_path, "dflash_native")

    def reject(export, target):
        raise DraftMismatchError(f"{export} does not match target {target}: draft hidden_size 64 != target 576")

    spec = get_method("dflash")
    assert spec.target_check is not None  # the eval layer's parts are attached
    monkeypatch.setitem(spec.parts, "target_check", reject)
    FakeWorkerProcess.commands = []
    monkeypatch.setattr(subprocess, "Popen", FakeWorkerProcess)
    with pytest.raises(DraftMismatchError, match="hidden_size 64 != target 576"):
        acceptance.measure(tmp_path / "target", "builtin:eval", draft=draft)
    assert FakeWorkerProcess.commands == []
