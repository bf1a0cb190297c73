"""Hugging Face config.json ⇄ `ModelArgs`: the families we read, every key's default as
`transformers` defines it for that family, and what each family may carry.

A key missing from config.json takes the family's own default (a Mixtral without
`rope_theta` has 1e6, a Mistral without `sliding_window` a window of 4096), never a default
of ours; tests/test_hf_interop.py compares each of them with `transformers`. A null value
is kept as null (a Mistral with `"sliding_window": null` has no window). A feature we cannot
compute is refused by `HFConfigError`, one line naming the key, its value and the reason.

What the families add to the Llama block (model/llama.py holds every piece):
- qwen2: q/k/v biases; qwen3: q/k norms and a head_dim of its own; mixtral, qwen3_moe:
  routed experts.
- mistral, mixtral, phi3: a sliding window on every layer (`sliding_window`, null: none);
  qwen2, qwen3: on the layers from `max_window_layers` on when `use_sliding_window`
  (or those `layer_types` names); qwen3_moe: on every layer when `use_sliding_window`.
- phi3: fused q/k/v and gate/up projections (model/hf.py splits them), longrope scaling.
- gemma2: norms scaling by (1 + weight), a second norm after attention and after the MLP,
  a tanh-GeLU gate, embeddings × √hidden_size, query_pre_attn_scalar, soft-capped
  attention scores and logits, a window on every other layer (`layer_types`).
- gpt_oss: attention sinks, q/k/v/o biases, a window on every other layer (`layer_types`),
  YaRN, experts in every block with a biased top-k-then-softmax router, biased experts and
  the clamped SwiGLU (swiglu_limit; swiglu_alpha must be 1.702); its stacked, interleaved
  and possibly MXFP4 expert tensors: model/hf_gpt_oss.py.
- gemma3_text: Gemma 2's block with q/k norms (scaling by 1 + weight), no soft-capping by
  default, a window on five layers of six (`layer_types`, or `sliding_window_pattern`), and
  one rotary per layer type: the global layers rope_theta and its scaling, the local
  (windowed) ones their own base unscaled (`rope_parameters.sliding_attention`, or
  `rope_local_base_freq`).
- olmo2: q/k norms over all heads together (before the split into heads), and norms after
  attention and after the MLP instead of before them.
Rotary scalings (model/rope.py) are read from `rope_scaling` or `rope_parameters`, the
first winning when both are there, as in transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import SimpleNamespace

from .args import ModelArgs, shape_problem
from .hf_deepseek import DEFAULTS as DEEPSEEK_DEFAULTS
from .hf_deepseek import MODEL_TYPES as DEEPSEEK_TYPES
from .hf_deepseek import deepseek_args
from .hf_deepseek import head_dim as deepseek_head_dim
from .rope import KINDS, REQUIRED, scaling_problem


class HFConfigError(ValueError):
    """A config.json we cannot read into a model: `str(err)` is the one line to show."""

    def __init__(self, key: str, value, rule: str):
        self.key, self.value, self.rule = key, value, rule
        super().__init__(f"{key} = {value!r}: {rule}")


def _defaults(**changes) -> dict:
    """Llama's defaults (transformers' LlamaConfig) with a family's changes."""
    base = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=None, head_dim=None, hidden_act="silu",
                max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0,
                attention_bias=False, mlp_bias=False)
    return {**base, **changes}


_QWEN = dict(vocab_size=151936, intermediate_size=22016, num_key_value_heads=32, max_position_embeddings=32768,
             use_sliding_window=False, sliding_window=4096, max_window_layers=28)
_MISTRAL = dict(intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=131072)


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    defaults: dict = field(default_factory=dict)  # transformers' default of every key we read
    qkv_bias: bool = False
    qk_norm: bool = False
    refused: tuple[str, ...] = ()  # keys that must be false (or absent) for the weights to mean what ours do
    window: str = ""  # "all": `sliding_window` on every layer; "qwen": see the module docstring; "alternating"
    moe: str = ""  # MoE: the block's module name and the names of gate, up and down in one expert
    expert_names: tuple[str, str, str] = ()
    fused: bool = False  # phi3: qkv_proj and gate_up_proj
    gemma: bool = False
    deepseek: bool = False  # deepseek_v3, kimi_k2: model/hf_deepseek.py


