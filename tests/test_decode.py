"""The compiled decode step: wrapper stripping, one compile, no recompiles, buckets, readback."""

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

from helpers import checkpoint as ck
from helpers import decode as d
from helpers import generate as g
from helpers import roofline
from helpers.course import hub, measure, offline, verdict


@pytest.fixture(scope="module")
def setup():
    import helpers

    backend = helpers.get_backend()
    series = helpers.course.series.prepare(backend, after=4)  # HF generate's reference, then stripped
    model, tokenizer, ids, n = series.model, series.tokenizer, series.ids, series.new_tokens
    torch.compiler.reset()
    decoder = d.Decoder(model, backend, max_len=128)
    with backend.compile_counter() as count:
        tokens = decoder.generate(ids, n)
    return backend, model, tokenizer, ids, series, decoder, tokens, count


def test_a_prefill_runs_the_layers_that_keep_no_kv_and_the_head_on_its_last_real_row_alone(setup):
    """transformers' cut before the first KV-sharing layer, taken at the padded prompt's last real row: every matmul of
    those layers, and the head's, on that one row; every other on all the rows (the static bucket, the ring's chunk).
    The tokens are checked above and in test_ring."""
    from conftest import linear_rows
    from helpers import ring

    backend, model, _, ids, _, decoder, _, _ = setup
    config = model.config.get_text_config()
    cut = [*model.model.layers[config.num_hidden_layers - config.num_kv_shared_layers :], model.lm_head]
    last = torch.tensor([ids.shape[1] - 1], device=ids.device)
    bucket = decoder.bucket(ids.shape[1])
    padded = torch.zeros(1, bucket, dtype=ids.dtype, device=ids.device)
    padded[:, : ids.shape[1]] = ids
    ringed = ring.RingDecoder(model, backend, max_len=128)
    (_, positions, valid), *_ = ringed.chunks(ids.shape[1], ids.device)
    chunk = ringed.chunk_size
    chunk_last = torch.tensor([min(ids.shape[1], chunk) - 1], device=ids.device)  # the first chunk's last real row
    for rows, every in (
        (linear_rows(decoder.prefill_forward, padded, last, within=cut), bucket),
        (
            linear_rows(ringed.prefill_forward, padded[:, :chunk], positions, valid, chunk_last, within=cut),
            chunk,
        ),
    ):
        assert {(1, True), (every, False)} == set(rows), set(rows)
        assert sum(inside for _, inside in rows) == 1 + config.num_kv_shared_layers * 7  # q, o, 3 MLP, 2 per-layer


def test_prompts_of_five_more_lengths_in_one_bucket_run_the_programs_the_first_compiled(setup):
    """Notebook 04's bucket and notebook 06's chunks: each padded prompt and its lengths made on the host and copied, so
    a new prompt length compiles nothing, eager programs included (counted by the backend: XLA's compile counters)."""
    from helpers import ring

    backend, model, _, ids, _, decoder, _, _ = setup
    bucket = decoder.bucket(ids.shape[1])
    lengths = range(bucket // 2 + 1, bucket // 2 + 8)  # one bucket, and two of the ring's chunks, for all seven
    long = ids.cpu().repeat(1, 4)  # prompts made on the host, as a tokenizer makes them
    for each in (decoder, ring.RingDecoder(model, backend, max_len=128)):
        for n in lengths[:2]:  # compiles its programs, eager ones included (on xla, once more on a written cache)
            each.generate(long[:, :n].to(backend.device), 3, stop_ids=())
        with backend.compile_counter() as count:
            for n in lengths[2:]:
                each.generate(long[:, :n].to(backend.device), 3, stop_ids=())
        assert count.graphs == 0 and count.programs in (None, 0), (type(each).__name__, count)


def test_the_passes_a_step_makes_over_its_cache_from_two_cache_lengths(setup):
    """Notebook 04's test of the hypothesis for a TPU, run here for its arithmetic (a CPU's times are noise at the
    twin's size): the step at two cache lengths, the extra cache bytes those lengths hold."""
    backend, model, _, ids, _, _, _, _ = setup
    passes = measure.cache_passes(model, ids, backend, (64, 256), repeats=2)
    assert passes["cache_bytes"][1] == 4 * passes["cache_bytes"][0] and len(passes["step_s"]) == 2
    assert passes["passes"] == pytest.approx(
        (passes["step_s"][1] - passes["step_s"][0])
        * measure.read_bandwidth(backend)[0]
        / (passes["cache_bytes"][1] - passes["cache_bytes"][0])
    )


def test_stripping_leaves_nothing_of_compressed_tensors_and_the_same_outputs(backend):
    checkpoint = hub.choose_checkpoint(backend)
    if not verdict.unpack_is_exact(backend.device):
        pytest.skip("the default path cannot be checked where unpacking on the device is wrong")
    model, _ = ck.load(checkpoint.path, backend, dtype=torch.float32)  # still packed: stripping decompresses it
    dense, _ = ck.load(checkpoint.path, backend, dtype=torch.float32, dequantize=True)
    removed = d.strip_compressed_wrappers(model)
    assert removed["decompressed now"] and removed["wrapped forwards left"] == 0
    report = {r["what"]: r["count"] for r in ck.compression_report(model)}
    assert report["modules with a wrapped forward"] == 0 and report["modules with forward hooks"] == 0
    assert not any(hasattr(m, "weight_scale") or hasattr(m, "quantization_scheme") for m in model.modules())
    ids = torch.tensor([[2, 7, 9, 11]], device=backend.device)
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, use_cache=False).logits, dense(ids, use_cache=False).logits, rtol=0, atol=0
        )


