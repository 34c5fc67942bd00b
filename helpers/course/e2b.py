"""Gemma 4 E2B at full scale without weights: its real configuration on the meta device and the bytes that follow."""

import json
import pathlib

import torch

from ..backend import V5E_BYTES_PER_S
from ..decode import READBACK_EVERY
from ..packed import GROUP_SIZE, table_row_words
from . import sources

# The source study's ring cache held 131,328 positions: the course's long-context figures use it.
CONTEXT = 131_328

E2B_CONFIG = pathlib.Path(__file__).with_name("e2b_config.json")


def int4_bytes(numel: int, group_size: int = GROUP_SIZE, scale_bytes: int = 2) -> int:
    """Bytes of ``numel`` values stored packed in int4 with one scale of ``scale_bytes`` per group."""
    return numel // 2 + numel // group_size * scale_bytes


def table_bytes(rows: int, cols: int) -> int:
    """Bytes of a ``rows`` x ``cols`` 4-bit table laid out for a TPU, its padding counted."""
    return rows * table_row_words(cols) * 4


def real_config():
    """Gemma 4 E2B's text configuration, from the facts in ``e2b_config.json``."""
    from transformers import Gemma4TextConfig

    facts = json.loads(E2B_CONFIG.read_text())
    return Gemma4TextConfig(**{k: v for k, v in facts.items() if not k.startswith("_") and k != "model_type"})


def meta_model(config):
    """The text model built on the meta device: every shape, no weights, no memory."""
    from transformers import Gemma4ForCausalLM

    with torch.device("meta"):
        return Gemma4ForCausalLM(config)


def _linears(module) -> list[torch.Tensor]:
    return [m.weight for m in module.modules() if isinstance(m, torch.nn.Linear)]


def component_bytes(model) -> list[dict]:
    """Bytes of the tables, linears, lm_head copy: bf16, int4 group-32 (the source's), and as the course stores them."""
    inner = model.model
    linears = _linears(inner)
    rows = [  # (name, tensors, whether a table)
        ("embed_tokens", [inner.embed_tokens.weight], True),
        ("embed_tokens_per_layer", [inner.embed_tokens_per_layer.weight], True),
        (f"linears ({len(linears)})", linears, False),
        ("lm_head copy", [model.lm_head.weight], True),
    ]
    return [
        {
            "component": name,
            "shape": list(tensors[0].shape) if len(tensors) == 1 else "-",
            "bf16_bytes": sum(t.numel() for t in tensors) * 2,
            "int4_bytes": sum(int4_bytes(t.numel()) for t in tensors),
            "int4_exact_bytes": sum(table_bytes(*t.shape) if is_table else int4_bytes(t.numel()) for t in tensors),
        }
        for name, tensors, is_table in rows
    ]


def kv_cache_bytes(config, positions: int, ring: bool = False, dtype_bytes: int = 2, spare: int = 0) -> int:
    """Bytes of K and V for ``positions`` tokens over the cache-owning layers (KV-sharing layers
    hold none); with ``ring``, sliding layers keep only their window and ``spare`` slots."""
    return _kv_bytes(config, positions, ring, dtype_bytes, spare, read=False)


def kv_read_bytes(config, positions: int, ring: bool = False, dtype_bytes: int = 2, spare: int = 0) -> int:
    """Bytes of K and V one decode step reads: a K/V-sharing layer reads its type's last owner's (E2B: 7 full
    layers read full length, 28 sliding ones a window with ``ring``)."""
    return _kv_bytes(config, positions, ring, dtype_bytes, spare, read=True)


def _kv_bytes(config, positions: int, ring: bool, dtype_bytes: int, spare: int, read: bool) -> int:
    total, owner = 0, {}
    for mode, kind, layer in zip(config.kv_sharing_modes, config.layer_types, config.per_layer_config):
        if mode != "reuse":
            owner[kind] = layer
        elif not read:
            continue
        length = min(positions, config.sliding_window + spare) if ring and kind == "sliding_attention" else positions
        total += 2 * owner[kind].num_key_value_heads * owner[kind].head_dim * length * dtype_bytes
    return total


def full_attention_bytes(config, positions: int, chunk: int = 1) -> dict[str, int]:
    """K repeated per query head (transformers' ``repeat_kv``; ``ring.grouped_attention`` makes none)
    and the float32 scores, for a ``chunk`` of queries on a full-attention layer."""
    layer = next(c for c, kind in zip(config.per_layer_config, config.layer_types) if kind == "full_attention")
    heads = config.num_attention_heads
    return {"k_repeated": heads * positions * layer.head_dim * 2, "scores": heads * chunk * positions * 4}


