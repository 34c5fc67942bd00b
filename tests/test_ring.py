"""The ring KV cache: logits and attention outputs equal a no-cache reference at every
position, bytes, refusals, one compiled decode step and one compiled prefill chunk."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

from helpers import decode as d
from helpers import ring
from helpers.course import e2b, hub, measure, offline, series, verdict

W = offline.TEXT_CONFIG["sliding_window"]


@pytest.fixture(scope="module")
def tiny():
    """A random tiny model of the real class, the twin's shape, float32, on the CPU."""
    torch.manual_seed(0)
    return Gemma4ForCausalLM(Gemma4TextConfig(**offline.TEXT_CONFIG)).eval()


@pytest.fixture(scope="module")
def cpu():
    from helpers.backend import get_backend

    return get_backend("cpu")


def _by_definition(length: int) -> dict:
    """Masks written from the definition: full k <= q; sliding also q - k < window."""
    q, k = torch.arange(length)[:, None], torch.arange(length)[None, :]
    return {"full_attention": (k <= q)[None, None], "sliding_attention": ((k <= q) & (q - k < W))[None, None]}


def _attention_outputs(model):
    """Forward hooks recording each attention layer's output, per call."""
    seen = {i: [] for i in range(len(model.model.layers))}
    hooks = [
        layer.self_attn.register_forward_hook(lambda m, a, out, i=i: seen[i].append(out[0][0]))
        for i, layer in enumerate(model.model.layers)
    ]
    return seen, hooks


def _no_cache(model, seq, masks=None):
    seen, hooks = _attention_outputs(model)
    with torch.no_grad():
        logits = model(seq, attention_mask=masks, use_cache=False).logits[0]
    for h in hooks:
        h.remove()
    return logits, {i: out[0] for i, out in seen.items()}


def _through_the_ring(decoder, seq, prompt_len):
    """Logits and attention outputs at every position: the prompt in chunks, then one token at
    a time (teacher-forced: the same path as generation, with known tokens)."""
    seen, hooks = _attention_outputs(decoder.model)
    logits, kept = [], []
    with torch.no_grad():
        decoder.cache.reset()
        for start, positions, valid in decoder.chunks(prompt_len, seq.device):
            n = int(valid.sum())
            tokens = torch.zeros(1, decoder.chunk_size, dtype=seq.dtype)
            tokens[:, :n] = seq[:, start : start + n]
            logits.append(decoder.forward_chunk(tokens, positions, valid).logits[0, :n])
            kept.append(n)
        for p in range(prompt_len, seq.shape[1]):
            logits.append(
                decoder.forward_chunk(seq[:, p : p + 1], torch.tensor([[p]]), torch.ones(1, dtype=torch.bool)).logits[0]
            )
            kept.append(1)
    for h in hooks:
        h.remove()
    outputs = {i: torch.cat([o[:n] for o, n in zip(outs, kept)]) for i, outs in seen.items()}
    return torch.cat(logits), outputs


def test_the_reference_is_trustworthy_hf_no_cache_masks_equal_the_definition(tiny):
    """The reference is HF's forward over the whole sequence with no cache at all: no cache
    layer, no slot bookkeeping, only HF's mask from positions 0..L-1. HF's sliding mask had a
    bug past the window (with a cache) until mid-2026; here it equals masks written from the
    definition, far past the window."""
    seq = torch.randint(0, 512, (1, 5 * W + 3), generator=torch.Generator().manual_seed(0))
    hf, _ = _no_cache(tiny, seq)
    ours, _ = _no_cache(tiny, seq, _by_definition(seq.shape[1]))
    torch.testing.assert_close(hf, ours)  # float32's default tolerance: HF may take another SDPA path
    full_only, _ = _no_cache(
        tiny,
        seq,
        {"full_attention": _by_definition(seq.shape[1])["full_attention"]}
        | {"sliding_attention": _by_definition(seq.shape[1])["full_attention"]},
    )
    assert not torch.allclose(hf[W:], full_only[W:], atol=1e-3)  # the window matters past it: the test can fail


