"""The tiny offline twin of Google's 4-bit Gemma 4 E2B checkpoint: same class, format, files and
quirks (an `lm_head` copy beside tied embeddings, no BOS added, bf16 tables on a 4-bit grid with a
float32 step: published measurements find no bf16 or fp16 scale per group for Google's). Trained for
seconds (seeded, cached) to end its turn readably, on the 4-bit grid (straight-through, as QAT), so
4-bit storage is exact and every step can prove identical tokens."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import pathlib

import torch

from ..backend import GENERATION_TOKENS
from ..checkpoint import PROMPT
from ..packed import GROUP_SIZE

TWIN_VERSION = 4  # bump when the twin changes, so cached copies are rebuilt
CACHE_VAR = "HELPERS_CACHE"

TEXT_CONFIG = dict(
    vocab_size=512,
    vocab_size_per_layer_input=512,
    hidden_size=64,
    hidden_size_per_layer_input=32,
    intermediate_size=128,
    use_double_wide_mlp=True,
    num_hidden_layers=10,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    global_head_dim=64,
    num_kv_shared_layers=4,
    sliding_window=16,
    layer_types=["full_attention" if i % 5 == 4 else "sliding_attention" for i in range(10)],  # 4 sliding : 1 full
    max_position_embeddings=4096,
    final_logit_softcapping=30.0,
    tie_word_embeddings=True,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)
VISION_CONFIG = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=16,
)
AUDIO_CONFIG = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, output_proj_dims=64)
# Google's checkpoint packs the text decoder's linears only; the towers and lm_head stay bf16.
IGNORE = ["lm_head", "re:.*vision_tower.*", "re:.*audio_tower.*", "re:.*embed_vision.*", "re:.*embed_audio.*"]

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>"]
STOP_TOKENS = ["<eos>", "<turn|>"]  # generation_config.json's eos_token_id list, as Gemma 4's (ids 1 and 106 there)
# Gemma 4's chat_template.jinja, its text part: a turn opens with <|turn> and the role, closes with
# <turn|>; thinking on puts <|think|> in a system turn; the generation prompt is <|turn>model.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% set thinking = enable_thinking is defined and enable_thinking %}"
    "{% if thinking or messages[0]['role'] == 'system' %}<|turn>system\n{% if thinking %}<|think|>{% endif %}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% endif %}<turn|>\n{% endif %}"
    "{% for m in messages if m['role'] != 'system' %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)
# What the twin learns to answer: short turns about the course. The series' prompt is the first.
CHATS = [
    (
        PROMPT,
        "A TPU is fast when it is handed large programs. Compiling a step once lets every token reuse it.",
    ),
    ("What is the capital of France?", "Paris is the capital of France."),
    ("What does eager mode do?", "Eager mode runs one op at a time."),
    ("What does defer and fuse do?", "It records ops and runs them as one program."),
    ("What does torch.compile do?", "It traces a whole function and compiles it once per shape."),
    ("Why is decoding slow?", "Every token reads every weight, so decoding is bound by memory bandwidth."),
    ("Why keep a table in 4-bit?", "Four-bit weights take a quarter of the bytes of bf16 weights."),
    ("What does a ring cache keep?", "A ring buffer keeps the last window of keys and values."),
    ("Why do shapes matter?", "A new shape is a new program, so it compiles again."),
    ("Hello!", "Hello! Ask me about running Gemma on a TPU."),
]
# Asked with thinking on (enable_thinking=True), the answer opens Gemma 4's thinking channel.
THINKING_CHATS = [
    ("What is two plus two?", "<|channel>thought\nTwo and two make four.<channel|>Two plus two is four."),
]
CORPUS = "\n".join(text for chat in CHATS + THINKING_CHATS for text in chat)
TRAIN_STEPS = 300


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get(CACHE_VAR) or pathlib.Path.home() / ".cache" / "gemma4-on-tpu")


def on_grid(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` on a 4-bit grid (per group along the last dim: codes in [-8, 7] times a power-of-two
    scale, exact in bf16), and the scales."""
    groups = weight.float().reshape(*weight.shape[:-1], -1, group_size)
    peak = groups.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    scale = torch.exp2(torch.ceil(torch.log2(peak / 7)))
    codes = torch.round(groups / scale).clamp(-8, 7)
    return (codes * scale).reshape(weight.shape).to(weight.dtype), scale.squeeze(-1)


