"""The twin's assistant: transformers' ``Gemma4AssistantForCausalLM`` at the twin's widths, trained offline (seeded,
cached, about a minute on 2 cores) to draft the twin's own greedy tokens from its hidden states and K/V, as notebook
09 runs it: K drafts at one position, each fed the last draft and the hidden state the one before left."""

from __future__ import annotations

import json
import os
import pathlib

import torch

from ..backend import Backend
from ..checkpoint import load, load_tokenizer
from . import twin

ASSISTANT_VERSION = 1  # bump when the assistant changes, so cached copies are rebuilt
DRAFTS = 4  # draft positions trained per query
TRAIN_STEPS = 400
GENERATED = 48  # tokens of the twin's own greedy continuation per chat prompt

TEXT_CONFIG = dict(  # 4 layers, every one reading the target's K/V (none of its own), as Google's assistant
    vocab_size=twin.TEXT_CONFIG["vocab_size"],
    vocab_size_per_layer_input=0,
    hidden_size=64,
    hidden_size_per_layer_input=0,
    intermediate_size=128,
    use_double_wide_mlp=False,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=twin.TEXT_CONFIG["head_dim"],
    global_head_dim=twin.TEXT_CONFIG["global_head_dim"],
    num_kv_shared_layers=4,
    sliding_window=twin.TEXT_CONFIG["sliding_window"],
    layer_types=["sliding_attention"] * 3 + ["full_attention"],
    max_position_embeddings=twin.TEXT_CONFIG["max_position_embeddings"],
    tie_word_embeddings=True,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)


def build_twin_assistant(target: str | os.PathLike, seed: int = 0) -> pathlib.Path:
    """Build (or reuse from the cache) the assistant of the twin in folder ``target``; returns its folder."""
    target = pathlib.Path(target)
    folder = target.parent / f"{target.name}-assistant-v{ASSISTANT_VERSION}-seed{seed}"
    with twin.building(folder) as done:
        if not done:
            _build(folder, target, seed)
    return folder


def _sequences(model, tokenizer) -> list[list[int]]:
    """Each chat prompt (thinking off and on) and the twin's own greedy continuation: what the assistant must guess."""
    sequences = []
    for thinking in (False, True):
        for question, _ in twin.CHATS + twin.THINKING_CHATS:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": question}],
                add_generation_prompt=True,
                enable_thinking=thinking,
                return_tensors="pt",
                return_dict=True,
            ).input_ids
            out = model.generate(ids, max_new_tokens=GENERATED, do_sample=False, eos_token_id=None)
            sequences.append(out[0].tolist())
    return sequences


def _train(model, assistant, sequences: list[list[int]], steps: int = TRAIN_STEPS) -> list[float]:
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
    queries = torch.arange(width)
    window = TEXT_CONFIG["sliding_window"]
    causal = queries[None, :] <= queries[:, None]  # query t sees keys up to t: the target's own masks at t
    masks = {
        "full_attention": causal[None, None],
        "sliding_attention": (causal & (queries[None, :] > queries[:, None] - window))[None, None],
    }
    positions = (queries + 1)[None].expand(len(sequences), -1)
    optimizer = torch.optim.AdamW(assistant.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        state, loss = hidden, 0.0
        for j in range(1, DRAFTS + 1):  # draft j at query t: token t+j in, token t+j+1 out
            labels = torch.where(real, batch, -100).roll(-(j + 1), dims=1)
            labels[:, -(j + 1) :] = -100
            x = assistant.pre_projection(torch.cat([embeds.roll(-j, dims=1), state], dim=-1))
            h = assistant.model(
                inputs_embeds=x,
                attention_mask=masks,
                position_ids=positions,
                shared_kv_states=shared_kv,
                use_cache=False,
                logits_to_keep=None,  # an int slices per-layer inputs, which the assistant has none of (transformers 5.24)
            ).last_hidden_state
            logits = assistant.lm_head(h)
            loss = loss + torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            state = assistant.post_projection(h)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item() / DRAFTS)
    return losses


def _build(folder: pathlib.Path, target: pathlib.Path, seed: int) -> None:
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig, GenerationConfig

    torch.manual_seed(seed)
    model, _ = load(target, Backend("cpu"), dtype=torch.float32, dequantize=True)
    tokenizer = load_tokenizer(target)
    config = Gemma4AssistantConfig(
        text_config=Gemma4TextConfig(**TEXT_CONFIG),
        backbone_hidden_size=twin.TEXT_CONFIG["hidden_size"],
        use_ordered_embeddings=False,  # the twin's 512 tokens are scored whole; see notebook 09 for E2B's
    )
    assistant = Gemma4AssistantForCausalLM(config)
    losses = _train(model, assistant, _sequences(model, tokenizer))
    folder.mkdir(parents=True, exist_ok=True)
    assistant.to(torch.bfloat16).save_pretrained(folder)
    # what HF's assisted generate reads: K drafts per round, K fixed (its default schedule changes K as it goes)
    GenerationConfig(num_assistant_tokens=DRAFTS, num_assistant_tokens_schedule="constant").save_pretrained(folder)
    (folder / "assistant.json").write_text(
        json.dumps({"version": ASSISTANT_VERSION, "seed": seed, "target": target.name, "loss": [losses[0], losses[-1]]})
    )
    (folder / "twin.json").write_text(json.dumps({"version": ASSISTANT_VERSION}))  # written last: the build is done
