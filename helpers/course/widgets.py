"""The notebooks' widgets (ipywidgets): the streamer's text box, and the chat."""

from __future__ import annotations

import html

import ipywidgets
from IPython.display import display

from ..chat import Chat
from ..generate import StepStreamer
from .tables import fmt_bytes


def text_widget():
    """An ipywidgets HTML box, shown in the notebook, for ``StepStreamer`` to write into."""
    widget = ipywidgets.HTML()
    display(widget)
    return widget


def chat_widget(chat: Chat):
    """An ipywidgets chat on ``chat``: the reply streams in with live tok/s, then the context and
    cache bytes. The widget's ``submit(text)`` sends a message as the button does (for scripts)."""
    w = ipywidgets

    log, live = w.HTML(), w.HTML()
    box = w.Text(placeholder="a message, then Enter", continuous_update=False, layout=w.Layout(width="70%"))
    send = w.Button(description="Send")

    def submit(text: str) -> None:
        text = text.strip()
        if not text:
            return
        box.disabled = send.disabled = True
        try:
            streamer = StepStreamer(chat.tokenizer, chat.decoder.backend, widget=live)
            reply = chat.say(text, streamer)
            status = chat.status()
            rate = f"{streamer.tok_s:.1f} tok/s · " if streamer.tok_s else ""
            log.value += (
                f"<p><b>you:</b> {html.escape(text)}<br><b>model:</b> {html.escape(reply)}<br><small>{rate}"
                f"context {status['context']} of {status['max_len']} positions · cache "
                f"{fmt_bytes(status['cache_bytes'])}</small></p>"
            )
            live.value = ""
        except ValueError as err:  # the conversation would pass the cache: said, not raised into the widget
            live.value = f"<b>{html.escape(str(err))}</b>"
        finally:
            box.disabled = send.disabled = False

    def on_enter(change):
        if change["new"]:
            box.value = ""  # fires again with "", which submit ignores
            submit(change["new"])

    box.observe(on_enter, "value")
    send.on_click(lambda _: on_enter({"new": box.value}))
    ui = w.VBox([log, live, w.HBox([box, send])])
    ui.submit = submit
    display(ui)
    return ui
