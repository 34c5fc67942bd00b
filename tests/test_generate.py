"""The baseline: greedy HF generate, per-step timing, measurement, reference tokens, the xla trap."""

import pytest

from conftest import needs_xla
from helpers import checkpoint as ck
from helpers import generate as g
from helpers.course import measure, offline, series, verdict


@pytest.fixture(scope="module")
def setup():
    import helpers

    backend = helpers.get_backend()
    checkpoint, model, tokenizer, ids = series.load_for_series(backend)
    return backend, checkpoint, model, tokenizer, ids


def test_generates_exactly_the_asked_number_of_tokens_with_a_step_time_each(setup):
    backend, _, model, tokenizer, ids = setup
    tokens, streamer, out = g.generate(model, tokenizer, ids, backend, 5, stop=False)
    assert len(tokens) == 5 and len(streamer.step_seconds) == 5 and all(s > 0 for s in streamer.step_seconds)
    assert out.sequences.shape[1] == ids.shape[1] + 5
    assert type(out.past_key_values).__name__ == "DynamicCache"


def test_greedy_config_stops_at_the_models_stop_ids_or_explicitly_never(setup):
    _, _, model, tokenizer, _ = setup
    stops = tokenizer.convert_tokens_to_ids(["<eos>", "<turn|>"])
    assert g.stop_ids(model) == stops  # generation_config.json's list, as the real checkpoint has
    config = g.greedy_config(model, 7)
    assert config.eos_token_id == stops and config.max_new_tokens == 7 and config.do_sample is False
    assert g.greedy_config(model, 7, stop=False).eos_token_id == []
    assert model.generation_config.eos_token_id == stops  # left alone


SHORT_ANSWER = "What is the capital of France?"  # the twin answers in a few tokens, then ends its turn


def test_generate_stops_at_the_end_of_turn_and_the_exact_count_mode_does_not(setup):
    backend, _, model, tokenizer, _ = setup
    ids = ck.chat_ids(tokenizer, backend.device, prompt=SHORT_ANSWER)
    stopped, _, _ = g.generate(model, tokenizer, ids, backend, 10)
    assert len(stopped) < 10 and stopped[-1] == tokenizer.convert_tokens_to_ids("<turn|>")
    assert tokenizer.decode(stopped, skip_special_tokens=True) == "Paris is the capital of France."
    exact, _, _ = g.generate(model, tokenizer, ids, backend, 10, stop=False)
    assert len(exact) == 10 and exact[: len(stopped)] == stopped
    assert g.until_stop(exact, g.stop_ids(model)) == stopped
    assert verdict.greedy_tokens(model, ids, 10) == stopped


def test_measure_reports_medians_and_the_same_tokens(setup):
    backend, _, model, tokenizer, ids = setup
    tokens, _, _ = g.generate(model, tokenizer, ids, backend, 4)
    measured = measure.measure(model, tokenizer, ids, backend, 4, repeats=2, warmup=1)
    # equal lists: generate's eager forward, the same program on the same inputs each run
    assert measured["tokens"] == tokens and measured["prefill_s"] > 0 and measured["decode_tok_s"] > 0


def test_reference_tokens_round_trip_and_a_fresh_load_reproduces_them(setup, tmp_path):
    backend, checkpoint, model, tokenizer, ids = setup
    n = backend.generation_length
    tokens, _, _ = g.generate(model, tokenizer, ids, backend, n)
    series.save_reference(checkpoint, backend, ids, n, tokens, tmp_path)
    _, fresh, _, _ = series.load_for_series(backend)
    again, _, _ = g.generate(fresh, tokenizer, ids, backend, n)
    assert again == series.load_reference(checkpoint, backend, ids, n, tmp_path)


def test_a_reference_for_another_length_or_prompt_is_refused(setup, tmp_path):
    backend, checkpoint, model, tokenizer, ids = setup
    series.save_reference(checkpoint, backend, ids, 3, [1, 2, 3], tmp_path)
    with pytest.raises(LookupError, match="run notebook 03 first"):
        series.load_reference(checkpoint, backend, ids, 4, tmp_path)
    other = ck.encode(tokenizer, "another prompt", backend.device)
    with pytest.raises(LookupError, match="3 tokens"):  # the message lists what was saved
        series.load_reference(checkpoint, backend, other, 3, tmp_path)


def test_short_prompts_fail_with_hf_sliding_cache_only_on_xla_and_static_cache_works(setup):
    backend, _, model, tokenizer, _ = setup
    short = ck.encode(tokenizer, "Paris", backend.device)
    assert short.shape[1] < model.config.sliding_window - 1
    if backend.lazy:  # PyTorch/XLA
        with pytest.raises(RuntimeError, match="Value out of range"):
            g.generate(model, tokenizer, short, backend, 2)
    else:
        assert len(g.generate(model, tokenizer, short, backend, 2)[0]) == 2
    tokens, _, out = g.generate(model, tokenizer, short, backend, 2, cache_implementation="static")
    assert len(tokens) == 2 and type(out.past_key_values).__name__ == "StaticCache"


@needs_xla
def test_defer_and_fuse_compiles_every_step_of_a_first_call_and_none_of_a_second():
    import helpers

    backend = helpers.get_backend("xla")
    _, model, tokenizer, _ = series.load_for_series(backend)
    # lengths no other test in this process generated: XLA keeps compiled programs per process
    ids = ck.chat_ids(tokenizer, backend.device, prompt=offline.PROMPT * 4)
    calls = measure.first_and_second_call(model, tokenizer, ids, backend, 4)
    fused = calls["defer_and_fuse"]
    assert all(p > 0 for p in fused["programs_first"]) and sum(fused["programs_second"]) == 0
    assert verdict.compare_tokens(fused["tokens"], calls["eager"]["tokens"], model, ids)  # two programs: the verdict
