"""The notebooks' two widgets, driven as a reader drives them, on whatever ipywidgets is installed:
8.x here, and Colab's own 7.7.1 in CI (`.ci/run` runs this file again with it first on the path).
Only the API both versions share is used. No model: a stand-in chat streams fixed tokens."""

import ipywidgets
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import helpers
from helpers import generate as g
from helpers.course import report

WORDS = ["<pad>", "the", "ring", "cache", "keeps", "one", "window"]


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {w: i for i, w in enumerate(WORDS)}
    fast = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    fast.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=fast, pad_token="<pad>")


def _stream(streamer, ids):
    streamer.put(torch.tensor([[1]]))  # the prompt, skipped
    for i in ids:
        streamer.put(torch.tensor([i]))
    streamer.end()


def test_the_streamer_writes_its_text_and_rate_into_the_text_widget(tokenizer):
    print("ipywidgets", ipywidgets.__version__)
    widget = report.text_widget()
    streamer = g.StepStreamer(tokenizer, helpers.get_backend("cpu"), widget)
    _stream(streamer, [1, 2, 3, 4, 5, 6])
    assert "the ring cache keeps one window" in widget.value and "tok/s" in widget.value


class StandInChat:
    """What ``chat_widget`` reads of a ``Chat``: its tokenizer, the decoder's backend, ``say``
    (streaming the reply) and ``status``; a turn past the context is refused as ``Chat`` refuses."""

    def __init__(self, tokenizer):
        self.tokenizer, self.turns = tokenizer, 0
        self.decoder = type("Decoder", (), {"backend": helpers.get_backend("cpu")})()

    def say(self, text, streamer=None):
        if len(text) > 100:
            raise ValueError("this turn would pass the full layers' buffer of 256 positions")
        self.turns += 1
        _stream(streamer, [1, 2, 3])
        return streamer.text

    def status(self):
        return {"context": 10 * self.turns, "max_len": 256, "cache_bytes": 2048}


def test_the_chat_widget_takes_enter_and_the_button_and_says_a_refusal(tokenizer):
    chat = StandInChat(tokenizer)
    ui = report.chat_widget(chat)
    log, live, (box, send) = ui.children[0], ui.children[1], ui.children[2].children
    box.value = "hello"  # Enter in the text box
    assert "<b>you:</b> hello" in log.value and "the ring cache" in log.value and "context 10 of 256" in log.value
    assert box.value == "" and live.value == "" and not box.disabled
    send.click()  # the button on an emptied box sends nothing
    ui.submit("again")  # the scripted way
    assert chat.turns == 2 and log.value.count("<b>you:</b>") == 2
    ui.submit("word " * 30)  # a refusal is shown in the widget, nothing raised
    assert "pass the full layers" in live.value and chat.turns == 2
