"""A synthetic full-size Gemma 4 E2B checkpoint in the file set and format of Google's `-ct` export
(per ``e2b_config.json`` and published measurements: 2,504 tensors, 276 ``pack-quantized`` linears,
bf16 tables on a float32-step grid, an ``lm_head`` copy, stop ids 1 and 106), with seeded random
weights: for bytes, times, memory and programs at E2B scale, never for text. Chosen here: towers of
transformers' default configs (658 + 751 tensors, 0.95 GB), a small BPE with the real special ids
(thinking tokens at 107-109, chosen), and the weights' scales (see ``LAYER_SCALAR``)."""

from __future__ import annotations

import json
import os
import pathlib
import struct
import zlib

import torch

from ..packed import GROUP_SIZE, checkpoint_key
from . import e2b
from .twin import CHAT_TEMPLATE, CORPUS, building, cache_dir, quantization_config

SYNTHETIC = "e2b-synthetic"  # HELPERS_MODEL=e2b-synthetic runs the series on it
SYNTHETIC_VERSION = 3  # bump when the checkpoint changes, so cached copies are rebuilt
SPECIAL_IDS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<|turn>": 105, "<turn|>": 106}
CHOSEN_IDS = {"<|think|>": 107, "<|channel>": 108, "<channel|>": 109}
TABLE_STD = 0.03  # the tables' values
# Codes and levels are uniform in -7..7, not -8..7: a mean of -0.5 would give every linear's
# output and every table row a common part, and greedy decoding then picks one token forever.
CODE_STD = (224 / 12) ** 0.5  # of codes uniform in -7..7
# Measured at full size: with each layer's scalar at 1.0 the 35 layers' attention outputs (alike
# from step to step) pile up and greedy decoding repeats one token forever. With q_norm and k_norm
# at 1 random weights are chaotic: a 2**-9 relative change of the embeddings (below bf16 rounding)
# left logits correlated at 0.07-0.17, so differently rounding programs gave unrelated tokens. At
# 0.1 and 0.9: correlation 0.999, the same top token, and 8 greedy tokens still 8 different ones.
# (Weights: linear outputs about unit variance, table std 0.03, codes -7..7.)
LAYER_SCALAR = 0.9
QK_NORM = 0.1  # q_norm and k_norm weights: a soft attention, not a chaotic one
ROWS_PER_CHUNK = 4096  # a table is written in chunks of rows: its float32 product would not fit at once
_DTYPES = {torch.bfloat16: "BF16", torch.int32: "I32", torch.int64: "I64"}  # the ones it writes


def _generator(name: str, seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 2**32 + zlib.crc32(name.encode()))