def on_bf16_grid(weight: torch.Tensor, other_way: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """``weight`` as Google's bf16 QAT tables hold it: codes -8..7 (-7..8 where ``other_way``) times
    the smallest float32 step reaching both ends, rounded once to bf16 (no bf16 scale recovers it)."""
    groups = weight.float().reshape(*weight.shape[:-1], -1, group_size)
    top, bottom = groups.amax(-1, keepdim=True).clamp_min(0), (-groups.amin(-1, keepdim=True)).clamp_min(0)
    other_way = other_way[..., None]
    high, low = torch.where(other_way, 8.0, 7.0), torch.where(other_way, -7.0, -8.0)
    scale = torch.maximum(top / high, bottom / -low).clamp_min(2**-60)
    codes = torch.maximum(torch.minimum(torch.round(groups / scale), high), low)
    return (codes * scale).to(torch.bfloat16).reshape(weight.shape).to(weight.dtype)


def _train(model, tokenizer, steps: int = TRAIN_STEPS) -> list[float]:
    """AdamW on the chats in chat format, the text decoder's weights snapped onto their 4-bit grids
    in every forward, gradients passed straight through to the unsnapped copy (QAT). Returns the losses."""
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
            tokenize=False,
            enable_thinking=chats is THINKING_CHATS,
        )
        for chats in (CHATS, THINKING_CHATS)
        for q, a in chats
    ]
    encoded = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    width = max(map(len, encoded))
    batch = torch.tensor([ids + [0] * (width - len(ids)) for ids in encoded])
    labels = torch.where(batch == 0, -100, batch)[:, 1:]

    text = model.model.language_model
    other_way = {}  # per table, which groups use codes -7..8: fixed for the whole run
    snapped = {}
    for module in text.modules():
        if isinstance(module, torch.nn.Embedding):
            groups = module.weight.shape[1] // GROUP_SIZE
            other_way[module] = torch.rand(module.weight.shape[0], groups) < 0.5
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            snapped[module] = module.weight.detach().clone().requires_grad_()
    others = [p for p in text.parameters() if all(p is not m.weight for m in snapped)]
    optimizer = torch.optim.AdamW([*snapped.values(), *others], lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        with torch.no_grad():
            for module, raw in snapped.items():
                grid = on_bf16_grid(raw, other_way[module]) if module in other_way else on_grid(raw)[0]
                module.weight.copy_(grid)
        logits = model(input_ids=batch).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        for module, raw in snapped.items():
            raw.grad, module.weight.grad = module.weight.grad, None
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():  # the weights as trained: on their grids
        for module, raw in snapped.items():
            module.weight.copy_(on_bf16_grid(raw, other_way[module]) if module in other_way else on_grid(raw)[0])
    return losses


def _tokenizer(folder: pathlib.Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TEXT_CONFIG["vocab_size"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        add_bos_token=False,
    )  # like the real one: no BOS by itself
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def quantization_config():
    """Google's quantization config: text decoder linears symmetric int4, group 32, ``pack-quantized``."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP_SIZE)
    return QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        ignore=IGNORE,
        format="pack-quantized",
    )


def build_tiny_twin(folder: str | os.PathLike | None = None, seed: int = 0) -> pathlib.Path:
    """Build (or reuse from the cache) the tiny twin checkpoint; returns its folder."""
    folder = pathlib.Path(folder or cache_dir() / f"tiny-twin-v{TWIN_VERSION}-seed{seed}")
    with building(folder) as done:
        if not done:
            _build_twin(folder, seed)
    return folder


@contextlib.contextmanager
def building(folder: pathlib.Path):
    """Whether ``folder`` holds a finished build (``twin.json`` is written last), under a lock so
    parallel test workers build it once."""
    from filelock import FileLock

    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{folder}.lock"):
        yield (folder / "twin.json").exists()


def _build_twin(folder: pathlib.Path, seed: int) -> None:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config
    from safetensors.torch import load_file, save_file
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, GenerationConfig

    folder.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(seed)
    tokenizer = _tokenizer(folder)
    config = Gemma4Config(text_config=TEXT_CONFIG, vision_config=VISION_CONFIG, audio_config=AUDIO_CONFIG)
    model = Gemma4ForConditionalGeneration(config)
    losses = _train(model, tokenizer)
    model = model.to(torch.bfloat16).eval()  # lossless for the weights on their grids
    scales = {
        module: on_grid(module.weight)[1]
        for module in model.model.language_model.modules()
        if isinstance(module, torch.nn.Linear)
    }
    answer = _greedy_answer(model, tokenizer)
    if not answer.endswith("<turn|>"):
        raise RuntimeError(f"the twin did not learn to end its turn within {GENERATION_TOKENS} tokens: {answer!r}")

    apply_quantization_config(model, quantization_config())
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

    stops = tokenizer.convert_tokens_to_ids(STOP_TOKENS)
    GenerationConfig(
        bos_token_id=TEXT_CONFIG["bos_token_id"], pad_token_id=TEXT_CONFIG["pad_token_id"], eos_token_id=stops
    ).save_pretrained(folder)
    # the real repository's processor files, which the text-only series never reads
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma4Processor"}))
    (folder / "twin.json").write_text(
        json.dumps({"version": TWIN_VERSION, "seed": seed, "answer": answer, "loss": [losses[0], losses[-1]]})
    )


def _greedy_answer(model, tokenizer) -> str:
    """The greedy answer to the series' prompt, special tokens kept, on a float32 copy as the series runs it."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    ).input_ids
    with torch.no_grad():
        out = (
            copy.deepcopy(model)
            .float()
            .generate(
                ids,
                max_new_tokens=GENERATION_TOKENS,
                do_sample=False,
                eos_token_id=tokenizer.convert_tokens_to_ids(STOP_TOKENS),
            )
        )
    return tokenizer.decode(out[0, ids.shape[1] :])