FAMILIES = {
    "llama": Family("llama", "LlamaForCausalLM", _defaults(), refused=("attention_bias", "mlp_bias")),
    "mistral": Family("mistral", "MistralForCausalLM", _defaults(**_MISTRAL, sliding_window=4096), window="all"),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", _defaults(**_QWEN), qkv_bias=True, window="qwen"),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", _defaults(**_QWEN, head_dim=128), qk_norm=True,
                    refused=("attention_bias",), window="qwen"),
    "mixtral": Family("mixtral", "MixtralForCausalLM",
                      _defaults(**_MISTRAL, rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None,
                                num_local_experts=8, num_experts_per_tok=2),
                      window="all", moe="block_sparse_moe", expert_names=("w1", "w3", "w2")),
    "qwen3_moe": Family("qwen3_moe", "Qwen3MoeForCausalLM",
                        _defaults(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                                  num_key_value_heads=4, max_position_embeddings=32768, use_sliding_window=False,
                                  sliding_window=4096, num_experts=128, num_experts_per_tok=8,
                                  moe_intermediate_size=768, norm_topk_prob=False, decoder_sparse_step=1,
                                  mlp_only_layers=[]),
                        qk_norm=True, refused=("attention_bias", "mlp_only_layers"), window="qwen_all",
                        moe="mlp", expert_names=("gate_proj", "up_proj", "down_proj")),
    "phi3": Family("phi3", "Phi3ForCausalLM",
                   _defaults(vocab_size=32064, hidden_size=3072, intermediate_size=8192, max_position_embeddings=4096,
                             original_max_position_embeddings=4096, rms_norm_eps=1e-5, sliding_window=None),
                   window="all", fused=True),
    "gemma2": Family("gemma2", "Gemma2ForCausalLM",
                     _defaults(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                               num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                               hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
                               tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
                               final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                               use_bidirectional_attention=None),
                     refused=("attention_bias", "use_bidirectional_attention"), window="alternating", gemma=True),
    **{name: Family(name, "DeepseekV3ForCausalLM", dict(DEEPSEEK_DEFAULTS), refused=("attention_bias",), moe="mlp",
                    expert_names=("gate_proj", "up_proj", "down_proj"), deepseek=True) for name in DEEPSEEK_TYPES},
    "gemma3_text": Family("gemma3_text", "Gemma3ForCausalLM",
                          _defaults(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                                    num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                                    hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
                                    tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
                                    final_logit_softcapping=None, attn_logit_softcapping=None,
                                    use_bidirectional_attention=False, rope_theta=1e6, rope_local_base_freq=10000.0,
                                    sliding_window_pattern=6),
                          qk_norm=True, refused=("attention_bias", "use_bidirectional_attention"), window="gemma3",
                          gemma=True),
    "olmo2": Family("olmo2", "Olmo2ForCausalLM",
                    _defaults(vocab_size=50304, intermediate_size=11008, max_position_embeddings=2048,
                              rms_norm_eps=1e-5),
                    qk_norm=True, refused=("attention_bias",)),
    "gpt_oss": Family("gpt_oss", "GptOssForCausalLM",
                      _defaults(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
                                num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                                max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=150000.0,
                                sliding_window=128, num_local_experts=128, num_experts_per_tok=4, swiglu_alpha=1.702,
                                swiglu_limit=7.0, attention_bias=True),
                      qkv_bias=True, window="alternating", moe="mlp"),
}
# gpt_oss's rotary scaling when its config.json names none (transformers' GptOssConfig).
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
# What the families' configs name elsewhere, with the reason we do not read it.
UNSUPPORTED = {
    "gemma3": "Gemma 3 (gemma3) is a vision-language model; its text part is supported as gemma3_text "
              "(Gemma3ForCausalLM: the text model's own folder)",
    "gemma": "Gemma (1) is not supported; Gemma 2 is",
    "phi": "Phi-1/Phi-2 use LayerNorm, a partial rotary and a parallel block; Phi-3 (phi3) is supported",
}
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _get(c: dict, family: Family, key: str):
    """config.json's value, or the family's default when the key is missing (a null stays null)."""
    if key in c:
        return c[key]
    if key in family.defaults:
        return family.defaults[key]
    raise HFConfigError(key, None, f"missing from config.json, and {family.model_type} has no default for it")


