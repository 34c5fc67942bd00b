"""The tiny offline twin of Google's 4-bit Gemma 4 E2B checkpoint.

Same model class (`Gemma4ForConditionalGeneration`, text decoder under
`model.language_model.*`, tiny vision and audio towers beside it), same format
(compressed-tensors `pack-quantized`, symmetric int4, group 32, packed with
compressed-tensors' own compressor), same quirks (a separate `lm_head` copy although
the embeddings are tied; a tokenizer that does not add BOS by itself), shrunk so that it
builds in a second and runs anywhere. Its weights lie on a 4-bit grid, as QAT weights do,
so 4-bit storage of them is exact and every later step can prove identical tokens.
"""

from __future__ import annotations

import json
import os
import pathlib

import torch

GROUP_SIZE = 32
TWIN_VERSION = 2  # bump when the twin changes, so cached copies are rebuilt
CACHE_VAR = "HELPERS_CACHE"

TEXT_CONFIG = dict(
    vocab_size=512, vocab_size_per_layer_input=512, hidden_size=64, hidden_size_per_layer_input=32,
    intermediate_size=128, use_double_wide_mlp=True, num_hidden_layers=10, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, global_head_dim=64, num_kv_shared_layers=4, sliding_window=16,
    layer_types=["full_attention" if i % 5 == 4 else "sliding_attention" for i in range(10)],  # 4 sliding : 1 full
    max_position_embeddings=4096, final_logit_softcapping=30.0, tie_word_embeddings=True,
    pad_token_id=0, eos_token_id=1, bos_token_id=2,
    initializer_range=0.1,  # wider than the default 0.02: logits spread enough to give varied text
)
VISION_CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=16, global_head_dim=16)
AUDIO_CONFIG = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, output_proj_dims=64)
# Google's checkpoint packs the text decoder's linears only; the towers and lm_head stay bf16.
IGNORE = ["lm_head", "re:.*vision_tower.*", "re:.*audio_tower.*", "re:.*embed_vision.*", "re:.*embed_audio.*"]

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
CORPUS = """\
A TPU is a matrix machine: it is fast when it is handed large programs and slow when it is
handed one small operation at a time. Eager mode runs op by op. Defer and fuse records ops and
runs them as one program. torch.compile traces a whole function and compiles it once per shape.
The model reads its weights for every token, so decoding is bound by memory bandwidth.
Four-bit weights halve the bytes of eight-bit weights. A ring buffer keeps the last window of
keys and values. What is the capital of France? Paris is the capital of France.
Explain why compilation matters on a TPU, in two sentences.
"""


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get(CACHE_VAR) or pathlib.Path.home() / ".cache" / "gemma4-on-tpu")


def on_grid(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` moved onto a 4-bit grid: per group of ``group_size`` values along the last
    dimension, integer codes in [-8, 7] times one power-of-two scale.

    Returns (the weight on the grid, in its dtype; the scales, one per group). A power of two
    times a 4-bit integer is exact in bf16, so nothing is lost in any later dtype.
    """
    groups = weight.float().reshape(*weight.shape[:-1], -1, group_size)
    peak = groups.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    scale = torch.exp2(torch.ceil(torch.log2(peak / 7)))
    codes = torch.round(groups / scale).clamp(-8, 7)
    return (codes * scale).reshape(weight.shape).to(weight.dtype), scale.squeeze(-1)


def _tokenizer(folder: pathlib.Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TEXT_CONFIG["vocab_size"], special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>", add_bos_token=False)  # like the real one: no BOS by itself
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def build_tiny_twin(folder: str | os.PathLike | None = None, seed: int = 0) -> pathlib.Path:
    """Build (or reuse from the cache) the tiny twin checkpoint; returns its folder."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from safetensors.torch import load_file, save_file
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    folder = pathlib.Path(folder or cache_dir() / f"tiny-twin-v{TWIN_VERSION}-seed{seed}")
    if (folder / "twin.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(seed)
    config = Gemma4Config(text_config=TEXT_CONFIG, vision_config=VISION_CONFIG, audio_config=AUDIO_CONFIG)
    model = Gemma4ForConditionalGeneration(config).to(torch.bfloat16).eval()

    # QAT leaves weights on the 4-bit grid: put every text linear and embedding table there.
    scales = {}
    with torch.no_grad():
        for module in model.model.language_model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                weight, scales[module] = on_grid(module.weight)
                module.weight.copy_(weight)

    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP_SIZE)
    qconfig = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                                 ignore=IGNORE, format="pack-quantized")
    apply_quantization_config(model, qconfig)
    for module in model.modules():
        if hasattr(module, "weight_scale"):  # the grid's own scales, not an observer's estimate
            module.weight_scale.data.copy_(scales[module].to(module.weight_scale.dtype))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)

    # Google's checkpoint carries a full lm_head copy although the embeddings are tied.
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors["lm_head.weight"] = tensors["model.language_model.embed_tokens.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})

    _tokenizer(folder)
    (folder / "twin.json").write_text(json.dumps({"version": TWIN_VERSION, "seed": seed}))
    return folder
