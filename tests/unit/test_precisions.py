"""One training step of every draft method under every precision a launcher trains it in.

The launchers train in three precisions (``benchmarks.memory.Precision``): fp32 (no launcher, or
one without mixed precision), bf16 autocast with fp32 weights (accelerate ``mixed_precision:
bf16``: one process, DDP, FSDP) and bf16 weights (DeepSpeed ``bf16``, the gpt-oss recipes: the
module's parameters cast to bf16). Each case builds the SmolLM2 recipe's method on a tiny Llama
target with random head weights and runs the trainer's step on a random batch, as ``make
bench-gpu`` (:func:`benchmarks.gpu.bench_training`) and ``draftsmith bench memory`` do:
``prepare_model`` (the launcher's precision), ``compute_loss``, ``backward``, gradient clipping,
the non-finite guard and the step of ``train.optimizer`` (AdamW; AdamW then Muon for the
EAGLE-3 recipe, except under DeepSpeed, which the trainer refuses Muon). Each case checks that
the loss and the gradients are finite and that every trainable tensor with a gradient moved.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.memory import Precision, _device_batch, bench_recipe, offline_method, prepare_model, random_batch, \
    random_weights
from draftsmith.recipe import load_recipe
from draftsmith.train.components.nonfinite import NonFiniteGuard

RECIPES = Path(__file__).resolve().parents[2] / "recipes"

# a tiny Llama target: every method builds its draft from it in a fraction of a second
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
# lr 1e-2: AdamW's first step moves each weight by about lr, more than half a bf16 ulp at 1.0
# (2^-8), so a bf16 weight that is stepped visibly changes
TINY_SETS = ["data.draft_vocab_size=256", "data.aux_layer_ids=[1,2,3]", "train.batch_size=2", "data.max_length=32",
             "train.lr=1e-2"]
BLOCKS = ["draft.num_anchors=8", "draft.block_size=4"]

# method -> (recipe, its settings at the tiny geometry); EAGLE-3.1 is EAGLE-3 with its three options
# (recipes/*_eagle31.yaml); DFlash2 drafts over the whole target vocab
METHODS = {
    "eagle3": ("smollm2_135m", []),
    "eagle3.1": ("smollm2_135m", ["draft.norm_before_fc=true", "draft.fc_norm=false", "draft.norm_output=true"]),
    "dflash": ("smollm2_135m_dflash", BLOCKS),
    "dflash2": ("smollm2_135m_dflash2", BLOCKS + ["data.draft_vocab_size=512", "draft.conv_group_size=16",
                                                  "draft.selector_rank=8", "draft.selector_top_k=4"]),
    "dspark": ("smollm2_135m_dspark", BLOCKS),
    "xpress": ("smollm2_135m_xpress", BLOCKS + ["data.draft_vocab_size=512", "draft.xpress_rank=8",
                                                "draft.consistency_passes=2"]),
    "peagle": ("smollm2_135m_peagle", ["draft.num_layers=1", "draft.num_depths=3"]),
    "medusa": ("smollm2_135m_medusa", ["draft.num_heads=2"]),
    "mlp_speculator": ("smollm2_135m_mlp_speculator", ["draft.n_predict=2", "draft.inner_dim=64"]),
}
PRECISIONS = ["fp32", "amp-bf16", "bf16"]  # fp32 weights; bf16 autocast (accelerate); bf16 weights (DeepSpeed)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the tiny steps are dispatch-bound, and extra threads only contend."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# methods that cannot train on the tiny Llama target, and where their steps are tested instead
NOT_ON_A_LLAMA = {"mtp": "fine-tunes the MTP layer a target ships (DeepSeek-V3, Qwen3-Next): "
                         "tests/integration/test_mtp_training.py trains it in fp32 on such a tiny target"}


def test_every_registered_method_is_covered():
    from draftsmith.methods import registered_methods

    assert set(registered_methods()) - set(NOT_ON_A_LLAMA) <= {name.split(".")[0] for name in METHODS}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", list(METHODS))
def test_one_training_step(name, precision):
    recipe_name, sets = METHODS[name]
    if precision == "bf16":
        sets = sets + ["train.optimizer=adamw"]  # DeepSpeed steps one optimizer: the trainer refuses Muon
    recipe = bench_recipe(load_recipe(RECIPES / f"{recipe_name}.yaml", TINY_SETS + sets), 2, 32)
    prec = Precision.of(None, precision)
    dev = torch.device("cpu")
    torch.manual_seed(0)
    with offline_method(recipe, TINY, torch.float32, random_weights) as method:
        H, V = int(method.target_info.hidden_size), int(method.target_info.vocab_size)
        model, trainable, optimizers = prepare_model(method, recipe, prec, dev)
        assert all(p.dtype == prec.param_dtype for p in trainable)
        plan = method.batch_plan() if hasattr(method, "batch_plan") else None
        batch = _device_batch(random_batch(recipe, H, V, len(method.target_info.aux_layer_ids), fake=False),
                              plan, dev, None, fake=False)
        guard = NonFiniteGuard(optimizers, dev, 1)
        before = [p.detach().clone() for p in trainable]

        method.begin_step(0)  # the step of train/trainer.py fit(), one process, no accumulation
        loss, _ = method.compute_loss(model, batch)
        guard.note_loss(loss)
        loss.backward()
        guard.note_grad_norm(torch.nn.utils.clip_grad_norm_(trainable, recipe.train.max_grad_norm))
        stepped = [p.grad is not None and bool(p.grad.ne(0).any()) for p in trainable]
        assert all(p.grad is None or bool(p.grad.isfinite().all()) for p in trainable), f"{name} {precision}"
        for opt in optimizers:
            opt.step()
        guard.end_step()

    assert loss.isfinite(), f"{name} {precision}: loss {loss.item()}"
    assert any(stepped), f"{name} {precision}: no trainable tensor got a gradient"
    names = {id(p): n for n, p in model.named_parameters()}
    still = [names[id(p)] for p, b, s in zip(trainable, before, stepped) if s and torch.equal(p.detach(), b)]
    assert not still, f"{name} {precision}: not changed by the step: {still}"