lengths = st.one_of(st.sampled_from([1, W - 1, W, W + 1, 2 * W, 3 * W + 5, 53, 7 * W + 3]), st.integers(1, 8 * W))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt_len=lengths,
    new_tokens=st.one_of(st.sampled_from([0, 1, W - 1, W + 1, 3 * W]), st.integers(0, 4 * W)),
    chunk=st.sampled_from([1, 3, 5, 7, 12, W]),
    slack=st.integers(0, 2 * W),
    seed=st.integers(0, 2**16),
)
def test_logits_and_attention_equal_the_no_cache_reference_at_every_position(
    tiny, cpu, prompt_len, new_tokens, chunk, slack, seed
):
    seq = torch.randint(0, 512, (1, prompt_len + new_tokens), generator=torch.Generator().manual_seed(seed))
    max_len = max(seq.shape[1] + slack, chunk)  # any size: the padded last chunk may run past it
    decoder = ring.RingDecoder(tiny, cpu, max_len=max_len, chunk_size=chunk)
    logits, attention = _through_the_ring(decoder, seq, prompt_len)
    ref_logits, ref_attention = _no_cache(tiny, seq)
    # float32 sums in another order (keys ring-ordered, padding masked): differences of 1e-5..1e-4;
    # a wrong mask or slot moves them by 1e-2 and more (the reference test above)
    torch.testing.assert_close(logits, ref_logits, atol=1e-3, rtol=1e-3)
    for i, out in attention.items():
        torch.testing.assert_close(out, ref_attention[i], atol=1e-3, rtol=1e-3, msg=f"layer {i} differs")


class _Attn:  # what an attention function reads of its layer
    num_key_value_groups, is_causal, training = 4, True, False


@pytest.mark.parametrize("queries", [1, 5])
def test_grouped_attention_gives_transformers_sdpa_values(queries):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(queries)
    q, k, v = torch.randn(2, 8, queries, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    mask = torch.rand(2, 1, queries, 40) > 0.3  # no causal pattern: each query's own keys
    theirs, _ = sdpa_attention_forward(_Attn(), q, k, v, mask, scaling=0.5)
    ours, _ = ring.grouped_attention(_Attn(), q, k, v, mask, scaling=0.5)
    assert ours.shape == theirs.shape == (2, queries, 8, 16)
    torch.testing.assert_close(ours, theirs)  # another call shape: float32's default tolerance, not bits
    shuffled = ring.grouped_attention(_Attn(), q, k, v, mask.flip(2), scaling=0.5)[0]
    assert queries == 1 or not torch.allclose(shuffled, theirs)  # each query's mask row reaches its own heads


def test_grouped_attention_refuses_what_it_cannot_group():
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 1, 6, 8)
    with pytest.raises(ValueError, match="softcap"):
        ring.grouped_attention(_Attn(), q, k, k, None, softcap=30.0)
    with pytest.raises(ValueError, match="a mask per head"):
        ring.grouped_attention(_Attn(), q, k, k, torch.ones(1, 4, 3, 6, dtype=torch.bool))


def test_the_ring_with_grouped_attention_gives_the_same_logits(cpu):
    """The model's own attention, then grouped, over a prompt crossing the window in chunks and
    token by token after it: the same logits, within float32's default tolerance."""
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**offline.TEXT_CONFIG)).eval()
    seq = torch.randint(0, 512, (1, 3 * W + 7), generator=torch.Generator().manual_seed(1))
    before, _ = _through_the_ring(ring.RingDecoder(model, cpu, max_len=4 * W, chunk_size=5), seq, 2 * W + 1)
    assert ring.group_query_heads(model) == "sdpa" and model.config._attn_implementation == ring.GROUPED
    after, _ = _through_the_ring(ring.RingDecoder(model, cpu, max_len=4 * W, chunk_size=5), seq, 2 * W + 1)
    torch.testing.assert_close(before, after)


