"""fp8 hidden-state shards decoded on a CUDA GPU equal the CPU decode bit for bit."""

from __future__ import annotations

import pytest
import torch

from draftsmith.data_prep.shards import ShardReader
from draftsmith.data_prep.state_codec import decode_states
from draftsmith.target import load_target

from helpers.tiny import write_fp8_shards


@pytest.fixture(scope="module")
def tiny(tiny_target):
    return load_target(tiny_target)


@pytest.fixture(scope="module")
def fp8_shards(tiny, tmp_path_factory):
    return write_fp8_shards(tiny[0], tmp_path_factory.mktemp("fp8_device"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decoding_on_the_gpu_equals_the_cpu_decode_bit_for_bit(fp8_shards):
    from draftsmith.train.data import collate

    d, n, _ = fp8_shards
    batch = collate([ShardReader(d, decode_dtype=None)[i] for i in range(n)])
    today = collate([ShardReader(d)[i] for i in range(n)])
    on_gpu = decode_states({k: v.pin_memory().to("cuda", non_blocking=True) for k, v in batch.items()})
    for key in ("aux_hidden_states", "final_hidden_states"):
        assert on_gpu[key].is_cuda and torch.equal(on_gpu[key].cpu(), today[key]), key
    bf = decode_states({k: v.to("cuda") for k, v in batch.items()}, torch.bfloat16)
    assert torch.equal(bf["aux_hidden_states"].cpu(), today["aux_hidden_states"].to(torch.bfloat16))
