"""Datasheet figures of the GPUs the project sizes and times work for: the roofline of
``draftsmith bench step`` (benchmarks/step.py) and of ``draftsmith plan --roofline``
(:mod:`draftsmith.eval.serving_roofline`) read them from here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    """Datasheet figures of one GPU: dense tensor-core peaks (TFLOP/s) and HBM bandwidth (TB/s)."""

    name: str
    bf16_tflops: float
    tf32_tflops: float
    fp32_tflops: float
    hbm_tbps: float


# NVIDIA's datasheets (SXM parts, dense, no sparsity): H100 / H200 bf16 989, TF32 494.7, fp32 (CUDA
# cores) 66.9, HBM 3.35 / 4.8 TB/s; A100 80GB bf16 312, TF32 156, fp32 19.5, HBM 2.039 TB/s
A100 = Gpu("A100 SXM 80GB", 312.0, 156.0, 19.5, 2.039)
H100 = Gpu("H100 SXM", 989.0, 494.7, 66.9, 3.35)
H200 = Gpu("H200", 989.0, 494.7, 66.9, 4.8)
GPUS = {"h100": H100, "h200": H200}
"""The GPUs ``bench step`` reports for (its constants were fitted on the H200)."""
ROOFLINE_GPUS = {"a100": A100, **GPUS}
"""The GPUs ``draftsmith plan --roofline`` knows."""