def test_the_cache_holds_a_window_per_sliding_layer_a_full_buffer_per_full_layer_and_nothing_when_shared(tiny, cpu):
    cache = ring.RingDecoder(tiny, cpu, max_len=96, chunk_size=12).cache
    for layer, decoder in zip(cache.layers, tiny.model.layers):
        attn = decoder.self_attn
        assert layer.is_initialized == (not attn.is_kv_shared_layer)
        if layer.is_initialized:
            assert layer.keys.shape[2] == (W + 16 if attn.is_sliding else 96)  # spare slots: a block past a stop
    config = tiny.config
    assert d.cache_bytes(cache) == e2b.kv_cache_bytes(config, 96, ring=True, dtype_bytes=4, spare=16)
    assert d.cache_bytes(cache) < e2b.kv_cache_bytes(config, 96, dtype_bytes=4)


def test_e2b_ring_cache_bytes_at_131328_positions():
    config = e2b.real_config().get_text_config()
    assert e2b.kv_cache_bytes(config, 131_328, ring=True) == 813_170_688
    assert e2b.kv_cache_bytes(config, 131_328) == 2_420_637_696
    # the cache itself, allocated on the meta device with the defaults (chunk = the 512 window;
    # 131,328 is not a multiple of it)
    model = e2b.meta_model(config).to(torch.bfloat16)
    cache = ring.RingCache(model, 131_328, config.sliding_window)
    assert d.cache_bytes(cache) == 813_170_688
    spare = ring.RingCache(model, 131_328, config.sliding_window, spare=16)  # a RingDecoder's, for its blocks
    assert d.cache_bytes(spare) == e2b.kv_cache_bytes(config, 131_328, ring=True, spare=16) == 813_367_296
    # what a step reads: the 7 full layers each a full-length buffer (layers 19-34 read layer 14's),
    # the 28 sliding ones a window: ~1.90 GB, from the tensors as from the configuration
    full = 2 * 512 * 2 * 131_328  # K and V, one head of 512, bf16: 268,959,744 B a full layer
    sliding = 2 * 256 * 2 * 512
    assert d.cache_read_bytes(model, cache) == 7 * full + 28 * sliding == 1_897_398_272
    assert e2b.kv_read_bytes(config, 131_328, ring=True) == 1_897_398_272 and 7 * full > 1.88e9


def test_a_max_len_that_is_no_multiple_of_the_chunk_gives_the_no_cache_tokens(tiny, cpu):
    prompt = torch.randint(3, 512, (1, 6 * W + 3), generator=torch.Generator().manual_seed(5))
    decoder = ring.RingDecoder(tiny, cpu, max_len=6 * W + 9)  # the last chunk runs 7 positions past it
    tokens = decoder.generate(prompt, 6, stop_ids=())
    seq = prompt
    for _ in range(6):
        seq = torch.cat([seq, _no_cache(tiny, seq)[0][-1:].argmax(-1)[None]], dim=1)
    assert verdict.compare_tokens(tokens, seq[0, prompt.shape[1] :].tolist(), tiny, prompt)


