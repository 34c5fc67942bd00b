"""The benchmarks' CPU-sized Gemma 4: the real class, ~49 M parameters, E2B's layer pattern
(a full-attention layer every fifth, the last four sharing K/V), random weights, float32."""

import torch
from transformers import Gemma4ForCausalLM, Gemma4TextConfig


def cpu_model(**overrides) -> Gemma4ForCausalLM:
    torch.manual_seed(0)
    config = Gemma4TextConfig(
        **{
            "vocab_size": 8192,
            "vocab_size_per_layer_input": 8192,
            "hidden_size": 512,
            "hidden_size_per_layer_input": 64,
            "intermediate_size": 2048,
            "num_hidden_layers": 10,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 128,
            "global_head_dim": 256,
            "num_kv_shared_layers": 4,
            "sliding_window": 64,
            "final_logit_softcapping": 30.0,
            "layer_types": ["full_attention" if i % 5 == 4 else "sliding_attention" for i in range(10)],
        }
        | overrides
    )
    return Gemma4ForCausalLM(config).eval()
