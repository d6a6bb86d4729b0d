"""``benchmarks.gpu --profile``: the kernel-class table (gemm, attention, copy/cast, elementwise,
softmax/loss, reductions, optimizer) of the timed step, here from the CPU's aten ops (on a GPU from
the CUDA kernels, which only a GPU run shows)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.gpu import kernel_class, main


@pytest.mark.parametrize("name,cls", [
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", "gemm"), ("sm90_xmma_gemm_bf16bf16_bf16f32", "gemm"),
    ("aten::mm", "gemm"), ("flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "attention"),
    ("triton_tem_fused_flex_attention_backward", "attention"), ("cudnn_generated_fort_native_sdpa_sm90", "attention"),
    ("cunn_SoftMaxForward", "softmax/loss"), ("_distill_rows_kernel", "softmax/loss"),
    ("draftsmith::distill_rows", "softmax/loss"),
    ("void at::native::reduce_kernel<512, 1>", "reductions"), ("multi_tensor_apply_kernel", "optimizer"),
    ("void at::native::elementwise_kernel<128, 2> (direct_copy_kernel_cuda)", "copy/cast"),
    ("aten::index_select", "copy/cast"), ("void at::native::vectorized_elementwise_kernel<4, MulFunctor>", "elementwise"),
])
def test_kernel_names_fall_in_the_profiles_classes(name, cls):
    assert kernel_class(name) == cls


def test_profile_table_of_a_tiny_cpu_step(tmp_path, capsys):
    torch.set_num_threads(1)
    out = tmp_path / "bench.json"
    assert main(["--tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", "--no-capture", "--no-fake",
                 "--no-flop-count", "--recipes", "smollm2_135m", "--set", "train.optimizer=adamw", "--profile",
                 "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    prof = row["profile"]
    assert prof["what"].startswith("CPU aten op time")
    classes = prof["classes"]
    assert {"gemm", "attention", "elementwise", "optimizer"} <= set(classes)
    assert sum(c["share"] for c in classes.values()) == pytest.approx(1.0)
    assert prof["device_ms_per_step"] == pytest.approx(sum(c["ms"] for c in classes.values()))
    assert prof["kernels_per_step"] > 100 and prof["host_ms_per_step"] >= 0.9 * prof["device_ms_per_step"]
    assert "profile of smollm2_135m (sdpa)" in capsys.readouterr().out
    # the profiled steps come after the timed ones: the fast-path record is the timed steps' (a CPU: none)
    assert (row["fused_loss_ran"], row["fused_loss_launches_per_step"], row["compiled_regions"]) == (False, 0, 0)
