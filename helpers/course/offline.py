"""Offline checkpoints, seeded and cached. The tiny twin of Google's 4-bit Gemma 4 E2B has its class, format, files and
quirks (an `lm_head` copy beside tied embeddings, no BOS added, bf16 tables on a 4-bit grid with a float32 step, as
published measurements find Google's); trained for seconds on the 4-bit grid (QAT) to end its turn readably, its 4-bit
storage is exact and every step can prove identical tokens. Its assistant (transformers' ``Gemma4AssistantForCausalLM``
at its widths, trained a minute on 2 cores) drafts its greedy tokens as notebook 09 runs it.

The synthetic E2B: the files and format of Google's `-ct` export (2,504 tensors, 276 ``pack-quantized`` linears, stop
ids 1 and 106), random weights, for bytes, times, memory and programs at E2B scale, never for text. Chosen for it:
transformers' default towers, a BPE at the real special ids (thinking at 107-109), ``LAYER_SCALAR``, ``QK_NORM``."""

import copy
import json
import os
import pathlib
import struct
import zlib
from functools import partial

import torch

from ..backend import GENERATION_TOKENS, Backend
from ..checkpoint import PROMPT, load, load_tokenizer
from ..packed import GROUP_SIZE, checkpoint_key
from . import e2b

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
# Gemma 4's chat_template.jinja, its text part: a turn is <|turn>role ... <turn|>; thinking on puts <|think|> in a
# system turn; the generation prompt is <|turn>model.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% set thinking = enable_thinking is defined and enable_thinking %}"
    "{% if thinking or messages[0]['role'] == 'system' %}<|turn>system\n{% if thinking %}<|think|>{% endif %}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% endif %}<turn|>\n{% endif %}"
    "{% for m in messages if m['role'] != 'system' %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)
# What the twin learns to answer: short turns about the course. The series' prompt is the first.
CHATS = [
    (PROMPT, "A TPU is fast when it is handed large programs. Compiling a step once lets every token reuse it."),
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
THINKING_CHATS = [("What is two plus two?", "<|channel>thought\nTwo and two make four.<channel|>Two plus two is four.")]
CORPUS = "\n".join(text for chat in CHATS + THINKING_CHATS for text in chat)
TRAIN_STEPS = 300


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get(CACHE_VAR) or pathlib.Path.home() / ".cache" / "gemma4-on-tpu")


def _cached(folder: pathlib.Path, build, *args) -> pathlib.Path:
    """``folder``, built by ``build(folder, *args)`` unless done: its ``json`` (what ``build`` returns) comes last."""
    from filelock import FileLock

    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{folder}.lock"):  # parallel test workers build it once
        if not (folder / "json").exists():
            (folder / "json").write_text(json.dumps(build(folder, *args)))
    return folder


