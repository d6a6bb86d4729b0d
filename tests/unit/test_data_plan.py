"""The data stage's plan (``data_prep/plan.py``): target sizes from config.json, the tensor-parallel
size and capture placement that follow from them, regeneration on every GPU of a node, shards
and disk, and the bad inputs it refuses; plus the launch helpers the orchestration builds on
(``data_prep/launch.py``, ``ranks.bind_local_device``, node-split regeneration)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from draftsmith.data_prep import regenerate as regen
from draftsmith.data_prep.launch import child_env, launch_layout
from draftsmith.data_prep.plan import Cluster, PlanError, build_plan, tensor_parallel_size
from draftsmith.cli.prepare import main as prepare_main
from draftsmith.data_prep.prepare import node_cache
from draftsmith.data_prep.ranks import bind_local_device, merge_node_caches
from draftsmith.layout import RunLayout
from draftsmith.recipe import load_recipe
from draftsmith.target import bundled_target_config, target_parameter_counts, target_weight_bytes, text_json
from draftsmith.target.families import weight_tensors

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def config_of(hub_id: str) -> dict:
    return json.loads(bundled_target_config(hub_id).read_text())


@pytest.mark.parametrize("hub_id, published", [
    # parameter counts the model cards publish
    ("openai/gpt-oss-120b", 116.8e9), ("openai/gpt-oss-20b", 20.9e9),
    ("meta-llama/Llama-3.1-8B-Instruct", 8.03e9), ("Qwen/Qwen3-8B", 8.2e9),
])
def test_parameter_count_matches_the_model_card(hub_id, published):
    n = sum(target_parameter_counts(config_of(hub_id)).values())
    assert abs(n - published) / published < 0.01, (hub_id, n)


def test_mxfp4_experts_are_counted_at_4_25_bits():
    cfg = config_of("openai/gpt-oss-120b")
    quant = target_weight_bytes(cfg, "bfloat16")
    dense = target_weight_bytes(dict(cfg, quantization_config=None), "bfloat16")
    # the experts' projections (their biases stay bf16)
    experts = sum(x.numel for x in weight_tensors(text_json(cfg)) if x.part == "experts" and len(x.shape) == 2)
    assert quant["quantization"] == "mxfp4" and dense["quantization"] is None
    assert dense["bytes"] - quant["bytes"] == pytest.approx(experts * (2 - 4.25 / 8), rel=1e-6)
    assert 55 < quant["bytes"] / 2**30 < 65  # the ~61 GiB gpt-oss-120b checkpoint


def test_tensor_parallel_size_follows_the_weights_against_device_memory():
    gptoss = target_weight_bytes(config_of("openai/gpt-oss-120b"))["bytes"]
    llama = target_weight_bytes(config_of("meta-llama/Llama-3.1-8B-Instruct"))["bytes"]
    assert tensor_parallel_size(llama, Cluster(1, 8, 80), 0.85, 32) == 1
    assert tensor_parallel_size(gptoss, Cluster(1, 8, 80), 0.85, 64) == 2
    assert tensor_parallel_size(gptoss, Cluster(1, 8, 141), 0.85, 64) == 1  # H200
    assert tensor_parallel_size(gptoss, Cluster(1, 0, None), 0.85, 64) == 1  # CPU: one engine
    with pytest.raises(PlanError, match="do not fit one node"):
        tensor_parallel_size(gptoss, Cluster(1, 1, 24), 0.85, 64)


def test_gptoss120b_plan_uses_every_gpu_and_captures_per_node():
    recipe = load_recipe(RECIPES / "gptoss120b.yaml")
    plan = build_plan(recipe, config_of("openai/gpt-oss-120b"), Cluster(2, 8, 80))
    assert not plan.fits_one_device and plan.min_tensor_parallel == 2
    assert plan.regenerate["engine"] == "vllm-server"
    assert (plan.regenerate["data_parallel_size"], plan.regenerate["tensor_parallel_size"]) == (4, 2)
    assert plan.regenerate["idle_gpus"] == 0
    assert plan.capture == {**plan.capture, "engine": "vllm", "placement": "node", "tensor_parallel_size": 8}
    assert plan.shards["dtype"] == "float8_e4m3fn" and plan.shards["shard_bytes"] == 4_000_000_000
    text = plan.format()
    for line in ("data_parallel_size 4 x tensor_parallel_size 2", "placement node", "i % 2 == n"):
        assert line in text


def test_llama_plan_captures_per_rank_and_regenerates_on_all_eight_gpus():
    recipe = load_recipe(RECIPES / "llama3_1_8b.yaml")
    plan = build_plan(recipe, config_of("meta-llama/Llama-3.1-8B-Instruct"), Cluster(1, 8, 80))
    assert plan.fits_one_device
    assert (plan.regenerate["data_parallel_size"], plan.regenerate["tensor_parallel_size"]) == (8, 1)
    assert plan.capture["placement"] == "rank" and plan.capture["tensor_parallel_size"] == 1
    # the offline engine has no data parallelism: the plan says how many GPUs it leaves idle
    offline = build_plan(load_recipe(RECIPES / "llama3_1_8b.yaml", ["data.regenerate.engine=vllm"]),
                         config_of("meta-llama/Llama-3.1-8B-Instruct"), Cluster(1, 8, 80))
    assert offline.regenerate["idle_gpus"] == 7 and "7 idle" in offline.format()


def test_disk_and_read_bandwidth_follow_the_storage_dtype():
    cfg = config_of("meta-llama/Llama-3.1-8B-Instruct")
    fp8 = build_plan(load_recipe(RECIPES / "llama3_1_8b.yaml"), cfg, Cluster(1, 8, 80))
    bf16 = build_plan(load_recipe(RECIPES / "llama3_1_8b.yaml", ["data.hidden_states_dtype=bfloat16"]), cfg,
                      Cluster(1, 8, 80), train_tokens_per_s_per_gpu=20_000)
    assert fp8.disk["need_bytes"] == 300_000_000 * fp8.shards["bytes_per_token"]
    assert 0.45 < fp8.shards["bytes_per_token"] / bf16.shards["bytes_per_token"] < 0.55
    assert bf16.read_bandwidth["bytes_per_s_per_node"] == 20_000 * 8 * bf16.shards["bytes_per_token"]


@pytest.mark.parametrize("sets, key", [
    (["data.shard_bytes=1000000"], "data.shard_bytes"),
    (["vllm.tensor_parallel_size=4", "vllm.data_parallel_size=4"], "vllm.data_parallel_size"),
    (["data.regenerate.tensor_parallel_size=1"], "data.regenerate.tensor_parallel_size"),
    (["data.capture_placement=rank"], "data.capture_placement"),
    (["data.hidden_states_engine=transformers"], "data.hidden_states_engine"),
])
def test_bad_input_is_refused_naming_the_key(sets, key):
    recipe = load_recipe(RECIPES / "gptoss120b.yaml", sets)
    with pytest.raises(PlanError, match=key.replace(".", r"\.")):
        build_plan(recipe, config_of("openai/gpt-oss-120b"), Cluster(1, 8, 80))


def test_prepare_dry_run_prints_the_plan(capsys, tmp_path):
    rc = prepare_main([str(RECIPES / "gptoss120b.yaml"), "--run-dir", str(tmp_path / "run"), "--dry-run",
                       "--nodes", "2", "--gpus-per-node", "8", "--device-memory-gib", "80"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "data_parallel_size 4 x tensor_parallel_size 2" in out and "placement node" in out
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


def test_online_mode_with_a_target_beside_the_draft_is_refused_with_the_figures():
    from draftsmith.train.dry_run import MemoryBudgetError, check_fits, dry_run

    report = dry_run(load_recipe(RECIPES / "gptoss120b.yaml", ["data.hidden_states_mode=online", "train.packing=false"]))
    with pytest.raises(MemoryBudgetError, match=r"online.*GiB of target weights.*80 GiB"):
        check_fits(report, 80)
    check_fits(dry_run(load_recipe(RECIPES / "llama3_1_8b.yaml", ["data.hidden_states_mode=online", "train.packing=false"])), 80)


def test_each_local_rank_is_bound_to_its_own_device():
    assert bind_local_device({"WORLD_SIZE": "1"}) is None
    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    assert bind_local_device(env) == "1" and env["CUDA_VISIBLE_DEVICES"] == "1"
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,6"}
    assert bind_local_device(env) == "6"


def test_launch_layout_and_child_env(monkeypatch):
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    assert launch_layout(env) == {"rank": 3, "world": 4, "local_rank": 1, "local_world": 2, "node": 1, "nodes": 2}
    for k, v in {**env, "MASTER_ADDR": "h", "MASTER_PORT": "1", "ACCELERATE_MIXED_PRECISION": "bf16"}.items():
        monkeypatch.setenv(k, v)
    child = child_env("5")
    assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "ACCELERATE_MIXED_PRECISION"} & set(child)
    assert child["CUDA_VISIBLE_DEVICES"] == "5"


def test_a_node_that_cannot_see_the_run_directory_is_refused(monkeypatch, tmp_path):
    """Rank 0 hands its session id over the launcher's store (a real TCPStore here, as torchrun's
    agent hosts one); a rank whose run directory shows another launch's file, or none, stops."""
    import datetime

    import torch.distributed as dist

    from draftsmith.data_prep.launch import SESSION, read_session

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=30))
    for k, v in {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                 "TORCHELASTIC_RUN_ID": "t"}.items():
        monkeypatch.setenv(k, v)
    node0, node1 = tmp_path / "node0", tmp_path / "node1"  # two file systems that do not share the run dir
    for d, sid in ((node0, "new"), (node1, "stale")):
        d.mkdir()
        (d / SESSION).write_text(json.dumps({"session": sid, "placement": "node"}))
    rank0 = {"rank": 0, "node": 0}
    assert read_session(node0 / SESSION, rank0, "new")["session"] == "new"
    assert read_session(node0 / SESSION, {"rank": 1, "node": 1}, None, grace_s=1)["session"] == "new"
    with pytest.raises(PlanError, match="file system every node sees") as exc:
        read_session(node1 / SESSION, {"rank": 1, "node": 1}, None, grace_s=1)
    assert str(node1 / SESSION) in str(exc.value) and "node 1" in str(exc.value)
    with pytest.raises(PlanError, match="file system every node sees"):  # no file at all
        read_session(tmp_path / "elsewhere" / SESSION, {"rank": 1, "node": 1}, None, grace_s=1)
    del server


