"""What others measured, each figure with where it comes from: the only place the course types
a number it did not measure or compute. Everything else a notebook shows is measured in its
run or computed from the real configuration.

The source study is "PyTorch on TPU: Hands On With Colab": Gemma 4 E2B (4-bit QAT) with
PyTorch on one Colab TPU v5e-1 (16 GB HBM), one optimization at a time.
"""

SOURCE = "the source study, TPU v5e-1"
# Notebook 01: on an op stack, torch.compile ran ">98x" faster than eager.
COMPILE_SPEEDUP = 98
# Decode tokens/s of each step, batch 1.
HF_GENERATE_TOK_S = 5  # plain HF generate: "~5 tok/s"
COMPILED_STEP_TOK_S = 32  # one compiled decode step: 31-33 tok/s
TABLE_4BIT_TOK_S = 50  # + the per-layer table in 4-bit: 50 tok/s
RING_TOK_S = 38  # + the ring cache: 38-45 tok/s, 38 at long context
# The context its ring cache held: 131,328 positions.
CONTEXT = 131_328
# Its compile's peak memory: 16.6-16.9 GB, at the v5e-1's 16 GB of HBM.
COMPILE_PEAK_BYTES = (16.6e9, 16.9e9)

# Peers, on a Colab TPU v5e-1, batch 1, each its author's own figure.
JAX_BF16_TOK_S = 135.0  # a pure-JAX engine, bf16 weights unpacked once at load (xbill9/colab-jax,
#                         article 02-e2b-repack-vs-stock)
JAX_W4_TOK_S = 93.7  # the same engine, the 4-bit weights unpacked every step (same article)
VLLM_TOK_S = 123.7  # vLLM on TPU, one request at context 128 (xbill9/gemma4-dev, serving report)

# Google's published HBM bandwidth, bf16 peak and HBM size of one TPU v5e chip.
V5E_BYTES_PER_S = 819e9
V5E_BF16_FLOPS = 197e12
V5E_HBM_BYTES = 16e9