def _words(shape, generator: torch.Generator):
    """``pack-quantized`` words of random codes -7..7, eight a word, low nibble first (code + 8)."""
    rows, width = shape
    for start in range(0, rows, ROWS_PER_CHUNK):
        nibbles = torch.randint(1, 16, (min(ROWS_PER_CHUNK, rows - start), width, 8), generator=generator)
        words = (nibbles << torch.arange(0, 32, 4)).sum(-1)  # int64: the top nibble may set bit 31
        yield torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _table_rows(shape, name: str, seed: int):
    """A table in row chunks, bf16(level x step) as Google's: levels -7..7, a float32 step per group."""
    rows, cols = shape
    generator = _generator(name, seed)
    for start in range(0, rows, ROWS_PER_CHUNK):
        n = min(ROWS_PER_CHUNK, rows - start)
        levels = torch.randint(-7, 8, (n, cols), generator=generator, dtype=torch.int8)  # mean 0: see CODE_STD
        steps = (torch.rand(n, cols // GROUP_SIZE, generator=generator) + 0.5) * (TABLE_STD / CODE_STD)
        yield (levels.float() * steps.repeat_interleave(GROUP_SIZE, dim=1)).to(torch.bfloat16)


def _entries(config, text_model, towers: dict[str, torch.Size], seed: int):
    """(name, dtype, shape, chunks) per tensor in write order; ``chunks()`` makes its data in pieces."""
    linears = {n for n, m in text_model.model.named_modules() if isinstance(m, torch.nn.Linear)}
    state = text_model.state_dict()
    for name, tensor in state.items():
        key, module = checkpoint_key(name), name.rsplit(".", 1)[0].removeprefix("model.")
        if name == "lm_head.weight":
            continue  # written last, as a copy of the main table
        if module in linears:
            out_f, in_f = tensor.shape
            gen = _generator(key, seed)
            words = (out_f, in_f // 8)
            yield (
                key.replace(".weight", ".weight_packed"),
                torch.int32,
                words,
                lambda w=words, g=gen: _words(w, g),
            )
            scales = (out_f, in_f // GROUP_SIZE)
            yield (
                key.replace(".weight", ".weight_scale"),
                torch.bfloat16,
                scales,
                lambda s=scales, g=gen, i=in_f: [
                    ((torch.rand(s, generator=g) * 0.4 + 0.8) / (CODE_STD * i**0.5)).to(torch.bfloat16)
                ],
            )
            yield key.replace(".weight", ".weight_shape"), torch.int64, (2,), lambda s=(out_f, in_f): [torch.tensor(s)]
        elif tensor.dim() == 2:  # the two embedding tables
            yield key, torch.bfloat16, tuple(tensor.shape), lambda s=tuple(tensor.shape), k=key: _table_rows(s, k, seed)
        else:  # norms' scales: ones, the query/key norms QK_NORM; each layer's scalar: LAYER_SCALAR
            value = (
                LAYER_SCALAR
                if name.endswith("layer_scalar")
                else QK_NORM
                if name.endswith(("q_norm.weight", "k_norm.weight"))
                else 1.0
            )
            yield (
                key,
                torch.bfloat16,
                tuple(tensor.shape),
                lambda s=tuple(tensor.shape), v=value: [torch.full(s, v, dtype=torch.bfloat16)],
            )
    for key, shape in towers.items():  # never read by the series: random, of the towers' sizes
        yield (
            key,
            torch.bfloat16,
            tuple(shape),
            lambda s=tuple(shape), k=key: [(torch.randn(s, generator=_generator(k, seed)) * 0.02).to(torch.bfloat16)],
        )
    embed = checkpoint_key("model.embed_tokens.weight")
    shape = tuple(state["model.embed_tokens.weight"].shape)
    yield "lm_head.weight", torch.bfloat16, shape, lambda: _table_rows(shape, embed, seed)  # the same values


def write_safetensors(path: pathlib.Path, entries) -> int:
    """Write the safetensors layout tensor by tensor (``save_file`` holds all in memory: 7.75 GB
    here); returns the bytes written."""
    entries = list(entries)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape, _ in entries:
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for *_, chunks in entries:
            for chunk in chunks():
                f.write(chunk.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())  # 0-d too
    return 8 + len(raw) + offset


def _tokenizer(folder: pathlib.Path, vocab_size: int):
    """A byte-level BPE on the twin's corpus, special tokens at the real ids, padded with
    ``<unusedN>`` to ``vocab_size`` so every id decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    named = SPECIAL_IDS | CHOSEN_IDS
    specials = [next((t for t, i in named.items() if i == n), f"<unused{n}>") for n in range(max(named.values()) + 1)]
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=min(len(specials) + 512, vocab_size),
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    trained.train_from_iterator(CORPUS.splitlines(), trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = model["vocab"] | {f"<unused{i}>": i for i in range(len(model["vocab"]), vocab_size)}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    fast.add_special_tokens({"additional_special_tokens": list(CHOSEN_IDS) + ["<|turn>", "<turn|>"]})
    fast.add_bos_token = False  # like the real one: no BOS by itself
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


def build_synthetic_e2b(folder: str | os.PathLike | None = None, seed: int = 0, text_config=None, towers=None):
    """Build (or reuse from the cache) the synthetic checkpoint; returns its folder. ``text_config``
    and ``towers`` (vision, audio configs) build a smaller one for tests."""
    from transformers import (
        Gemma4AudioConfig,
        Gemma4Config,
        Gemma4ForConditionalGeneration,
        Gemma4VisionConfig,
        GenerationConfig,
    )

    folder = pathlib.Path(folder or cache_dir() / f"e2b-synthetic-v{SYNTHETIC_VERSION}-seed{seed}")
    with building(folder) as done:
        if done:
            return folder
        folder.mkdir(parents=True, exist_ok=True)
        text = text_config or e2b.real_config()
        vision, audio = towers or (Gemma4VisionConfig(use_clipped_linears=True), Gemma4AudioConfig())
        config = Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=audio.to_dict())
        with torch.device("meta"):
            whole = Gemma4ForConditionalGeneration(config)
        tower_shapes = {
            k: t.shape
            for k, t in whole.state_dict().items()
            if k.startswith("model.") and not k.startswith("model.language_model.")
        }
        del whole
        written = write_safetensors(
            folder / "model.safetensors", _entries(text, e2b.meta_model(text), tower_shapes, seed)
        )
        saved = config.to_dict() | {
            "architectures": ["Gemma4ForConditionalGeneration"],
            "dtype": "bfloat16",
            "quantization_config": quantization_config().model_dump() | {"quant_method": "compressed-tensors"},
        }
        saved["quantization_config"]["quantization_status"] = "compressed"
        (folder / "config.json").write_text(json.dumps(saved, indent=2))
        GenerationConfig(bos_token_id=2, pad_token_id=0, eos_token_id=[1, 106]).save_pretrained(folder)
        _tokenizer(folder, text.vocab_size)
        (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma4Processor"}))
        (folder / "twin.json").write_text(json.dumps({"synthetic": SYNTHETIC_VERSION, "seed": seed, "bytes": written}))
    return folder


def build_synthetic_assistant(target: str | os.PathLike, seed: int = 0) -> pathlib.Path:
    """A random ``Gemma4AssistantForCausalLM`` in bf16 at E2B's widths beside the synthetic checkpoint ``target``."""
    from transformers import Gemma4AssistantForCausalLM, GenerationConfig

    target = pathlib.Path(target)
    folder = target.parent / f"{target.name}-assistant-seed{seed}"
    with building(folder) as done:
        if not done:
            config = e2b.assistant_config()
            text = config.get_text_config()
            torch.manual_seed(seed)
            assistant = Gemma4AssistantForCausalLM(config).to(torch.bfloat16)
            assistant.masked_embedding.token_ordering.copy_(torch.randperm(text.vocab_size))
            assistant.save_pretrained(folder)
            GenerationConfig(num_assistant_tokens=4, num_assistant_tokens_schedule="constant").save_pretrained(folder)
            (folder / "twin.json").write_text(json.dumps({"seed": seed}))  # written last: the build is done
    return folder