def prefill_flops(config, chunk: int) -> dict[str, float]:
    """Weight FLOPs per prefilled token (a multiply-add per weight, not attention's scores) in chunks of ``chunk`` rows:
    ``every row`` runs every layer and the head on each row (the ring's before issue 44), ``head on one row`` every layer
    (notebook 04's before it), ``cut`` the layers from the first KV-sharing one and the head on one row a chunk."""
    model = meta_model(config)
    first_shared = config.num_hidden_layers - config.num_kv_shared_layers
    shared = 2 * sum(w.numel() for w in _linears(model.model.layers[first_shared:]))
    own = 2 * sum(w.numel() for w in _linears(model.model)) - shared  # the first layers and the per-layer inputs
    head = 2 * model.lm_head.weight.numel()
    return {
        "every row": own + shared + head,
        "head on one row": own + shared + head / chunk,
        "cut": own + (shared + head) / chunk,
    }


ASSISTANT_LAYERS = ["sliding_attention"] * 3 + ["full_attention"]


def assistant_config():
    """The synthetic assistant's configuration (Google's is not in this repository's sources): E2B's widths, four
    ``ASSISTANT_LAYERS`` reading the target's K/V, transformers' ordered-head defaults (2,048 centroids, top 32)."""
    from transformers import Gemma4AssistantConfig, Gemma4TextConfig

    facts = json.loads(E2B_CONFIG.read_text())  # the checkpoint's widths (its config object hides some)
    widths = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    text = Gemma4TextConfig(
        **{k: facts[k] for k in (*widths, "head_dim", "global_head_dim", "sliding_window")},
        num_hidden_layers=len(ASSISTANT_LAYERS),
        layer_types=ASSISTANT_LAYERS,
        num_kv_shared_layers=len(ASSISTANT_LAYERS),
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        use_double_wide_mlp=False,
    )
    return Gemma4AssistantConfig(
        text_config=text, backbone_hidden_size=facts["hidden_size"], use_ordered_embeddings=True
    )