def _count(c: dict, family: Family, key: str, *null):
    """A count of config.json: a positive integer; with `null` given, a null (or a missing
    key without a family default) is that instead."""
    value = c.get(key, family.defaults.get(key, *null)) if null else _get(c, family, key)
    if null and value is None:
        return null[0]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise HFConfigError(key, value, "must be a positive integer")
    return value


def _positive(value, key: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
        raise HFConfigError(key, value, "must be a positive finite number")
    return float(value)


_KEYS = SimpleNamespace(get=_get, count=_count, positive=_positive, error=HFConfigError)  # for hf_deepseek


def family_of_config(c: dict) -> Family:
    model_type = c.get("model_type")
    if model_type is None:
        raise HFConfigError("model_type", None, "missing from config.json (transformers needs it too); "
                            f"supported: {', '.join(FAMILIES)}")
    if model_type in UNSUPPORTED:
        raise HFConfigError("model_type", model_type, UNSUPPORTED[model_type])
    if model_type not in FAMILIES:
        raise HFConfigError("model_type", model_type, f"not supported; supported: {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def args_from_hf_config(config) -> ModelArgs:
    """The `ModelArgs` of a `transformers` config (or its dict, config.json) of a supported
    family. Raises HFConfigError naming the key of anything it cannot hold."""
    c = config if isinstance(config, dict) else config.to_dict()
    family = family_of_config(c)
    if family.model_type == "gpt_oss" and not (c.get("rope_scaling") or c.get("rope_parameters")):
        c = {**c, "rope_parameters": GPT_OSS_ROPE}
    local_theta = 0.0
    if family.model_type == "gemma3_text":
        c, local_theta = _gemma3_rope(c, family)
    for key in family.refused:
        if _get(c, family, key):
            raise HFConfigError(key, c[key], f"{family.model_type} with {key} is not supported (the weights would "
                                "not mean what ours do)")
    act_key = "hidden_activation" if family.gemma else "hidden_act"
    act = _get(c, family, act_key)
    if act not in ACTIVATIONS or (ACTIVATIONS[act] == "gelu_tanh") != family.gemma:
        raise HFConfigError(act_key, act, "not supported: silu (SwiGLU), or gelu_pytorch_tanh in Gemma 2")
    heads, dim = _count(c, family, "num_attention_heads"), _count(c, family, "hidden_size")
    head_dim = _count(c, family, "head_dim", None) if not family.deepseek else deepseek_head_dim(c, family, _KEYS)
    if head_dim is None and dim % heads:
        raise HFConfigError("num_attention_heads", heads, f"must divide hidden_size = {dim} (no head_dim is given)")
    head_dim = head_dim or dim // heads
    n_layers = _count(c, family, "num_hidden_layers")
    max_len = _count(c, family, "max_position_embeddings")
    kv_heads = _count(c, family, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise HFConfigError("num_key_value_heads", kv_heads, f"must divide num_attention_heads = {heads}")
    rope = _rope(c, family, head_dim if not family.deepseek else _count(c, family, "qk_rope_head_dim"), max_len)
    if rope.get("rope_type") == "dynamic":  # transformers' max_position_embeddings is where it starts
        max_len = int(rope["factor"] * max_len)
    args = ModelArgs(
        dim=dim, n_layers=n_layers, n_heads=heads,
        n_kv_heads=kv_heads,
        ffn_dim=_count(c, family, "intermediate_size"),
        vocab_size=_count(c, family, "vocab_size"),
        max_seq_len=max_len,
        rope_theta=_positive(_rope_theta(c, family), "rope_theta"),
        norm_eps=_positive(_get(c, family, "rms_norm_eps"), "rms_norm_eps"),
        tie_embeddings=bool(_get(c, family, "tie_word_embeddings")),
        head_dim=head_dim,
        qkv_bias=family.qkv_bias,
        qk_norm=family.qk_norm,
        rope_scaling=json.dumps(rope, sort_keys=True) if rope.get("rope_type", "default") != "default" else "",
        **_window(c, family, n_layers),
        **_gemma(c, family, dim),
        **_moe_args(family, c),
        **_gpt_oss(family, c),
        **({"rope_local_theta": local_theta} if local_theta else {}),
        **(dict(qk_norm_all=True, pre_norm=False, sandwich_norm=True) if family.model_type == "olmo2" else {}),
    )
    problem = shape_problem(args)
    if problem:  # what the keys cannot say one by one: top-k above the expert count, experts on no layer
        key, value, rule = problem
        raise HFConfigError(_HF_KEYS.get(key, key), value, rule.replace("moe_experts", "the expert count").replace(
            "n_layers", "num_hidden_layers"))
    return args


_HF_KEYS = {"moe_top_k": "num_experts_per_tok", "moe_every": "decoder_sparse_step", "moe_experts": "num_experts",
            "moe_groups": "n_group", "moe_topk_groups": "topk_group", "first_k_dense": "first_k_dense_replace"}


def _rope_params(c: dict) -> dict:
    """The scaling dict: `rope_scaling` (the older spelling) wins over `rope_parameters`, as
    in transformers; the kind is `rope_type` or, older still, `type`."""
    params = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise HFConfigError("rope_scaling", params, "must be a JSON object")
    if any(isinstance(v, dict) for v in params.values()):
        raise HFConfigError("rope_parameters", params, "one set of rotary parameters per layer type is not "
                            "supported (every layer here rotates alike)")
    params = dict(params)
    params.setdefault("rope_type", params.pop("type", "default"))
    params.pop("type", None)
    return params


def _rope_theta(c: dict, family: Family) -> float:
    params = _rope_params(c)
    if params.get("rope_theta") is not None:
        return params["rope_theta"]
    return _get(c, family, "rope_theta")


_OPTIONAL = {"yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
             "longrope": ("factor", "attention_factor")}


def _rope(c: dict, family: Family, head_dim: int, max_len: int) -> dict:
    """The scaling dict as `ModelArgs.rope_scaling` keeps it: its kind, the parameters that
    kind reads, the original context filled in as transformers fills it."""
    params = _rope_params(c)
    kind = params["rope_type"]
    if family.fused and kind in ("su", "yarn"):  # Phi-3's older names of longrope
        kind = "longrope"
    partial = params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1.0, 1):
        raise HFConfigError("partial_rotary_factor", partial, "a partial rotary is not supported (every pair of a "
                            "head rotates here)")
    if kind not in KINDS:
        raise HFConfigError("rope_scaling.rope_type", kind, f"not supported; supported: {', '.join(KINDS)}")
    if kind == "default":
        return {"rope_type": "default"}
    if kind in ("llama3", "yarn", "longrope"):
        top = c.get("original_max_position_embeddings", family.defaults.get("original_max_position_embeddings"))
        if top is not None:  # a top-level original_max_position_embeddings overrides the dict's
            params["original_max_position_embeddings"] = top
        params.setdefault("original_max_position_embeddings", max_len)
    if kind == "dynamic":
        params["original_max_position_embeddings"] = max_len
    keep = {k: params[k] for k in REQUIRED[kind] + _OPTIONAL.get(kind, ()) if params.get(k) is not None}
    keep["rope_type"] = kind
    problem = scaling_problem(json.dumps(keep), head_dim)
    if problem:
        raise HFConfigError("rope_scaling", c.get("rope_scaling") or c.get("rope_parameters"), problem)
    return keep


def _window(c: dict, family: Family, n_layers: int) -> dict:
    """sliding_window and window_layers of the family's spelling."""
    if not family.window:
        return {}
    if family.window in ("qwen", "qwen_all") and not _get(c, family, "use_sliding_window"):
        return {}
    window = _get(c, family, "sliding_window")
    if not window:
        return {}
    layers = None
    types = c.get("layer_types")
    if types is not None:
        if len(types) != n_layers or set(types) - {"sliding_attention", "full_attention"}:
            raise HFConfigError("layer_types", types, f"expected {n_layers} of sliding_attention, full_attention")
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif family.window == "qwen":
        layers = tuple(range(_get(c, family, "max_window_layers"), n_layers))
    elif family.window == "alternating":
        layers = tuple(range(0, n_layers, 2))
    elif family.window == "gemma3":  # transformers' default: the full layer closes each pattern
        pattern = _count(c, family, "sliding_window_pattern")
        layers = tuple(i for i in range(n_layers) if (i + 1) % pattern)
    if layers == tuple(range(n_layers)):
        layers = None
    if layers == ():
        return {}
    return {"sliding_window": int(window), "window_layers": layers}


def _gemma(c: dict, family: Family, dim: int) -> dict:
    if not family.gemma:
        return {}
    return dict(norm_offset=1.0, sandwich_norm=True, mlp_act="gelu_tanh", embed_scale=dim ** 0.5,
                query_pre_attn_scalar=float(_get(c, family, "query_pre_attn_scalar")),
                attn_softcap=float(_get(c, family, "attn_logit_softcapping") or 0.0),
                logit_softcap=float(_get(c, family, "final_logit_softcapping") or 0.0))


def _gemma3_rope(c: dict, family: Family) -> tuple[dict, float]:
    """Gemma 3's two rotaries: config.json with the global one's as the only rotary, and the
    local (windowed) layers' base. Spelled per layer type (`rope_parameters` with
    full_attention and sliding_attention) or, older, `rope_theta`, `rope_scaling` and
    `rope_local_base_freq`."""
    params = c.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    else:
        full = dict(c.get("rope_scaling") or params or {})
        local = {"rope_type": "default", "rope_theta": _get(c, family, "rope_local_base_freq")}
    kind = local.get("rope_type", local.get("type", "default"))
    if kind != "default":
        raise HFConfigError("rope_parameters.sliding_attention.rope_type", kind, "the local layers' rotary must be "
                            "unscaled (default), as in Gemma 3")
    full.setdefault("rope_theta", _get(c, family, "rope_theta"))
    c = {k: v for k, v in c.items() if k not in ("rope_scaling", "rope_parameters")}
    c["rope_theta"], c["rope_parameters"] = full["rope_theta"], full
    return c, _positive(local.get("rope_theta", family.defaults["rope_local_base_freq"]),
                        "rope_parameters.sliding_attention.rope_theta")


def _gpt_oss(family: Family, c: dict) -> dict:
    """gpt_oss's sinks, output bias, router and experts (its biases on q, k, v: Family.qkv_bias)."""
    if family.model_type != "gpt_oss":
        return {}
    if not _get(c, family, "attention_bias"):
        raise HFConfigError("attention_bias", c["attention_bias"], "gpt_oss without attention biases is not supported "
                            "(the published models have them)")
    alpha = _get(c, family, "swiglu_alpha")
    if alpha != 1.702:
        raise HFConfigError("swiglu_alpha", alpha, "only gpt-oss's 1.702 is supported (the clamped SwiGLU's gain is "
                            "fixed here)")
    return dict(attn_sinks=True, o_bias=True, moe_experts=_count(c, family, "num_local_experts"),
                moe_top_k=_count(c, family, "num_experts_per_tok"), moe_ffn_dim=_count(c, family, "intermediate_size"),
                moe_router="topk_softmax", moe_router_bias=True, moe_expert_bias=True,
                moe_swiglu_limit=_positive(_get(c, family, "swiglu_limit"), "swiglu_limit"))


def _moe_args(family: Family, c: dict) -> dict:
    """The MoE fields of `ModelArgs` from a Mixtral or Qwen3-MoE config (DeepSeek-V3's, with
    its latent attention: model/hf_deepseek.py)."""
    if family.deepseek:
        return deepseek_args(c, family, _KEYS)
    if family.model_type == "mixtral":
        return dict(moe_experts=_count(c, family, "num_local_experts"),
                    moe_top_k=_count(c, family, "num_experts_per_tok"),
                    moe_ffn_dim=_count(c, family, "intermediate_size"), moe_norm_topk=True)
    if family.model_type == "qwen3_moe":
        key = "num_experts" if c.get("num_experts") is not None or "num_local_experts" not in c else "num_local_experts"
        return dict(moe_experts=_count(c, family, key), moe_top_k=_count(c, family, "num_experts_per_tok"),
                    moe_ffn_dim=_count(c, family, "moe_intermediate_size"),
                    moe_norm_topk=bool(_get(c, family, "norm_topk_prob")),
                    moe_every=_count(c, family, "decoder_sparse_step", None) or 1)
    return {}