class EchoEngine:
    """A chat engine whose reply names the conversation and the temperature it was asked at."""

    def generate(self, conversations, temperatures, max_new_tokens, reasoning_efforts=None):
        return [f"{c[-1]['content']} @ {t}" for c, t in zip(conversations, temperatures)]


def test_nodes_regenerate_disjoint_shares_that_merge_into_one_process_cache(tmp_path):
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
            for i in range(7)]
    kw = dict(temperatures=[0.0, 0.7], max_new_tokens=8, batch_size=2, progress=False)
    one = regen.regenerate(rows, tmp_path / "one.jsonl", EchoEngine, **kw)
    paths = RunLayout(tmp_path / "run").data
    paths.root.mkdir(parents=True)
    shares = [regen.regenerate(rows, node_cache(paths, n, 2), EchoEngine, share=(n, 2), **kw) for n in range(2)]
    assert [r["id"] for r in shares[0]] == ["r0", "r2", "r4", "r6"] and [r["id"] for r in shares[1]] == ["r1", "r3", "r5"]
    with node_cache(paths, 1, 2).open("a") as fh:
        fh.write('{"id": "torn')  # a killed writer's last line
    assert merge_node_caches(paths, 2) == 7
    assert not node_cache(paths, 0, 2).exists()
    merged = regen.regenerate(rows, paths.regen, lambda: pytest.fail("everything is cached"), **kw)
    assert merged == one  # same replies at the same temperatures as one process


