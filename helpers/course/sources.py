"""What others measured, each figure with where it comes from: the only place the course types
a number it did not measure or compute, but for two kinds kept where they are used: the v5e's
published bandwidth and the HBM a v5e-1 gives programs (``backend.V5E_*``, the backend's policy)
and the source's long context (``e2b.CONTEXT``, 131,328 positions).
Everything else a notebook shows is measured in its run or computed from the real configuration.

The source study is "PyTorch on TPU: Hands On With Colab": Gemma 4 E2B (4-bit QAT) with
PyTorch on one Colab TPU v5e-1 (16 GB of HBM on Google's page), one optimization at a time.
"""

# Notebook 01: on an op stack, torch.compile ran ">98x" faster than eager.
COMPILE_SPEEDUP = 98
# Decode tokens/s of each step, batch 1.
HF_GENERATE_TOK_S = 5  # plain HF generate: "~5 tok/s"
COMPILED_STEP_TOK_S = 32  # one compiled decode step: 31-33 tok/s
TABLE_4BIT_TOK_S = 50  # + the per-layer table in 4-bit: 50 tok/s
RING_TOK_S = 38  # + the ring cache: 38-45 tok/s, 38 at long context
RING_TOK_S_RANGE = (38, 45)

# Peers, on a Colab TPU v5e-1, batch 1, each its author's own figure.
JAX_BF16_TOK_S = 135.0  # a pure-JAX engine, bf16 weights unpacked once at load (xbill9/colab-jax,
#                         article 02-e2b-repack-vs-stock)

# vLLM TPU on a v5e-1, E2B, one request (xbill9/gemma4-dev, jev-tpu-v5e1/README.md): bf16, W8A8 made
# from the QAT weights, and each with Google's assistant drafting 4 tokens (load prompts run with
# ignore_eos); W8A8's quality against bf16 on the README's
# 3,880-record suite (+0.003, -0.007 to +0.013) and on GSM8K (-2.0 points, devto-gemma4-qat-v5e1.md)
VLLM_E2B_TOK_S = {"bf16": 144, "W8A8": 220, "bf16 + assistant": 346, "W8A8 + assistant": 395}
W8A8_VS_BF16 = {"suite": 0.003, "GSM8K points": -2.0}
# TPU v5e as published: Google's bf16 peak of one chip; the int8 peak, "393 TOPS (exactly 2x bf16)"
# (xbill9/gemma4-dev, tpu-vllm-v5e1-2b/devto-vllm-gemma4-e2b-v5e1.md)
V5E_BF16_FLOPS = 197e12
V5E_INT8_OPS = 393e12