def call_figures(k: int = 4, tokens_per_verify: float = 3.21, context: int = 256) -> dict:
    """One call of notebook 09 on a v5e-1 in decode steps, from E2B's and the assistant's configurations (a hypothesis:
    no TPU ran it), bytes at 819 GB/s plus FLOPs at the bf16 peak: the verify reads the bf16 step's bytes once for K+1
    rows, each of the K drafts the assistant's weights (its ordered head: the top centroids' rows) and target K/V."""
    from transformers import Gemma4AssistantForCausalLM

    step = next(r for r in step_figures(context) if r["step"] == "04 compiled decode")

    def seconds(read: float, flops: float) -> float:
        return read / V5E_BYTES_PER_S + flops / sources.V5E_BF16_FLOPS

    with torch.device("meta"):
        assistant = Gemma4AssistantForCausalLM(assistant_config())
    ordered, head = assistant.masked_embedding, assistant.lm_head.weight
    skipped = head.shape[0] - ordered.centroid_intermediate_top_k * (head.shape[0] // ordered.num_centroids)
    params = sum(p.numel() for p in assistant.parameters()) - skipped * head.shape[1]
    real = real_config()
    modes = zip(real.kv_sharing_modes, real.layer_types, real.per_layer_config)
    owner = {kind: layer for mode, kind, layer in modes if mode != "reuse"}  # each type's last: its K/V are read
    kv = sum(2 * owner[kind].num_key_value_heads * owner[kind].head_dim * context * 2 for kind in ASSISTANT_LAYERS)
    one_step = seconds(step["bytes_per_token"], step["flops_per_token"])
    verify = seconds(step["bytes_per_token"], (k + 1) * step["flops_per_token"]) / one_step
    draft = k * seconds(params * 2 + kv, 2 * params) / one_step
    return {
        "K": k,
        "step_ms": one_step * 1e3,
        "verify_steps": verify,
        "drafts_steps": draft,
        "call_steps": verify + draft,
        "tokens_per_verify": tokens_per_verify,
        "x_one_token": tokens_per_verify / (verify + draft),
    }


def estimate_device_bytes(config, dequantize: bool) -> int:
    """Device bytes the text decoder holds after a forward: compressed-tensors expands every packed
    weight to bf16 at load or on the first forward, keeping the scales too unless ``dequantize``."""
    model = meta_model(config)
    scales = 0 if dequantize else sum(w.numel() // GROUP_SIZE * 2 for w in _linears(model.model))
    return sum(p.numel() for p in model.parameters()) * 2 + scales  # parameters() counts tied weights once


def fit_options(config, max_len: int = CONTEXT) -> list[dict]:
    """What each way into less device memory saves (a host per-layer table, a row a token, is Gemma 3n's way)."""
    parts = {r["component"].split(" ")[0]: r for r in component_bytes(meta_model(config))}
    linears, table = parts["linears"], parts["embed_tokens_per_layer"]
    cache = kv_cache_bytes(config, max_len, ring=True)
    quarter = kv_cache_bytes(config, max_len // 4, ring=True)
    saves = {
        "linears kept packed in int4 (notebook 07)": linears["bf16_bytes"] - linears["int4_bytes"],
        "per-layer table in host memory, one row per token (vs notebook 05's 4-bit table)": table["int4_exact_bytes"],
        f"ring cache for {max_len // 4:,} positions instead of {max_len:,}": cache - quarter,
        f"KV cache in int8 ({max_len:,} positions)": cache // 2,
    }
    return [{"option": option, "saves": saved} for option, saved in saves.items()]


def bytes_by_step(max_len: int = 256) -> dict[str, dict[str, int]]:
    """Device bytes by component at E2B scale after steps 02-05, for notebook 05's stacked chart."""
    config = real_config()
    parts = {r["component"].split(" ")[0]: r for r in component_bytes(meta_model(config))}
    embed, table, linears = parts["embed_tokens"], parts["embed_tokens_per_layer"], parts["linears"]
    kv = kv_cache_bytes(config, max_len)
    loaded = {"embed_tokens": embed["bf16_bytes"], "per-layer table": table["bf16_bytes"]}
    bf16 = loaded | {"linears": linears["bf16_bytes"]}  # compressed-tensors expands the linears on the 1st forward
    return {
        "02 loading": loaded | {"linears": linears["int4_bytes"]},
        "03 baseline generate": bf16,
        "04 compiled decode": bf16 | {"KV cache": kv},
        "05 4-bit table": bf16 | {"per-layer table": table["int4_exact_bytes"], "KV cache": kv},
    }


def step_figures(context: int = 256, ring_context: int = CONTEXT, bandwidth: float = V5E_BYTES_PER_S) -> list[dict]:
    """Per step at E2B scale: weights, bytes a step reads, cache, ceiling tok/s at ``bandwidth``, FLOPs at batch 1."""
    config = real_config()
    inner = meta_model(config).model  # the head is tied to embed_tokens: no weights of its own
    linears = [w.numel() for w in _linears(inner)]
    embed = inner.embed_tokens.weight.numel()
    rows, cols = inner.embed_tokens_per_layer.weight.shape
    rest = sum(p.numel() for p in inner.parameters()) - sum(linears) - embed - rows * cols  # norms, scalars
    lin = {"bf16": sum(linears) * 2, "int4": sum(int4_bytes(n) for n in linears)}
    lin["int4 bytes"] = sum(n + n // GROUP_SIZE * 2 for n in linears)  # a code per byte, not int8 quantization
    # (bytes, bytes of a row) as notebook 05 lays it out: float32 steps beside the codes, rows of 128-word multiples
    table = {"bf16": (rows * cols * 2, cols * 2), "int4": (table_bytes(rows, cols), table_row_words(cols) * 4)}
    head = {"bf16": embed * 2, "int4": table_bytes(*inner.embed_tokens.weight.shape)}
    # (step, linears, per-layer table, main table and head, positions, ring: its slots past the window, or None)
    steps = [
        ("03 baseline generate", "bf16", "bf16", "bf16", context, 0),
        ("04 compiled decode", "bf16", "bf16", "bf16", context, None),
        ("05 4-bit table", "bf16", "int4", "bf16", context, None),
        (f"06 ring cache, {ring_context:,} positions", "bf16", "int4", "bf16", ring_context, READBACK_EVERY),
        ("07 past the source, int4 codes a byte each", "int4 bytes", "int4", "bf16", context, None),
        ("07 past the source, int4 linears", "int4", "int4", "bf16", context, None),
        ("07 past the source, int4 linears, 4-bit head", "int4", "int4", "int4", context, None),
    ]
    out = []
    for step, lin_fmt, table_fmt, head_fmt, positions, spare in steps:
        ring = {"ring": spare is not None, "spare": spare or 0}
        cache = kv_read_bytes(config, positions, **ring)
        held = lin[lin_fmt] + head[head_fmt] + rest * 2  # besides the per-layer table
        read = held + table[table_fmt][1] + cache
        out.append(
            {
                "step": step,
                "linears": lin_fmt,
                "per-layer table": table_fmt,
                "head": head_fmt,
                "weights_on_device": held + table[table_fmt][0],
                "cache_held": kv_cache_bytes(config, positions, **ring),
                "cache_read": cache,
                "bytes_per_token": read,
                "ceiling_tok_s": bandwidth / read,
                "flops_per_token": 2 * (sum(linears) + embed),  # a multiply-add per weight, head included
            }
        )
    return out