def test_a_run_goes_on_after_a_block_read_back_past_its_stop(tiny, cpu):
    """A block of 16 tokens runs past a stop; the ring's 16 spare slots keep what it made off every slot the next
    run's queries see, and the next run, from the stop, gives the no-cache tokens. A ring with too few spare slots
    refuses to go on, where it has lost a position the next query sees."""
    prompt = torch.randint(3, 512, (1, 2 * W + 3), generator=torch.Generator().manual_seed(2))
    turn = torch.randint(3, 512, (1, 5), generator=torch.Generator().manual_seed(3))
    for every, spare in ((16, 16), (1, 1)):
        decoder = ring.RingDecoder(tiny, cpu, max_len=4 * W, readback_every=every)
        decoder.prefill_step, decoder.decode_step = decoder.prefill_forward, decoder.step  # eager: the same code
        assert decoder.cache.slot_positions.numel() == W + spare
        stop = decoder.generate(prompt, 16, stop_ids=())[3]
        reply = decoder.generate(prompt, 16, readback_every=16, stop_ids=[stop])
        held = prompt.shape[1] + len(reply) - 1  # where the stop goes in: the next run feeds it first
        assert len(reply) <= 4 and decoder.cache.get_seq_length() == prompt.shape[1] + 15  # a block past it
        kept = set(range(held - W + 1, held)) <= set(decoder.cache.slot_positions.tolist())
        assert kept == (spare == 16)
        new = torch.cat([torch.tensor([reply[-1:]]), turn], dim=1)
        if spare == 1:
            with pytest.raises(ValueError, match="this ring keeps 1 spare slots"):
                decoder.generate(new, 6, stop_ids=(), start=held)
            continue
        went_on = decoder.generate(new, 6, stop_ids=(), start=held)
        seq = history = torch.cat([prompt, torch.tensor([reply]), turn], dim=1)
        for _ in range(6):
            seq = torch.cat([seq, _no_cache(tiny, seq)[0][-1:].argmax(-1)[None]], dim=1)
        assert verdict.compare_tokens(went_on, seq[0, history.shape[1] :].tolist(), tiny, history)


def test_bad_sizes_and_too_long_requests_are_refused_up_front_with_the_numbers(tiny, cpu):
    with pytest.raises(ValueError, match=f"chunk size {W + 1} must be 1..{W}"):
        ring.RingDecoder(tiny, cpu, max_len=(W + 1) * 4, chunk_size=W + 1)
    with pytest.raises(ValueError, match="max_len 12 must be at least the chunk size 16"):
        ring.RingDecoder(tiny, cpu, max_len=12, chunk_size=16)
    with pytest.raises(ValueError, match="bucket 8 must be at least the chunk size 16"):
        ring.RingDecoder(tiny, cpu, max_len=64, chunk_size=16, buckets=(8, 32))
    with pytest.raises(ValueError, match="buckets \\[32, 128\\] must be at most max_len 64"):
        ring.RingDecoder(tiny, cpu, max_len=64, chunk_size=16, buckets=(32, 128))
    decoder = ring.RingDecoder(tiny, cpu, max_len=64, chunk_size=16)
    with pytest.raises(ValueError, match="prompt 60 \\+ 5 new tokens exceed the cache's 64 positions"):
        decoder.generate(torch.zeros(1, 60, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="a 65-token prompt exceeds the cache's 64 positions"):
        decoder.prefill(torch.zeros(1, 65, dtype=torch.long))


def test_compiled_one_decode_step_and_one_prefill_chunk_for_any_prompt_with_the_4bit_table(backend):
    from helpers import generate as g
    from helpers import qtable

    checkpoint, model, tokenizer, ids = series.load_for_series(backend)
    n = backend.generation_length
    reference, _, _ = g.generate(model, tokenizer, ids, backend, n)
    independent = verdict.reference_model(checkpoint, hub.series_dtype(checkpoint))  # on the host
    d.strip_compressed_wrappers(model)
    qtable.keep_table_in_4bit(model)
    ring.group_query_heads(model)  # as notebook 06 runs it: the compiled grouped attention, on each backend
    torch.compiler.reset()
    decoder = ring.RingDecoder(model, backend, max_len=256)
    with backend.compile_counter() as count:
        tokens = decoder.generate(ids, n)
    assert verdict.compare_tokens(tokens, reference, independent, ids) and count.graphs == 2  # a chunk, a step
    long = ids.repeat(1, 8)[:, : 7 * W + 3]  # crosses the window seven times; the last chunk padded
    with backend.compile_counter() as again, measure.no_recompiles():
        tokens = decoder.generate(long, n, stop_ids=())  # exactly n: the reference below never stops
    assert again.graphs == 0
    seq = long.cpu()
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, independent(seq, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    assert verdict.compare_tokens(tokens, seq[0, long.shape[1] :].tolist(), independent, long)
