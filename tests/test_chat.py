"""The ring cache inside transformers' generate, and a chat that keeps its cache across turns."""

import pytest
import torch

import helpers
from helpers import chat as c
from helpers import generate as g
from helpers import ring
from helpers.course import measure, report, verdict

TURNS = ["Explain why compilation matters on a TPU, in two sentences.", "And on a GPU?"]


@pytest.fixture(scope="module")
def series():
    return helpers.course.series.prepare(helpers.get_backend(), after=5)


def test_generate_with_the_ring_cache_gives_its_default_caches_tokens_past_the_window(series):
    model, n = series.model, 12
    window = model.config.sliding_window
    prompt = torch.randint(3, model.config.vocab_size, (1, 3 * window + 5), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(series.ids.device)
    default, _, _ = g.generate(model, series.tokenizer, prompt, helpers.get_backend(), n, stop=False)
    tokens, cache, graphs = measure.generate_on_ring(model, prompt, helpers.get_backend(), n, max_len=128)
    assert verdict.compare_tokens(tokens, default, series.reference_model(), prompt) and graphs is None
    assert cache.get_seq_length() == prompt.shape[1] + n - 1  # the last token is made, not yet fed
    assert sorted(cache.slot_positions.tolist()) == list(
        range(prompt.shape[1] + n - 1 - window, prompt.shape[1] + n - 1)
    )


def test_generate_on_the_ring_samples_the_default_caches_tokens_with_a_streamer_and_stop_strings(series):
    """Any generation config through the public context manager: sampled, streamed, stopped by a
    string. The same seed gives the default cache's draws: both programs give the same
    probabilities up to float32 rounding (~1e-7), which moves a draw only when it falls within that
    of a boundary between two tokens' shares."""
    model, tokenizer, backend = series.model, series.tokenizer, helpers.get_backend()
    window = model.config.sliding_window
    prompt = torch.randint(3, model.config.vocab_size, (1, 2 * window + 3), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(series.ids.device)
    settings = dict(do_sample=True, temperature=1.3, top_k=40, max_new_tokens=20, min_new_tokens=20, eos_token_id=[])
    runs = {}
    for name in ("default", "ring"):
        streamer = g.StepStreamer(tokenizer, backend)
        torch.manual_seed(7)
        if name == "ring":
            cache = ring.RingCache(model, 128, window)
            with ring.inside_generate(model):
                out = model.generate(prompt, cache=cache, streamer=streamer, **settings)
        else:
            out = model.generate(prompt, streamer=streamer, **settings)
        runs[name] = out[0, prompt.shape[1] :].tolist(), streamer.text
    assert runs["ring"] == runs["default"] and len(runs["ring"][0]) == 20
    assert len(set(runs["ring"][0])) > 3  # sampled at temperature 1.3, not a greedy loop
    stop = tokenizer.decode(runs["ring"][0][8:10])
    torch.manual_seed(7)
    with ring.inside_generate(model):
        cut = model.generate(
            prompt, cache=ring.RingCache(model, 128, window), stop_strings=[stop], tokenizer=tokenizer, **settings
        )
    assert stop in tokenizer.decode(cut[0, prompt.shape[1] :]) and cut.shape[1] - prompt.shape[1] <= 10


def test_a_ring_cache_given_to_generate_without_the_hooks_says_which_way_to_go(series):
    model = series.model
    with pytest.raises(ValueError, match="inside `with helpers.ring.inside_generate\\(model\\):`"):
        model.generate(series.ids, cache=ring.RingCache(model, 128, model.config.sliding_window), max_new_tokens=2)


def test_generates_compiled_forward_drives_the_ring_without_a_recompile_per_token(series):
    backend = helpers.get_backend()
    if not backend.runs_compiled_generate:  # refused up front (xla), not a crash of the process
        with pytest.raises(NotImplementedError, match="use RingDecoder.generate"):
            measure.generate_on_ring(series.model, series.ids, backend, 10, max_len=128, compiled=True)
        return
    torch.compiler.reset()
    eager, _, _ = measure.generate_on_ring(series.model, series.ids, backend, 10, max_len=128)
    tokens, _, graphs = measure.generate_on_ring(series.model, series.ids, backend, 10, max_len=128, compiled=True)
    assert verdict.compare_tokens(tokens, eager, series.reference_model(), series.ids)
    assert graphs[:2] == [1, 1] and sum(graphs[2:]) == 0  # the prefill, the first step, then none


@pytest.fixture(scope="module")
def conversation(series):
    decoder = ring.RingDecoder(series.model, helpers.get_backend(), max_len=256, chunk_size=16)
    chat = c.Chat(decoder, series.tokenizer, max_new_tokens=10)
    return chat, [chat.say(text) for text in TURNS]


def test_turn_two_equals_the_whole_conversation_as_one_prompt_with_no_cache(conversation, series):
    chat, answers = conversation
    first = chat.replies[0]  # turn 1 is the series' prompt: notebook 03's answer, as far as both go
    assert verdict.compare_tokens(first, series.reference[: len(first)], series.reference_model(), series.ids)
    history = chat.tokens[: len(chat.tokens) - len(chat.replies[1])]
    config = g.greedy_config(series.model, 10)
    config.use_cache = False
    with torch.no_grad():
        out = series.model.generate(torch.tensor([history], device=series.ids.device), generation_config=config)
    history_ids = torch.tensor([history])
    expected = out.sequences[0, len(history) :].tolist()
    assert verdict.compare_tokens(chat.replies[1], expected, series.reference_model(), history_ids)
    assert answers[1] == series.tokenizer.decode(chat.replies[1], skip_special_tokens=True)
    text = series.tokenizer.decode(history)
    assert text.count("<|turn>user") == 2 and TURNS[1] in text


def test_each_turn_goes_in_after_the_cache_and_a_too_long_one_is_refused(conversation):
    chat, _ = conversation
    status = chat.status()
    assert status["context"] == len(chat.tokens) and status["cache_bytes"] > 0
    assert chat.turn_ids("x")[0] != chat.tokenizer.bos_token_id  # no second BOS: the history is not sent again
    with pytest.raises(ValueError, match="past the full layers' buffer of 256"):
        chat.say("word " * 300)
    with pytest.raises(ValueError, match="spare slots for 16 tokens past a reply's stop"):
        c.Chat(chat.decoder, chat.tokenizer, readback_every=17)
    assert chat.status() == status  # refused before anything changed


def test_the_chat_widget_streams_a_scripted_turn(conversation, series):
    pytest.importorskip("ipywidgets")
    # a new chat, the cache started over; read back every 2 tokens, so the rate after the first block shows
    chat = c.Chat(conversation[0].decoder, series.tokenizer, max_new_tokens=6, readback_every=2)
    ui = report.chat_widget(chat)
    ui.submit(TURNS[0])
    log, live = ui.children[0].value, ui.children[1].value
    assert "tok/s" in log and "context" in log and chat.messages[1]["content"] in log and live == ""
    ui.submit("word " * 300)  # past the 256 positions: said in the widget, nothing raised
    assert "past the full layers" in ui.children[1].value and len(chat.replies) == 1
