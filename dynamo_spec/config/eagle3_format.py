"""The EAGLE-3 draft checkpoint format vLLM 0.32 loads (``LlamaForCausalLMEagle3``).

One home for it: the config fields, the tensor names and shapes ``llama_eagle3.py``
loads, the rule for aux layer ids, and our marker for an untrained draft. The default
model's untrained draft, training's export, preflight and the test fixtures all use it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

ARCHITECTURE = "LlamaForCausalLMEagle3"
UNTRAINED_KEY = "dynamo_spec_untrained"  # config.json: random weights, nothing will be accepted

# Copied from the target's config.json when present: the draft layer has the target's shape.
_TARGET_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "vocab_size", "max_position_embeddings", "hidden_act", "bos_token_id",
                "eos_token_id", "rope_parameters", "rope_theta", "rope_scaling", "attention_bias", "mlp_bias")


def layers_outside(ids: Iterable[int], num_target_layers: int) -> list[int]:
    """The aux layer ids a target of this depth does not have. vLLM's id i is the hidden
    state after i decoder layers: 0 is the embeddings, ``num_target_layers`` the last
    layer's output."""
    return [i for i in ids if not 0 <= i <= num_target_layers]


def aux_layer_problem(ids: Iterable[int], num_target_layers: int) -> str | None:
    """What is wrong with these aux layer ids for a target of this depth, or None."""
    ids = list(ids)
    outside = layers_outside(ids, num_target_layers)
    if outside:
        return f"{outside} outside 0..{num_target_layers} (id i = the hidden state after i layers)"
    if len(set(ids)) != len(ids):
        return "ids repeat (each must be a different layer)"
    return None


def draft_config(target_cfg: dict[str, Any], aux_layer_ids: Iterable[int], draft_vocab_size: int,
                 dtype: str = "bfloat16") -> dict[str, Any]:
    """config.json of a one-layer EAGLE-3 draft with the target's shape."""
    aux = [int(i) for i in aux_layer_ids]
    problem = aux_layer_problem(aux, target_cfg["num_hidden_layers"])
    if problem:
        raise ValueError(f"aux_layer_ids {aux}: {problem}")
    cfg = {k: target_cfg[k] for k in _TARGET_KEYS if target_cfg.get(k) is not None}
    cfg.update({
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "draft_vocab_size": int(draft_vocab_size),
        "target_hidden_size": target_cfg["hidden_size"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True},
    })
    return cfg


def _written_aux_ids(cfg: dict[str, Any]) -> tuple[list[int], str] | None:
    eagle = cfg.get("eagle_config") or {}
    for ids, where in ((cfg.get("eagle_aux_hidden_state_layer_ids"), "the draft's config.json"),
                       (eagle.get("eagle_aux_hidden_state_layer_ids"), "the draft's config.json (eagle_config)")):
        if ids:
            return list(ids), where
    return None


def aux_layer_ids(cfg: dict[str, Any], num_target_layers: int) -> tuple[list[int], str]:
    """The aux layer ids vLLM will use for this draft config, and where they come from
    (the config, else vLLM's default for the target's depth)."""
    written = _written_aux_ids(cfg)
    if written:
        return written
    n = num_target_layers
    return [2, n // 2, n - 3], f"vLLM's default (2, L//2, L-3) for L={n}"


def aux_ids_of(cfg: dict[str, Any]) -> list[int]:
    """The aux layer ids a draft config names ([] when it leaves them to vLLM's default)."""
    written = _written_aux_ids(cfg)
    return written[0] if written else []


def tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor a draft with this config.json holds, name -> shape, except the
    vocabulary maps (see ``vocab_maps_needed``). 1-D entries are norm weights."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    n_aux = len(aux_ids_of(cfg)) or 3
    return {
        "fc.weight": (h, n_aux * cfg.get("target_hidden_size", h)),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, heads * hd),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.get("draft_vocab_size", cfg["vocab_size"]), h),
    }


def vocab_maps_needed(cfg: dict[str, Any]) -> bool:
    """A reduced draft vocabulary needs ``d2t`` (int64, ``target = draft + d2t[draft]``;
    vLLM refuses one when the vocabularies are equal) and, for other tools, ``t2d``."""
    return cfg.get("draft_vocab_size", cfg["vocab_size"]) != cfg["vocab_size"]


# --- the speculators format ---------------------------------------------------
# vLLM's `speculators` library (PyPI) defines the config.json of published EAGLE-3 drafts
# (e.g. RedHatAI's): the layer's config under `transformer_layer_config`, the method and the
# verifier (target) under `speculators_config`. The weights are the same tensors (vLLM maps
# `midlayer.` and `layers.0.` alike). vLLM converts the config when it loads
# (vllm/transformers_utils/configs/speculators/algos.py, `update_eagle3`); ``vllm_view``
# does the same so that preflight checks what vLLM will see.
SPECULATORS_KEY = "speculators_model_type"
SPECULATORS_EAGLE3_TYPES = ("eagle3", "peagle")  # peagle: EAGLE-3 with parallel drafting
_LAYER_ARCHS = {"llama": "Eagle3LlamaForCausalLM", "qwen3": "Eagle3Qwen3ForCausalLM"}


def is_speculators(cfg: dict[str, Any]) -> bool:
    return SPECULATORS_KEY in cfg


def vllm_view(cfg: dict[str, Any]) -> dict[str, Any]:
    """A draft's config.json as vLLM 0.32 sees it: speculators format converted, ours as is."""
    if not is_speculators(cfg):
        return cfg
    view = dict(cfg.get("transformer_layer_config") or {})
    view["draft_vocab_size"] = cfg.get("draft_vocab_size")
    if cfg.get("target_hidden_size") is not None:
        view["target_hidden_size"] = cfg["target_hidden_size"]
    view["norm_before_residual"] = cfg.get("norm_before_residual", True)  # vLLM's default for this format
    model_type = view.get("model_type", "llama")
    if model_type in _LAYER_ARCHS:
        view["architectures"] = [_LAYER_ARCHS[model_type]]
    if cfg.get("eagle_aux_hidden_state_layer_ids"):
        view["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_aux_hidden_state_layer_ids"]
    return view


def verifier_of(cfg: dict[str, Any]) -> dict[str, Any]:
    """The speculators format's verifier: ``name_or_path`` and ``architectures`` of the target."""
    return ((cfg.get("speculators_config") or {}).get("verifier")) or {}


def to_speculators(cfg: dict[str, Any], *, verifier: str, verifier_architectures: list[str],
                   num_speculative_tokens: int = 3) -> dict[str, Any]:
    """Our (vLLM-format) draft config.json in the speculators format, for the same weights."""
    layer = {k: v for k, v in cfg.items()
             if k not in ("architectures", "draft_vocab_size", "target_hidden_size", "eagle_config", UNTRAINED_KEY)}
    layer.setdefault("model_type", "llama")
    out = {
        "architectures": ["Eagle3Speculator"],
        SPECULATORS_KEY: "eagle3",
        "draft_vocab_size": cfg.get("draft_vocab_size", cfg["vocab_size"]),
        "target_hidden_size": cfg.get("target_hidden_size", cfg["hidden_size"]),
        # What our drafts compute (vLLM's own format defaults it to False, this one to True).
        "norm_before_residual": bool(cfg.get("norm_before_residual", False)),
        "eagle_aux_hidden_state_layer_ids": aux_ids_of(cfg),
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
    }
    if cfg.get(UNTRAINED_KEY):
        out[UNTRAINED_KEY] = True
    return out