def test_an_online_run_on_a_gpu_is_refused_before_any_rank_loads_the_target(monkeypatch, tmp_path):
    from draftsmith.data_prep import plan as plan_mod
    from draftsmith.train.dry_run import MemoryBudgetError
    from draftsmith.train.method_base import check_online_target_fits

    target = tmp_path / "gpt-oss-120b"
    target.mkdir()
    (target / "config.json").write_text(bundled_target_config("openai/gpt-oss-120b").read_text())
    paths = RunLayout(tmp_path / "run").data
    paths.root.mkdir(parents=True)
    paths.target_info.write_text(json.dumps({"path": str(target)}))
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(plan_mod, "gpu_memory_gib", lambda: 80.0)
    online = load_recipe(RECIPES / "gptoss120b.yaml", ["data.hidden_states_mode=online", "train.packing=false"])
    with pytest.raises(MemoryBudgetError, match=r"217\.6 GiB of target weights"):
        check_online_target_fits(online, tmp_path / "run")
    check_online_target_fits(load_recipe(RECIPES / "gptoss120b.yaml"), tmp_path / "run")  # offline: no check


def test_plan_names_several_replies_per_prompt():
    """``data.regenerate.samples_per_prompt`` multiplies what the data stage regenerates and captures:
    the plan says so and keeps the count."""
    recipe = load_recipe(RECIPES / "llama3_1_8b.yaml", ["data.regenerate.samples_per_prompt=3",
                                                        "data.regenerate.temperatures=[0.7]"])
    plan = build_plan(recipe, config_of("meta-llama/Llama-3.1-8B-Instruct"), Cluster(1, 8, 80))
    assert plan.regenerate["samples_per_prompt"] == 3
    assert "3 replies per prompt" in plan.format() and "3x the conversations" in plan.format()
    one = build_plan(load_recipe(RECIPES / "llama3_1_8b.yaml"), config_of("meta-llama/Llama-3.1-8B-Instruct"),
                     Cluster(1, 8, 80))
    assert "replies per prompt" not in one.format()
