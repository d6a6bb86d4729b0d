"""XPress's Jacobi passes, counted: a refiner built so that every pass settles exactly one more
slot (a strong chain ``slot k = slot k-1 + 1``), so the block after K passes differs from the block
after K-1 for every K up to Bk-1. :meth:`XPressRefiner.jacobi` is compared with a pass loop written
out here, and the proposer with the head's own ``jacobi`` at the config's ``num_jacobi_passes``
(and, at Bk-1 passes, with the chain itself): one pass fewer, in either place, fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.models.dflash.model import DFlashKVCache
from draftsmith.models.xpress.config import XPressConfig
from draftsmith.models.xpress.model import XPressDraftModel, XPressRefiner
from draftsmith.models.xpress.proposer import XPressProposer

V = 40
STRENGTH = 1e4  # the chain's logit margin is STRENGTH * (1 - cos(2 pi / V)) ~ 120, far above the drafter's logits


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_config(**kw) -> XPressConfig:
    base = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, vocab_size=V, draft_vocab_size=V, aux_layer_ids=[1, 3], block_size=4, mask_token_id=7,
                target_hidden_size=24, num_target_layers=6, rope_theta=500.0, xpress_rank=6, xpress_mlp_ratio=2,
                num_jacobi_passes=3, xpress_topc=0)
    base.update(kw)
    return XPressConfig(**base)


def make_chain(head: XPressRefiner) -> None:
    """Make the refiner's bias at slot k peak at ``(p_k + 1) % V``, ``p_k`` the token before slot k,
    whatever the hidden states: ``w1[t]`` is the unit vector at angle ``2 pi t / V`` (channels 0-1),
    ``in_proj`` passes ``w1``'s part through, no mixer, no MLP, and ``w2[s]`` is ``STRENGTH`` times
    ``w1[s - 1]``, so ``bias[s] = STRENGTH * cos(angle(p_k) - angle(s - 1))``."""
    r = head.rank
    angle = 2 * math.pi * torch.arange(V, dtype=torch.float32) / V
    with torch.no_grad():
        for p in head.parameters():
            p.zero_()
        head.w1.weight[:, 0], head.w1.weight[:, 1] = angle.cos(), angle.sin()
        head.in_proj.weight[:, 2 * r:] = torch.eye(r)
        head.w2.weight[:, 0] = STRENGTH * angle.roll(1).cos()
        head.w2.weight[:, 1] = STRENGTH * angle.roll(1).sin()


def written_out_jacobi(head: XPressRefiner, base: torch.Tensor, hcache: torch.Tensor, anchor: int, before: int,
                       passes: int) -> list[int]:
    """One block's Jacobi passes written out: start from the drafter's argmax per slot; each pass
    re-scores every slot k >= 1 with ``base[k] + bias(previous pass's tokens)[k]``."""
    Bk = base.shape[1]
    block = [anchor] + [int(base[0, k].argmax()) for k in range(1, Bk)]
    for _ in range(passes):
        prev = torch.tensor([[before] + block[:-1]])
        bias = head.bias(prev, hcache)[0]
        block = [anchor] + [int((base[0, k] + bias[k]).argmax()) for k in range(1, Bk)]
    return block[1:]


@pytest.mark.parametrize("topc", [0, V], ids=["whole_vocab", "topc_all"])
def test_every_pass_settles_one_more_slot_and_jacobi_runs_exactly_the_passes_asked(topc):
    Bk, anchor, before, start = 6, 20, 13, 3
    torch.manual_seed(0)
    head = XPressRefiner(V, 32, Bk, 6, 12).eval()
    make_chain(head)
    hcache = head.hidden_cache(torch.randn(1, Bk, 32))
    base = 0.1 * torch.randn(1, Bk, V)
    base[..., start] += 5.0  # the drafter's argmax is token 3 at every slot
    chain = [anchor + k for k in range(1, Bk)]
    blocks = []
    for passes in range(Bk + 2):
        got = head.jacobi(base, hcache, torch.tensor([anchor]), torch.tensor([before]), passes, topc)[0].tolist()
        # after K passes slots 1..K hold the chain, the later ones follow the previous pass's token
        want = chain[:passes] + [start + passes] * max(0, Bk - 1 - passes)
        assert written_out_jacobi(head, base, hcache, anchor, before, passes) == want, passes
        assert got == want, f"jacobi(..., passes={passes}) = {got}, want the block after {passes} passes {want}"
        blocks.append(got)
    for passes in range(1, Bk):  # every pass up to Bk-1 changes the block: a missing pass shows
        assert blocks[passes] != blocks[passes - 1], passes
    assert blocks[Bk - 1] == blocks[Bk] == blocks[Bk + 1] == chain  # settled: sequential greedy decoding


def chain_model(cfg: XPressConfig) -> XPressDraftModel:
    torch.manual_seed(0)
    model = XPressDraftModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.5 * torch.randn_like(p))
        model.init_from_target(torch.randn(cfg.vocab_size, cfg.hidden_size))
        model.set_vocab_mapping(torch.zeros(cfg.vocab_size, dtype=torch.long),
                                torch.ones(cfg.vocab_size, dtype=torch.bool))
    make_chain(model.xpress_head)
    return model.eval()


@pytest.mark.parametrize("passes", [1, 2, 3])
def test_the_proposer_runs_the_configs_jacobi_passes(passes):
    cfg = tiny_config(block_size=4, num_jacobi_passes=passes)
    Bk, bonus = cfg.block_size, 12
    model = chain_model(cfg)
    head = model.xpress_head
    states = torch.randn(6, 2 * cfg.target_hidden_size, generator=torch.Generator().manual_seed(1))
    proposal = XPressProposer(model).propose(states, torch.tensor([bonus]), Bk - 1, 0.0, None)

    # the head's own Jacobi over the same block forward, at K and K-1 passes (the proposer passes the
    # bonus token as its own predecessor, as vLLM 0.33 does)
    cache = DFlashKVCache()
    model.append_context(cache, states, torch.arange(6))
    with torch.no_grad():
        normed = model.norm(model.run_block(cache, bonus, 6, Bk))[None]
        base, hcache = model.lm_head(normed), head.hidden_cache(normed)
    anchor = torch.tensor([bonus])
    want = head.jacobi(base, hcache, anchor, anchor, passes)[0]
    fewer = head.jacobi(base, hcache, anchor, anchor, passes - 1)[0]
    assert not torch.equal(want, fewer)  # the inputs tell K passes from K-1
    assert want.tolist()[:passes] == [bonus + k for k in range(1, passes + 1)]  # K passes settle K slots
    assert proposal.token_ids.tolist() == want.tolist(), (
        f"num_jacobi_passes={passes}: proposed {proposal.token_ids.tolist()}, the head's jacobi gives "
        f"{want.tolist()} ({fewer.tolist()} after one pass fewer)")
    if passes == Bk - 1:
        assert proposal.token_ids.tolist() == [bonus + 1, bonus + 2, bonus + 3]
