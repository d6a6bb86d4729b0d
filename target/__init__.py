"""The target (verifier): everything draftsmith knows and asks about the model a draft speeds up.

- :mod:`.resolve`: a name (hub id, local directory, ``embedded:NAME``) to a checkpoint directory,
  its ``config.json`` (shipped copies under ``recipes/targets/``), the verifier name of an export;
- :mod:`.load`: the model and tokenizer on this process's device, or a few checkpoint tensors;
- :mod:`.facts`: arithmetic on its config (text config, layers, aux ids, weight bytes, geometry checks);
- :mod:`.info`: :class:`TargetInfo`, the typed ``RUN_DIR/data/target.json``;
- :mod:`.capture`: its aux and final hidden states through transformers (forward pre-hooks on the
  aux layers), and :mod:`.vllm_capture`, the same states through vLLM's engine (imports vLLM lazily;
  the one module here that asks :mod:`draftsmith.vllm_bridge` how to start it).

Below every stage (``data_prep``, ``train``, ``eval``, ``serve``) and below ``models``: it imports
none of them (only ``vllm_bridge``, which imports no stage), and each asks it, never another stage, about the target.
"""

from .facts import (
    aux_layer_ids,
    DTYPE_BYTES,
    GEOMETRY_KEYS,
    MXFP4_BYTES_PER_PARAM,
    check_lengths,
    config_from_json,
    default_aux_layer_ids,
    load_config_only,
    num_decoder_layers,
    required_geometry_keys,
    target_facts,
    target_parameter_counts,
    target_weight_bytes,
    text_config,
    text_json,
    validate_aux_layer_ids,
    validate_geometry,
)
from .info import TargetInfo, TargetInfoError
from .load import (
    DEVICE_HELP,
    EMBED_NAMES,
    FINAL_NORM_NAMES,
    LAYER_PREFIXES,
    LM_HEAD_NAMES,
    checkpoint_weight_map,
    default_device,
    load_target,
    load_target_head_tensors,
    load_target_layer_tensors,
    load_target_tensors,
)
from .resolve import (
    EMBEDDED_HUB_IDS,
    EMBEDDED_PREFIX,
    EMBEDDED_TARGETS,
    TARGETS_DIR,
    bundled_target_config,
    cache_dir,
    embedded_gguf_path,
    load_config_json,
    load_target_config,
    resolve_target,
    verifier_name,
)

__all__ = [
    "DEVICE_HELP", "DTYPE_BYTES", "EMBEDDED_HUB_IDS", "EMBEDDED_PREFIX", "EMBEDDED_TARGETS", "EMBED_NAMES",
    "FINAL_NORM_NAMES", "GEOMETRY_KEYS", "LAYER_PREFIXES", "LM_HEAD_NAMES", "MXFP4_BYTES_PER_PARAM", "TARGETS_DIR",
    "TargetInfo", "TargetInfoError", "aux_layer_ids", "bundled_target_config", "cache_dir", "check_lengths", "checkpoint_weight_map",
    "config_from_json", "default_aux_layer_ids", "default_device", "embedded_gguf_path", "load_config_json",
    "load_config_only", "load_target", "load_target_config", "load_target_head_tensors",
    "load_target_layer_tensors", "load_target_tensors", "num_decoder_layers", "required_geometry_keys",
    "resolve_target", "target_facts", "target_parameter_counts", "target_weight_bytes", "text_config", "text_json", "validate_aux_layer_ids",
    "validate_geometry", "verifier_name",
]