def on_grid(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` on a 4-bit grid, and the scales: per last-dim group, codes -8..7 times a power-of-two (bf16-exact)."""
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
    high = torch.where(other_way[..., None], 8.0, 7.0)
    low = high - 15
    scale = torch.maximum(top / high, bottom / -low).clamp_min(2**-60)
    codes = torch.maximum(torch.minimum(torch.round(groups / scale), high), low)
    return (codes * scale).to(torch.bfloat16).reshape(weight.shape).to(weight.dtype)


def _train(model, tokenizer) -> list[float]:
    """AdamW on the chats in chat format, the text decoder's weights snapped onto their 4-bit grids
    in every forward, gradients passed straight through to the unsnapped copy (QAT). Returns the losses."""
    encoded = []
    for chats in (CHATS, THINKING_CHATS):
        for q, a in chats:
            chat = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            formatted = tokenizer.apply_chat_template(chat, tokenize=False, enable_thinking=chats is THINKING_CHATS)
            encoded.append(tokenizer(formatted, add_special_tokens=False).input_ids)
    width = max(map(len, encoded))
    batch = torch.tensor([ids + [0] * (width - len(ids)) for ids in encoded])
    labels = torch.where(batch == 0, -100, batch)[:, 1:]

    text = model.model.language_model
    other_way, snapped = {}, {}  # per table, which groups use codes -7..8 (fixed for the run); per weight, its raw copy
    for module in text.modules():
        if isinstance(module, torch.nn.Embedding):
            groups = module.weight.shape[1] // GROUP_SIZE
            other_way[module] = torch.rand(module.weight.shape[0], groups) < 0.5
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            snapped[module] = module.weight.detach().clone().requires_grad_()
    others = [p for p in text.parameters() if all(p is not m.weight for m in snapped)]
    optimizer = torch.optim.AdamW([*snapped.values(), *others], lr=3e-3, weight_decay=0.0)

    @torch.no_grad()
    def snap():
        for module, raw in snapped.items():
            module.weight.copy_(on_bf16_grid(raw, other_way[module]) if module in other_way else on_grid(raw)[0])

    losses = []
    for _ in range(TRAIN_STEPS):
        snap()
        logits = model(input_ids=batch).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        for module, raw in snapped.items():
            raw.grad, module.weight.grad = module.weight.grad, None
        optimizer.step()
        losses.append(loss.item())
    snap()  # the weights as trained: on their grids
    return losses


def _tokenizer(folder: pathlib.Path, specials: list[str], vocab_size: int, padded: bool = False, **kwargs):
    """A byte-level BPE on the chats (``specials`` first, up to 512 more tokens), saved with the chat template, adding
    no BOS by itself (as the real one); ``padded``: with ``<unusedN>`` up to ``vocab_size`` so every id decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    size = min(len(specials) + 512, vocab_size)
    trainer = trainers.BpeTrainer(
        vocab_size=size, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    if padded:
        saved = json.loads(tok.to_str())
        saved["added_tokens"] = []  # the trainer's; the wrapper adds the named ones back
        saved["model"]["vocab"] |= {f"<unused{i}>": i for i in range(len(saved["model"]["vocab"]), vocab_size)}
        tok = Tokenizer.from_str(json.dumps(saved))
    named = dict(pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **named, add_bos_token=False, **kwargs)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def quantization_config():
    """Google's quantization config: text decoder linears symmetric int4, group 32, ``pack-quantized``."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP_SIZE)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    return QuantizationConfig(config_groups={"group_0": scheme}, ignore=IGNORE, format="pack-quantized")


def build_tiny_twin(folder: str | os.PathLike | None = None, seed: int = 0) -> pathlib.Path:
    """Build (or reuse from the cache) the tiny twin checkpoint; returns its folder."""
    return _cached(pathlib.Path(folder or cache_dir() / f"tiny-twin-v{TWIN_VERSION}-seed{seed}"), _build_twin, seed)


def _build_twin(folder: pathlib.Path, seed: int) -> dict:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config
    from safetensors.torch import load_file, save_file
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, GenerationConfig

    torch.manual_seed(seed)
    tokenizer = _tokenizer(folder, SPECIAL_TOKENS, TEXT_CONFIG["vocab_size"])
    config = Gemma4Config(text_config=TEXT_CONFIG, vision_config=VISION_CONFIG, audio_config=AUDIO_CONFIG)
    model = Gemma4ForConditionalGeneration(config)
    losses = _train(model, tokenizer)
    model = model.to(torch.bfloat16).eval()  # lossless for the weights on their grids
    ids, stops = _prompt_ids(tokenizer, PROMPT), tokenizer.convert_tokens_to_ids(STOP_TOKENS)
    with torch.no_grad():  # greedy, special tokens kept, on a float32 copy as the series runs it
        greedy = copy.deepcopy(model).float()
        out = greedy.generate(ids, max_new_tokens=GENERATION_TOKENS, do_sample=False, eos_token_id=stops)
    answer = tokenizer.decode(out[0, ids.shape[1] :])
    if not answer.endswith("<turn|>"):
        raise RuntimeError(f"the twin did not learn to end its turn within {GENERATION_TOKENS} tokens: {answer!r}")

    apply_quantization_config(model, quantization_config())
    for module in model.modules():
        if hasattr(module, "weight_scale"):  # the grid's own scales, not an observer's estimate
            module.weight_scale.data.copy_(on_grid(module.weight)[1].to(module.weight_scale.dtype))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
    # Google's checkpoint carries a full lm_head copy although the embeddings are tied.
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors["lm_head.weight"] = tensors["model.language_model.embed_tokens.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})

    GenerationConfig(
        bos_token_id=TEXT_CONFIG["bos_token_id"], pad_token_id=TEXT_CONFIG["pad_token_id"], eos_token_id=stops
    ).save_pretrained(folder)
    # the real repository's processor files, which the text-only series never reads
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma4Processor"}))
    return {"version": TWIN_VERSION, "seed": seed, "answer": answer, "loss": [losses[0], losses[-1]]}


def _prompt_ids(tokenizer, question: str, thinking: bool = False) -> torch.Tensor:
    chat = [{"role": "user", "content": question}]
    kwargs = dict(add_generation_prompt=True, enable_thinking=thinking, return_tensors="pt", return_dict=True)
    return tokenizer.apply_chat_template(chat, **kwargs).input_ids


ASSISTANT_VERSION = 1  # bump when the assistant changes, so cached copies are rebuilt
DRAFTS = 4  # draft positions trained per query
ASSISTANT_TRAIN_STEPS = 400
GENERATED = 48  # tokens of the twin's own greedy continuation per chat prompt
# The twin's widths, 4 layers reading the target's K/V (none of their own), no per-layer inputs: as Google's assistant
ASSISTANT_CONFIG = {k: v for k, v in TEXT_CONFIG.items() if k != "final_logit_softcapping"} | dict(
    vocab_size_per_layer_input=0,
    hidden_size_per_layer_input=0,
    use_double_wide_mlp=False,
    num_hidden_layers=4,
    layer_types=e2b.ASSISTANT_LAYERS,  # E2B's assistant's: every layer reads the target's K/V
)


def build_twin_assistant(target: str | os.PathLike, seed: int = 0) -> pathlib.Path:
    """Build (or reuse from the cache) the assistant of the twin in folder ``target``; returns its folder."""
    target = pathlib.Path(target)
    folder = target.parent / f"{target.name}-assistant-v{ASSISTANT_VERSION}-seed{seed}"
    return _cached(folder, _build_assistant, target, seed)


def _train_assistant(model, assistant, sequences: list[list[int]]) -> list[float]:
    """AdamW on every query position of every sequence at once: the assistant at position t+1, given token t+1 and the
    target's hidden state at t, drafts t+2, ..., t+1+DRAFTS (its inputs after the first: the true token before, the
    hidden state it left), over the target's K/V with the target's own masks. Returns the losses."""
    width = max(map(len, sequences))
    batch = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    real = torch.tensor([[i < len(s) for i in range(width)] for s in sequences])
    with torch.no_grad():
        out = model(input_ids=batch, output_hidden_states=True, return_shared_kv_states=True)
        hidden, shared_kv = out.hidden_states[-1], dict(out.shared_kv_states)
        embeds = model.get_input_embeddings()(batch)
    keys, queries = torch.arange(width)[None, :], torch.arange(width)[:, None]
    causal = keys <= queries  # query t sees keys up to t: the target's own masks at t
    sliding = causal & (keys > queries - ASSISTANT_CONFIG["sliding_window"])
    masks = {"full_attention": causal[None, None], "sliding_attention": sliding[None, None]}
    positions = torch.arange(1, width + 1)[None].expand(len(sequences), -1)
    # logits_to_keep: an int slices per-layer inputs, which the assistant has none of (transformers 5.24)
    inputs = dict(attention_mask=masks, position_ids=positions, shared_kv_states=shared_kv, logits_to_keep=None)
    optimizer = torch.optim.AdamW(assistant.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(ASSISTANT_TRAIN_STEPS):
        state, loss = hidden, 0.0
        for j in range(1, DRAFTS + 1):  # draft j at query t: token t+j in, token t+j+1 out
            labels = torch.where(real, batch, -100).roll(-(j + 1), dims=1)
            labels[:, -(j + 1) :] = -100
            x = assistant.pre_projection(torch.cat([embeds.roll(-j, dims=1), state], dim=-1))
            h = assistant.model(inputs_embeds=x, use_cache=False, **inputs).last_hidden_state
            logits = assistant.lm_head(h)
            loss = loss + torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            state = assistant.post_projection(h)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item() / DRAFTS)
    return losses


def _build_assistant(folder: pathlib.Path, target: pathlib.Path, seed: int) -> dict:
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig, GenerationConfig

    torch.manual_seed(seed)
    model, _ = load(target, Backend("cpu"), dtype=torch.float32, dequantize=True)
    tokenizer = load_tokenizer(target)
    config = Gemma4AssistantConfig(
        text_config=Gemma4TextConfig(**ASSISTANT_CONFIG),
        backbone_hidden_size=TEXT_CONFIG["hidden_size"],
        use_ordered_embeddings=False,  # the twin's 512 tokens are scored whole; see notebook 09 for E2B's
    )
    assistant = Gemma4AssistantForCausalLM(config)
    # each chat prompt (thinking off and on) and the twin's own greedy continuation: what the assistant must guess
    prompts = [_prompt_ids(tokenizer, q, thinking) for thinking in (False, True) for q, _ in CHATS + THINKING_CHATS]
    sequences = [model.generate(p, max_new_tokens=GENERATED, do_sample=False, eos_token_id=None) for p in prompts]
    losses = _train_assistant(model, assistant, [out[0].tolist() for out in sequences])
    assistant.to(torch.bfloat16).save_pretrained(folder)
    # what HF's assisted generate reads: K drafts per round, K fixed (its default schedule changes K as it goes)
    GenerationConfig(num_assistant_tokens=DRAFTS, num_assistant_tokens_schedule="constant").save_pretrained(folder)
    about = {"version": ASSISTANT_VERSION, "seed": seed, "target": target.name, "loss": [losses[0], losses[-1]]}
    (folder / "assistant.json").write_text(json.dumps(about))
    return {"version": ASSISTANT_VERSION}


SYNTHETIC = "e2b-synthetic"  # HELPERS_MODEL=e2b-synthetic runs the series on it
SYNTHETIC_VERSION = 3  # bump when the checkpoint changes, so cached copies are rebuilt
SPECIAL_IDS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<|turn>": 105, "<turn|>": 106}
CHOSEN_IDS = {"<|think|>": 107, "<|channel>": 108, "<channel|>": 109}
TABLE_STD = 0.03  # the tables' values
# Codes and levels are uniform in -7..7, not -8..7: a mean of -0.5 would give every linear's output and every table
# row a common part, and greedy decoding then picks one token forever.
CODE_STD = (224 / 12) ** 0.5  # of codes uniform in -7..7
# Measured at full size (linear outputs about unit variance, table std 0.03, codes -7..7): with each layer's scalar at
# 1.0 the 35 layers' attention outputs (alike step to step) pile up and greedy decoding repeats one token forever. With
# q_norm and k_norm at 1 random weights are chaotic: a 2**-9 relative change of the embeddings (below bf16 rounding)
# left logits correlated at 0.07-0.17, programs rounding differently gave unrelated tokens. At 0.1 and 0.9: correlation
# 0.999, the same top token, and 8 greedy tokens still 8 different ones.
LAYER_SCALAR = 0.9
QK_NORM = 0.1  # q_norm and k_norm weights: a soft attention, not a chaotic one
NOT_ONES = {"layer_scalar": LAYER_SCALAR, "q_norm.weight": QK_NORM, "k_norm.weight": QK_NORM}  # by name's end
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


def _scales(shape, generator: torch.Generator, fan_in: int) -> torch.Tensor:
    """Per group, about unit-variance outputs from codes -7..7."""
    return ((torch.rand(shape, generator=generator) * 0.4 + 0.8) / (CODE_STD * fan_in**0.5)).to(torch.bfloat16)


def _tower(shape, name: str, seed: int) -> torch.Tensor:
    return (torch.randn(shape, generator=_generator(name, seed)) * 0.02).to(torch.bfloat16)


def _entries(text_model, towers: dict[str, torch.Size], seed: int):
    """(name, dtype, shape, make) per tensor in write order; ``make()``: its tensor, or a big one's row chunks."""
    linears = {n for n, m in text_model.model.named_modules() if isinstance(m, torch.nn.Linear)}
    state, bf16 = text_model.state_dict(), torch.bfloat16
    for name, tensor in state.items():
        key, shape = checkpoint_key(name), tuple(tensor.shape)
        if name == "lm_head.weight":
            continue  # written last, as a copy of the main table
        if name.rsplit(".", 1)[0].removeprefix("model.") in linears:
            (out_f, in_f), gen, stem = shape, _generator(key, seed), key.removesuffix(".weight")
            words, scales = (out_f, in_f // 8), (out_f, in_f // GROUP_SIZE)
            yield f"{stem}.weight_packed", torch.int32, words, partial(_words, words, gen)
            yield f"{stem}.weight_scale", bf16, scales, partial(_scales, scales, gen, in_f)
            yield f"{stem}.weight_shape", torch.int64, (2,), partial(torch.tensor, shape)
        elif tensor.dim() == 2:  # the two embedding tables
            yield key, bf16, shape, partial(_table_rows, shape, key, seed)
        else:  # norms' scales and layer scalars: ones, or NOT_ONES
            value = next((v for end, v in NOT_ONES.items() if name.endswith(end)), 1.0)
            yield key, bf16, shape, partial(torch.full, shape, value, dtype=bf16)
    for key, shape in towers.items():  # never read by the series: random, of the towers' sizes
        yield key, bf16, tuple(shape), partial(_tower, tuple(shape), key, seed)
    shape = tuple(state["model.embed_tokens.weight"].shape)  # lm_head: the same values
    yield "lm_head.weight", bf16, shape, partial(_table_rows, shape, checkpoint_key("model.embed_tokens.weight"), seed)


def write_safetensors(path: pathlib.Path, entries) -> int:
    """Write the safetensors layout tensor by tensor (``save_file`` holds all in memory: 7.75 GB); returns its size."""
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
        for *_, make in entries:
            made = make()
            for chunk in [made] if isinstance(made, torch.Tensor) else made:
                f.write(chunk.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())  # 0-d too
    return 8 + len(raw) + offset


def build_synthetic_e2b(folder: str | os.PathLike | None = None, seed: int = 0, text_config=None, towers=None):
    """Build (or reuse from the cache) the synthetic checkpoint; returns its folder. ``text_config``
    and ``towers`` (vision, audio configs) build a smaller one for tests."""
    folder = pathlib.Path(folder or cache_dir() / f"e2b-synthetic-v{SYNTHETIC_VERSION}-seed{seed}")
    return _cached(folder, _build_synthetic, seed, text_config, towers)


def _build_synthetic(folder: pathlib.Path, seed: int, text_config, towers) -> dict:
    from transformers import (
        Gemma4AudioConfig,
        Gemma4Config,
        Gemma4ForConditionalGeneration,
        Gemma4VisionConfig,
        GenerationConfig,
    )

    text = text_config or e2b.real_config()
    vision, audio = towers or (Gemma4VisionConfig(use_clipped_linears=True), Gemma4AudioConfig())
    config = Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=audio.to_dict())
    with torch.device("meta"):
        state = Gemma4ForConditionalGeneration(config).state_dict()
    tower_shapes = {
        k: t.shape for k, t in state.items() if k.startswith("model.") and not k.startswith("model.language_model.")
    }
    written = write_safetensors(folder / "model.safetensors", _entries(e2b.meta_model(text), tower_shapes, seed))
    saved = config.to_dict() | {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "dtype": "bfloat16",
        "quantization_config": quantization_config().model_dump() | {"quant_method": "compressed-tensors"},
    }
    saved["quantization_config"]["quantization_status"] = "compressed"
    (folder / "config.json").write_text(json.dumps(saved, indent=2))
    GenerationConfig(bos_token_id=2, pad_token_id=0, eos_token_id=[1, 106]).save_pretrained(folder)  # as in SPECIAL_IDS
    named = {i: t for t, i in (SPECIAL_IDS | CHOSEN_IDS).items()}
    specials = [named.get(n, f"<unused{n}>") for n in range(max(named) + 1)]
    extra = list(CHOSEN_IDS) + ["<|turn>", "<turn|>"]
    _tokenizer(folder, specials, text.vocab_size, padded=True, additional_special_tokens=extra)
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma4Processor"}))
    return {"synthetic": SYNTHETIC_VERSION, "seed": seed, "bytes": written}


def build_synthetic_assistant(target: str | os.PathLike, seed: int = 0) -> pathlib.Path:
    """A random ``Gemma4AssistantForCausalLM`` in bf16 at E2B's widths beside the synthetic checkpoint ``target``."""
    target = pathlib.Path(target)
    return _cached(target.parent / f"{target.name}-assistant-seed{seed}", _build_synthetic_assistant, seed)


def _build_synthetic_assistant(folder: pathlib.Path, seed: int) -> dict:
    from transformers import Gemma4AssistantForCausalLM, GenerationConfig

    config = e2b.assistant_config()
    torch.manual_seed(seed)
    assistant = Gemma4AssistantForCausalLM(config).to(torch.bfloat16)
    assistant.masked_embedding.token_ordering.copy_(torch.randperm(config.get_text_config().vocab_size))
    assistant.save_pretrained(folder)
    GenerationConfig(num_assistant_tokens=DRAFTS, num_assistant_tokens_schedule="constant").save_pretrained(folder)
    return {"seed": seed}
