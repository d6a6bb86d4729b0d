"""On-policy distillation (``draft.opd``, ``draftsmith opd``; docs/training.md, "On-policy
distillation"): the offline loss against whole-logits references and hand-computed rows, the
recipe keys, and the stage's refusals.

The command end to end on a tiny run is tests/integration/test_opd_run.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draftsmith.models.common import shift_left, ttt_prediction_mask
from draftsmith.models.eagle3.training import eagle3_batch_plan, ttt_loss
from draftsmith.recipe import RecipeError, load_recipe
from draftsmith.train.losses import AcceptSpec, LossSpec, TargetDraftHead, chunked_distill
from draftsmith.train.opd_loss import opd_distill, opd_group_distill

from helpers import REPO
from helpers.ttt_cases import FixedSteps, dflash_case, reference_acceptance, tiny_eagle3, ttt_batch

K = 3


def _kl(log_a, log_b):
    return (log_a.exp() * (log_a - log_b)).sum(-1)


def _fkl_rkl(target_logits, draft_logits, target_temperature=1.0):
    """``(KL(p || q), KL(q || p))`` per row, written out (not through train.losses)."""
    log_p = torch.log_softmax(target_logits.float() / target_temperature, -1)
    log_q = torch.log_softmax(draft_logits.float(), -1)
    return _kl(log_p, log_q), _kl(log_q, log_p)


# --------------------------------------------------------------------------------------
# EAGLE-3's TTT loss


def _tiny_eagle3(seed: int = 0):
    return tiny_eagle3(seed, draft_vocab=3)  # the argmaxes agree often: chains of mixed length


def _batch(packed: bool) -> dict[str, torch.Tensor]:
    return ttt_batch(packed, seed=3)


def _reference_opd_ttt(model, batch, head, gamma, accept: AcceptSpec, target_temperature=1.0):
    """Draft-OPD's TTT loss from every step's whole ``(B, T, Vd)`` logits: position t of step k is
    accepted with weight ``reach`` (the product of the earlier steps' hits / expected acceptance at
    t), forward KL there, reverse KL times ``opd_gamma**k`` on the rest."""
    docs = batch.get("document_ids")
    steps = model(batch["input_ids"], batch["aux_hidden_states"], K, None, None, docs)
    target = head(batch["final_hidden_states"])
    reach = torch.ones(batch["loss_mask"].shape)
    total = 0.0
    for k, logits in enumerate(steps):
        sel = ttt_prediction_mask(batch["loss_mask"], k, docs)
        p = shift_left(target, k + 1)
        fkl, rkl = _fkl_rkl(p[sel], logits[sel], target_temperature)
        r = reach[sel]
        total = total + gamma**k * (r * fkl + (1 - r) * accept.opd_gamma**k * rkl).sum() / max(int(sel.sum()), 1)
        reach = reach * torch.where(sel, reference_acceptance(p, logits, accept), torch.ones(()))
    return total


def _run_ttt(model, batch, head, accept, gamma=0.7, loss=None, chunk=5, fused=False):
    plan = eagle3_batch_plan(batch, K)
    total, metrics = ttt_loss(model, batch["input_ids"], batch["aux_hidden_states"], batch["final_hidden_states"], plan,
                              K, head, gamma, loss, chunk, None, None, batch.get("document_ids"), fused=fused,
                              accept=accept)
    grads = torch.autograd.grad(total, [p for p in model.parameters() if p.requires_grad])
    return total, grads, metrics


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("accept", [AcceptSpec("hard", 0.0, 0, 0.6), AcceptSpec("soft", 0.7, 0, 0.5)])
def test_eagle3_opd_loss_and_gradient_equal_the_whole_logits_reference(packed, accept):
    model, batch = _tiny_eagle3(2), _batch(packed)
    head = TargetDraftHead(torch.randn(3, 32))
    params = [p for p in model.parameters() if p.requires_grad]
    want = _reference_opd_ttt(model, batch, head, 0.7, accept, target_temperature=0.8)
    want_grads = torch.autograd.grad(want, params)
    got, grads, metrics = _run_ttt(model, batch, head, accept, loss=LossSpec(target_temperature=0.8))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    if not accept.soft:  # some chains broke, some did not: both terms are exercised
        assert 0 < float(metrics[f"reach_{K - 1}"]) < 1


def test_each_row_gets_forward_kl_where_reached_and_decayed_reverse_kl_where_not():
    """Hand-built chains (B = 1, T = 10, V = 7): step 0 misses at t = 1, step 1 at t = 2. Each row's
    gradient is compared with the gradient of the one term it must have: a split that sends a
    reached row to reverse KL (or an unreached one to forward KL), or a wrong decay, fails here."""
    T, V, gamma, opd_gamma = 10, 7, 0.9, 0.5
    gen = torch.Generator().manual_seed(0)
    final = 6.0 * F.one_hot(torch.tensor([p % V for p in range(T)]), V).float()[None]  # row p: x_{p+1}
    misses = {0: {1}, 1: {2}, 2: set()}
    hidden = []
    for k in range(K):
        want = [(t + k + 1) % V for t in range(T)]
        tokens = [(w + 1) % V if t in misses[k] else w for t, w in enumerate(want)]
        hidden.append((6.0 * F.one_hot(torch.tensor(tokens), V).float() + 0.5 * torch.randn(T, V, generator=gen))[None])
    model = FixedSteps(hidden)
    batch = {"input_ids": torch.zeros(1, T, dtype=torch.long), "loss_mask": torch.ones(1, T),
             "aux_hidden_states": torch.zeros(1, T, 3), "final_hidden_states": final}
    plan = eagle3_batch_plan(batch, K)
    total, _ = ttt_loss(model, batch["input_ids"], batch["aux_hidden_states"], final, plan, K, lambda rows: rows, gamma,
                        None, 4, None, None, None, fused=False, accept=AcceptSpec("hard", 0.0, 0, opd_gamma))
    total.backward()
    broken = {0: set(), 1: {1}, 2: {1, 2}}  # the rows whose chain an earlier step cut
    for k in range(K):
        M = T - k - 2  # rows t = 0 .. T-k-3
        for t in range(T):
            x = hidden[k][0, t].clone().requires_grad_(True)
            if t >= M:
                assert not model.hidden[k].grad[0, t].any(), (k, t)
                continue
            fkl, rkl = _fkl_rkl(final[0, t + k + 1][None], x[None])
            one = gamma**k / M * (opd_gamma**k * rkl if t in broken[k] else fkl)
            (want,) = torch.autograd.grad(one.sum(), x)
            torch.testing.assert_close(model.hidden[k].grad[0, t], want, rtol=1e-5, atol=1e-7, msg=f"step {k} row {t}")


class _Matmuls(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matmuls dispatched under it (mm / addmm / bmm: a linear's forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
        return func(*args, **(kwargs or {}))


def test_the_ttt_loss_with_opd_runs_one_distill_call_per_step():
    """draft.opd's reverse KL comes from the same call and logits as D: EAGLE-3's TTT loss dispatches
    the matmuls of accept_weighting at the same mode, forward and backward (a second call would add a
    logits matmul per chunk at each step k >= 1, and more in backward)."""
    counts = {}
    for name, accept in (("accept", AcceptSpec("hard")), ("opd", AcceptSpec("hard", 0.0, 0, 0.6))):
        model, batch = _tiny_eagle3(2), _batch(False)
        head = TargetDraftHead(torch.randn(3, 32))
        with _Matmuls() as mode:
            _run_ttt(model, batch, head, accept)
        counts[name] = mode.n
    assert counts["opd"] == counts["accept"] > 0


def test_bench_step_counts_the_fused_opd_step_at_accept_weighting_s_matmuls(tmp_path):
    """``draftsmith bench step``'s count (fake CUDA, the fused loss) of a tiny EAGLE-3 step: with
    draft.opd one ``distill_rows`` kernel per TTT step and chunk and the matmul FLOPs of
    accept_weighting; a handful more elementwise ops (the second weight, its term in the sum)."""
    import json

    from benchmarks.memory import Precision
    from benchmarks.step import build_parser, count_step, load

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                                  "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512,
                                  "rms_norm_eps": 1e-5, "rope_theta": 10000.0}))

    def count(split: str) -> tuple[int, int, int, int]:
        args = build_parser().parse_args([str(REPO / "recipes/smollm2_135m.yaml"), "--target-config", str(config),
                                          "--batch-size", "2", "--max-length", "32", "--set",
                                          "data.draft_vocab_size=256", "--set", "data.aux_layer_ids=[1,2,3]",
                                          "--set", split])
        recipe, config_json, _, launch = load(args.recipe, list(args.overrides), args)
        c = count_step(recipe, config_json, Precision.of(launch, args.precision))
        assert c.extra["loss_path"] == "fused"
        kernels = sum(s.count for s in c.stats if "distill_rows" in s.name)
        return kernels, sum(s.flops * s.count for s in c.stats), sum(s.count for s in c.stats), recipe.draft.ttt_steps

    accept, opd = count("draft.accept_weighting=hard"), count("draft.opd=hard")
    assert opd[0] == accept[0] == opd[3]  # one kernel per step (one chunk each)
    assert opd[1] == accept[1] > 0
    assert accept[2] < opd[2] <= accept[2] + 4 * (opd[3] - 1)


@pytest.mark.parametrize("accept", [AcceptSpec("hard", 0.0, 0, 0.8), AcceptSpec("soft", 0.6, 0, 0.8)])
def test_one_call_gives_both_terms_and_both_row_losses(accept):
    torch.manual_seed(0)
    x, w, t = torch.randn(6, 5, requires_grad=True), torch.randn(9, 5), torch.randn(4, 9)
    idx = torch.tensor([0, 1, 2, 3, 0, 1])
    reach = torch.tensor([1.0, 0.0, 0.25, 1.0, 0.0, 0.5])
    out = opd_distill(x, lambda h: F.linear(h, w), t, idx, torch.tensor(0.5), reach, 0.7,
                      LossSpec(target_temperature=2.0), chunk_size=4, accept=accept, fused=False)
    fkl, rkl = _fkl_rkl(t[idx], F.linear(x, w), 2.0)
    want = (0.5 * reach * fkl + 0.5 * (1 - reach) * 0.7 * rkl).sum()
    torch.testing.assert_close(out.loss_sum, want)
    torch.testing.assert_close(out.row_loss, fkl.detach())
    torch.testing.assert_close(out.row_rejected, rkl.detach())
    assert (out.row_alpha is not None) == accept.soft
    (got_grad,) = torch.autograd.grad(out.loss_sum, x)
    (want_grad,) = torch.autograd.grad(want, x)
    torch.testing.assert_close(got_grad, want_grad)


def test_the_rejected_weight_is_draft_opd_s_only():
    x, t, idx = torch.randn(4, 3), torch.randn(2, 3), torch.zeros(4, dtype=torch.long)
    for accept in (None, AcceptSpec("hard"), AcceptSpec("hard", 0.0, 2, 0.8)):  # not opd; opd over groups
        with pytest.raises(ValueError, match="rejected_weight is draft.opd's rejected term without groups"):
            chunked_distill(x, lambda h: h, t, idx, torch.ones(4), fused=False, accept=accept,
                            rejected_weight=torch.ones(4))
    with pytest.raises(ValueError, match=r"rejected_weight \(4,\) expected"):
        chunked_distill(x, lambda h: h, t, idx, torch.ones(4), fused=False, accept=AcceptSpec("hard", 0.0, 0, 0.8),
                        rejected_weight=torch.ones(3))
    with pytest.raises(ValueError, match="opd_distill needs draft.opd's AcceptSpec without a group"):
        opd_distill(x, lambda h: h, t, idx, torch.ones(4), torch.ones(4), 0.8, accept=AcceptSpec("soft", 0.6))


# --------------------------------------------------------------------------------------
# DFlash's block slots


@pytest.mark.parametrize("accept", [AcceptSpec("hard", 0.0, 4, 0.7), AcceptSpec("soft", 0.8, 4, 0.7)])
def test_dflash_opd_loss_and_gradient_equal_the_whole_block_reference(accept):
    from draftsmith.models.dflash.training import block_labels, dflash_loss, sample_anchors, slot_weights

    cfg, model, ids, aux, final, mask, head = dflash_case()
    B = ids.shape[0]
    Bk = cfg.block_size
    anchors, valid = sample_anchors(mask, 6, torch.Generator().manual_seed(2))
    w = slot_weights(Bk, 4.0)
    label_pos, label_mask = block_labels(anchors, valid, mask, Bk)
    logits = model(ids, aux, anchors, valid)[:, :, 1:]
    b = torch.arange(B)[:, None, None]
    teacher = head(final)[b, (label_pos[:, :, 1:] - 1).clamp_min(0)]
    fkl, rkl = _fkl_rkl(teacher, logits)
    trained = label_mask[:, :, 1:]
    a = torch.where(trained, reference_acceptance(teacher, logits, accept), torch.ones(()))
    reach = torch.cat([torch.ones_like(a[..., :1]), a[..., :-1].cumprod(-1)], -1)
    slot_w = w[1:] * trained
    decay = accept.opd_gamma ** torch.arange(Bk - 1, dtype=torch.float32)
    want = (slot_w * (reach * fkl + (1 - reach) * decay * rkl)).sum() / slot_w.sum()
    params = [p for p in model.parameters() if p.requires_grad]
    want_grads = torch.autograd.grad(want, params)
    got, metrics = dflash_loss(model, ids, aux, final, mask, anchors, valid, head, w, None, chunk_size=6, accept=accept)
    grads = torch.autograd.grad(got, params)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, ref in zip(grads, want_grads):
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-6)
    if not accept.soft:
        assert 0 < float(metrics[f"reach_{Bk - 2}"]) < 1


def test_opd_group_distill_refuses_a_spec_without_a_group():
    with pytest.raises(ValueError, match="needs draft.opd's AcceptSpec with a group"):
        opd_group_distill(torch.zeros(2, 3), lambda h: h, torch.zeros(2, 3), torch.zeros(2, dtype=torch.long),
                          torch.ones(2), accept=AcceptSpec("hard", 0.0, 0, 0.8))


# --------------------------------------------------------------------------------------
# The recipe keys


def test_the_recipe_keys():
    recipe = load_recipe(None, ["draft.opd=soft", "draft.opd_gamma=0.5", "train.eval_temperatures=[0.7,0.0]"])
    assert AcceptSpec.from_recipe(recipe) == AcceptSpec("soft", 0.7, 0, 0.5)
    assert AcceptSpec.from_recipe(recipe).opd and not AcceptSpec("hard").opd
    assert AcceptSpec.from_recipe(load_recipe(None, ["draft.method=dflash", "draft.opd=hard"]), group=15) \
        == AcceptSpec("hard", 0.0, 15, 0.8)
    for method in ("dspark", "xpress", "peagle"):  # their losses split the block slots / depths too
        assert load_recipe(None, [f"draft.method={method}", "draft.opd=hard"]).draft.opd == "hard"
    with pytest.raises(RecipeError, match="set draft.accept_weighting=none"):
        load_recipe(None, ["draft.opd=hard", "draft.accept_weighting=soft"])
    with pytest.raises(RecipeError, match=r"draft.opd: on-policy distillation is not supported by draft.method medusa \(supported: eagle3, dflash, dflash2, dspark, xpress, peagle\)"):
        load_recipe(None, ["draft.method=medusa", "draft.opd=hard"])


# --------------------------------------------------------------------------------------
# The stage's pieces (the command end to end: tests/integration/test_opd_run.py)


def test_replay_rows_survive_a_partial_line_and_a_full_disk(tmp_path):
    import errno
    import json

    from draftsmith.eval.opd_replay import ReplayError, append_row, read_rows

    path = tmp_path / "rows.jsonl"
    with open(path, "ab") as f:
        append_row(f, {"id": "a@1", "x": 1})
        append_row(f, {"id": "b@2", "x": 2})
        f.write(b'{"id": "c@3", "x"')  # killed mid-line
    assert list(read_rows(path)) == ["a@1", "b@2"]
    assert path.read_bytes().endswith(b"}\n")  # the partial line is cut off: the next append starts clean
    with open(path, "ab") as f:
        append_row(f, {"id": "c@3", "x": 3})
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["a@1", "b@2", "c@3"]

    class Full:
        name = str(path)

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(ReplayError, match=r"disk full while writing replay row d@4: the rows written so far are "
                                          r"kept; free space and re-run the command to continue"):
        append_row(Full(), {"id": "d@4"})
    path.write_text('{"id": "a@1"}\nnot json\n')
    with pytest.raises(ReplayError, match="rows.jsonl:2: not a replay row; --overwrite"):
        read_rows(path)


def test_replay_prefixes_and_masks():
    from draftsmith.eval.opd_replay import pick_prefixes, replay_mask

    ids = ["a", "b", "c"]
    masks = [[0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 1, 1, 1]]
    picks = pick_prefixes(ids, masks, conversations=3, prefixes=2, max_prefix=4, seed=1)
    assert picks == pick_prefixes(ids, masks, 3, 2, 4, seed=1)  # a re-run picks the same prefixes
    assert len(picks) == 4 and all(rid == f"{ids[i]}@{p}" for rid, i, p in picks)
    assert all(masks[i][p] and 1 <= p <= 4 for _, i, p in picks)  # cut before a trained token, room left
    assert replay_mask(3, 6, [1, 4, 9], span=2) == [0, 0, 0, 0, 1, 1, 0, 1, 1]  # index 9 is past the output
    assert replay_mask(2, 3, [], span=4) == [0] * 5


def test_replay_prompts_are_sampled_whole_and_only_where_they_fit():
    from draftsmith.eval.opd_replay import pick_prompts

    rendered = [[1, 2, 3], [4] * 9, [5, 6], [], [7] * 4]
    picks = pick_prompts(rendered, conversations=10, max_prefix=4, seed=3)
    assert picks == [("prompt0@3", [1, 2, 3]), ("prompt2@2", [5, 6]), ("prompt4@4", [7] * 4)]  # [4]*9, [] do not fit
    two = pick_prompts(rendered, conversations=2, max_prefix=4, seed=3)
    assert two == pick_prompts(rendered, 2, 4, seed=3) and len(two) == 2 and all(p in picks for p in two)


def test_sft_rows_are_a_seeded_sample_of_trained_conversations():
    from draftsmith.eval.opd_replay import pick_sft_rows

    masks = [[0, 1], [0, 0], [1, 1], [0, 1, 1], [0, 0, 1]]
    assert pick_sft_rows(masks, 10, seed=0) == [0, 2, 3, 4]  # all that train something, file order; not [0, 0]
    two = pick_sft_rows(masks, 2, seed=5)
    assert two == pick_sft_rows(masks, 2, seed=5) and len(two) == 2 and two == sorted(two) and 1 not in two
    assert pick_sft_rows(masks, 0, seed=0) == []


def test_the_opd_recipe_and_the_trained_checkpoint(tmp_path):
    from draftsmith.eval.opd import OpdError, OpdOptions, opd_recipe, trained_checkpoint
    from draftsmith.recipe import dump_recipe

    run = tmp_path / "run"
    run.mkdir()
    dump_recipe(load_recipe(None, ["train.max_steps=50", "draft.accept_weighting=hard"]), run / "recipe.yaml")
    with pytest.raises(OpdError, match=rf"has no trained checkpoint .*`draftsmith train RECIPE --run-dir {run}`"):
        trained_checkpoint(run)
    step = run / "checkpoints" / "step-7"
    step.mkdir(parents=True)
    (step / "train_state.json").write_text("{}")
    (step / "draft_config.json").write_text("{}")
    assert trained_checkpoint(run) == step
    (run / "checkpoints" / "best").mkdir()
    (run / "checkpoints" / "best" / "draft_config.json").write_text("{}")
    assert trained_checkpoint(run).name == "best" and trained_checkpoint(run, "latest") == step
    recipe = opd_recipe(run, step, OpdOptions(run, split="hard", opd_gamma=0.5, overrides=["train.lr=1e-4"]))
    assert (recipe.draft.opd, recipe.draft.opd_gamma, recipe.draft.accept_weighting) == ("hard", 0.5, "none")
    assert recipe.draft.init_from == str(step.resolve())
    assert recipe.train.max_steps is None and recipe.train.epochs == 1.0 and recipe.train.lr == 1e-4
    assert opd_recipe(run, step, OpdOptions(run, max_steps=9)).train.max_steps == 9
    # an override that does not validate is refused before opd/ exists
    from draftsmith.eval.opd import run_opd

    with pytest.raises(RecipeError, match="train.lr"):
        run_opd(OpdOptions(run, overrides=["train.lr=-1"]))
    assert not (run / "opd").exists()


def test_the_dry_run_counts_the_fused_gradients_once_with_opd(tmp_path):
    from draftsmith.train.dry_run import dry_run

    config = tmp_path / "config.json"
    config.write_text((REPO / "recipes/targets/meta-llama/Llama-3.1-8B-Instruct/config.json").read_text())
    plain, opd = (dry_run(load_recipe(REPO / "recipes/llama3_1_8b.yaml", sets), config)["estimate"]["activations"]
                  for sets in ([], ["draft.opd=hard"]))
    assert opd["fused_loss_gradients"] == plain["fused_loss_gradients"] > 0  # one fused call per step, both terms