def test_one_prefill_and_one_step_compile_and_the_tokens_are_generates(setup):
    _, _, _, _, series, _, tokens, count = setup
    assert series.same_tokens(tokens) and count.graphs == 2


def test_timed_runs_make_their_count_past_the_stop_and_give_the_reference_up_to_it(setup):
    backend, _, _, ids, series, decoder, tokens, _ = setup
    length = decoder.max_len - decoder.bucket(ids.shape[1])  # longer than the reply: the stop is ignored
    assert length > len(series.reference)
    with backend.compile_counter() as count:
        run = measure.timed_generate(decoder, ids, length, readback_every=16, repeats=2)
    assert run["tokens"] == tokens  # equal lists: the same compiled programs on the same inputs
    assert series.same_tokens(run["tokens"]) and len(run["rates"]) == 2 and count.graphs == 0


def test_no_recompile_far_past_the_window_and_for_other_prompts_in_the_bucket(setup):
    backend, model, tokenizer, ids, _, decoder, _, _ = setup
    long_run = decoder.max_len - decoder.bucket(ids.shape[1])
    assert ids.shape[1] + long_run > 4 * model.config.sliding_window
    others = [
        ck.chat_ids(tokenizer, backend.device, prompt=p)
        for p in ("Why do shapes matter?", "What does a ring buffer keep?")
    ]
    assert all(decoder.bucket(o.shape[1]) == decoder.bucket(ids.shape[1]) for o in others)
    with backend.compile_counter() as count, measure.no_recompiles():
        assert len(decoder.generate(ids, long_run, stop_ids=())) == long_run  # past the end of turn, exactly
        for other in others:
            tokens = decoder.generate(other, 4)
            assert verdict.compare_tokens(tokens, g.generate(model, tokenizer, other, backend, 4)[0], model, other)
    assert count.graphs == 0


def test_the_guard_fails_loudly_on_a_recompile(setup):
    backend, _, tokenizer, _, _, decoder, _, _ = setup
    longer = ck.chat_ids(tokenizer, backend.device, prompt=offline.PROMPT * 3)  # a bigger prefill bucket
    assert decoder.bucket(longer.shape[1]) > 32
    with pytest.raises(Exception, match="[Rr]ecompil"), measure.no_recompiles():
        decoder.generate(longer, 2)


class Chunks(BaseStreamer):
    """A transformers streamer that keeps what it is given: the prompt, then each chunk."""

    def __init__(self):
        self.seen = []

    def put(self, value):
        self.seen.append(value.flatten().tolist())

    def end(self):
        pass


@pytest.mark.parametrize("every", [1, 3, 16])
def test_chunked_readback_gives_the_same_tokens_in_chunks(setup, every):
    _, _, _, ids, _, decoder, first, _ = setup
    streamer = Chunks()
    tokens = decoder.generate(ids, len(first), readback_every=every, streamer=streamer)
    prompt, *chunks = streamer.seen
    assert tokens == first and prompt == ids[0].tolist()  # equal lists: the same programs, read back otherwise
    assert [len(c) for c in chunks[:-1]] == [every] * (len(chunks) - 1) and sum(map(len, chunks)) == len(first)


def test_the_decoder_stops_where_generate_does_once_per_readback_and_counts_exactly_when_told(setup):
    backend, model, tokenizer, _, _, decoder, _, _ = setup
    ids = ck.chat_ids(tokenizer, backend.device, prompt="What is the capital of France?")
    expected, _, _ = g.generate(model, tokenizer, ids, backend, 16)  # a short answer, then <turn|>
    assert len(expected) < 16 and expected[-1] in g.stop_ids(model)
    for every in (1, 4, 16):
        streamer = Chunks()
        tokens = decoder.generate(ids, 16, readback_every=every, streamer=streamer)
        assert verdict.compare_tokens(tokens, expected, model, ids)
        assert sum(map(len, streamer.seen[1:])) == len(tokens)  # nothing after the stop reaches the caller
    assert len(decoder.generate(ids, 16, stop_ids=())) == 16


def test_a_run_beyond_the_cache_is_refused_with_the_numbers(setup):
    _, _, _, ids, _, decoder, _, _ = setup
    with pytest.raises(ValueError, match=f"prompt {ids.shape[1]} \\+ 200 new tokens exceed the cache's 128"):
        decoder.generate(ids, 200)


def test_bytes_per_token_counts_weights_once_and_the_cache(setup):
    _, model, _, _, _, decoder, _, _ = setup
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cache = d.cache_bytes(decoder.cache)
    layers = [layer for layer in decoder.cache.layers if layer.is_initialized]
    assert cache == sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in layers) > 0
    read = d.cache_read_bytes(model, decoder.cache)  # every layer's read, K/V-sharing ones included
    assert read > cache and read < roofline.step_bytes(model, decoder.cache) < weights + read  # one table row


def test_the_prefill_runs_the_head_on_the_last_real_position_only(setup):
    _, model, _, ids, _, decoder, tokens, _ = setup
    rows = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[1]))
    try:
        padded = torch.zeros(1, decoder.bucket(ids.shape[1]), dtype=ids.dtype)
        padded[:, : ids.shape[1]] = ids
        with torch.no_grad():
            first = decoder.prefill_forward(padded, torch.tensor([ids.shape[1] - 1]))  # eager: the hook sees it
    finally:
        hook.remove()
    assert rows == [1] and padded.shape[1] > 1 and first.item() == tokens[0]


def test_a_static_cache_is_sized_to_the_run_rounded_up_to_a_bucket():
    assert [d.cache_length(n) for n in (1, 16, 17, 37, 148, 4096, 5000)] == [16, 16, 32, 64, 256, 4096, 5000]
