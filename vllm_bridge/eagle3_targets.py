"""Which target architectures the installed vLLM serves an EAGLE-3 draft on, known without
starting vLLM.

vLLM runs an EAGLE-3 draft (``speculative_config.method: eagle3``, also P-EAGLE's) only on a
target whose model class implements ``SupportsEagle3`` (it hands the draft the aux hidden states
of ``get_eagle3_aux_hidden_state_layers``). :data:`EAGLE3_TARGET_ARCHITECTURES` lists the
``architectures`` names of vLLM 0.32's model registry (``_TEXT_GENERATION_MODELS`` and
``_MULTIMODAL_MODELS`` of ``vllm/model_executor/models/registry.py``) whose class derives from
``SupportsEagle3``, read from the source by the AST (``tests/unit/test_target_facts_families.py``
re-derives it from the installed vLLM and fails when they differ). Torch-free; imports no vLLM.
"""

from __future__ import annotations

from typing import Iterable

EAGLE3_TABLE_RELEASE = "0.32"
"""The vLLM release line :data:`EAGLE3_TARGET_ARCHITECTURES` was read from."""

EAGLE3_TARGET_ARCHITECTURES: frozenset[str] = frozenset({
    "AfmoeForCausalLM", "ApertusForCausalLM", "Cohere2MoeForCausalLM", "CohereCompassForConditionalGeneration",
    "Cosmos3ForConditionalGeneration", "DeepseekForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
    "Ernie4_5ForCausalLM", "Exaone4_5_ForConditionalGeneration", "Gemma4ForCausalLM",
    "Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration", "GlmMoeDsaForCausalLM",
    "GptOssForCausalLM", "GraniteForCausalLM", "GraniteSWAForCausalLM", "IQuestCoderForCausalLM",
    "InternLM3ForCausalLM", "InternS1ProForConditionalGeneration", "InternS2MobiusForConditionalGeneration",
    "InternS2PreviewForConditionalGeneration", "K2HorizonForCausalLM", "KimiK25ForConditionalGeneration",
    "LLaMAForCausalLM", "LagunaForCausalLM", "LightOnOCRForConditionalGeneration", "Llama4ForCausalLM",
    "Llama4ForConditionalGeneration", "LlamaForCausalLM", "LlavaForConditionalGeneration", "MiMoForCausalLM",
    "MiMoV2FlashForCausalLM", "MiMoV2ForCausalLM", "MiMoV2OmniForCausalLM", "MiniCPM3ForCausalLM",
    "MiniCPMForCausalLM", "MiniCPMV4_6ForConditionalGeneration", "MiniCPMV4_7ForConditionalGeneration",
    "MiniMaxM2ForCausalLM", "Ministral3ForCausalLM", "Mistral3ForConditionalGeneration", "MistralForCausalLM",
    "MistralLarge3ForCausalLM", "MuseGlimmerForCausalLM", "MuseGlimmerForConditionalGeneration",
    "NemotronHForCausalLM", "NemotronHPuzzleForCausalLM", "NemotronH_Nano_Omni_Reasoning_V3",
    "NemotronH_Nano_VL_V2", "NemotronH_Omni_Reasoning_V3", "NemotronH_Super_Omni_Reasoning_V3",
    "OpenCUAForConditionalGeneration", "Phi3ForCausalLM", "PixtralForConditionalGeneration",
    "Plamo3ForCausalLM", "Qwen2ForCausalLM", "Qwen2_5_VLForConditionalGeneration",
    "Qwen3ASRForConditionalGeneration", "Qwen3ASRRealtimeGeneration", "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3OmniMoeForConditionalGeneration",
    "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration", "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration",
    "SarvamMLAForCausalLM", "Step1ForCausalLM", "TeleChat2ForCausalLM", "TeleChat3ForCausalLM",
    "TeleFLMForCausalLM",
})
"""Target ``architectures`` entries whose vLLM model class implements ``SupportsEagle3``."""

FAMILY_NOTES: dict[str, str] = {
    "Glm4MoeForCausalLM": "GLM-4.5 / 4.6 / 4.7 ship MTP layers (num_nextn_predict_layers) that vLLM serves as "
                          "speculative_config method mtp",
}
"""What serves a family vLLM has no EAGLE-3 path for (named in the refusal)."""


def eagle3_target_problem(architectures: Iterable[str], name: str) -> str | None:
    """None when one of the target's ``architectures`` runs EAGLE-3 drafts in vLLM
    :data:`EAGLE3_TABLE_RELEASE` (or the config names none: a local research target); else one
    line naming ``target.name_or_path``, the architecture and what would work instead."""
    archs = [str(a) for a in architectures or ()]
    if not archs or any(a in EAGLE3_TARGET_ARCHITECTURES for a in archs):
        return None
    arch = archs[0]
    other = FAMILY_NOTES.get(arch, "pick a target whose architecture implements it (docs/targets.md)")
    return (f"target.name_or_path={name}: architecture {arch} does not implement SupportsEagle3 in vLLM "
            f"{EAGLE3_TABLE_RELEASE}, so vLLM cannot serve an EAGLE-3 draft on it; {other}")
