"""Draft and verify (notebook 09): the target's greedy tokens for K = 1..6, every draft kept or none, a stop inside
the drafts, a prompt several windows long on a ring with K more spare slots, HF's assisted generate, one call graph (a
verify, then the next drafts) per K besides the prefill."""

import pytest
import torch
from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

from helpers import decode, draft
from helpers.course import offline, series, verdict
from helpers.generate import greedy_config

W = offline.TEXT_CONFIG["sliding_window"]
MAX_LEN = 128


@pytest.fixture(scope="module")
def setup():
    """The float32 twin as notebook 04 strips it, its trained assistant, the reference model and its tokens."""
    from helpers.backend import get_backend

    backend = get_backend("cpu")
    checkpoint, model, tokenizer, ids = series.load_for_series(backend)
    with torch.no_grad():
        model(ids)
    decode.strip_compressed_wrappers(model)
    assistant = draft.load_assistant(offline.build_twin_assistant(checkpoint.path), backend, torch.float32)
    reference = verdict.reference_model(checkpoint, torch.float32)
    return backend, model, assistant, reference, ids


def eager(decoder):
    """The decoder's steps run as written, uncompiled: the same code, without a compile per K on 2 cores."""
    decoder.prefill_step, decoder.decode_step = decoder.prefill_forward, decoder.step
    if isinstance(decoder, draft.Drafted):
        decoder.call_step = decoder.verify_and_draft
    return decoder


class Oracle(draft.DraftDecoder):
    """Drafts read from a list of tokens by position: the right ones (every draft kept) or each one off by one (none)."""

    def __init__(self, *args, sequence: list[int], wrong: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        vocab = self.model.config.get_text_config().vocab_size
        padded = torch.tensor(sequence + [0] * (self.max_len + self.draft_tokens))
        self.sequence = (padded + 1) % vocab if wrong else padded

    def draft(self, token, hidden, position):
        return self.sequence.index_select(0, position.view(-1) + 1 + torch.arange(self.draft_tokens))[None], None


def judged(tokens, setup, ids, new_tokens: int, stop: bool = True):
    """The one verdict against the reference model's greedy tokens (two programs: teacher-forced, near ties named);
    ``stop=False``: exactly ``new_tokens``, as ``stop_ids=()``."""
    reference = setup[3]
    out = reference.generate(ids, generation_config=greedy_config(reference, new_tokens, stop))
    expected = out.sequences[0, ids.shape[1] :].tolist()
    return verdict.compare_tokens(tokens, expected, reference, ids), expected


@pytest.mark.parametrize("k", range(1, 7))
def test_the_targets_greedy_tokens_for_each_k_and_the_trained_assistant_is_kept(setup, k):
    backend, model, assistant, _, ids = setup
    decoder = eager(draft.DraftDecoder(model, assistant, backend, MAX_LEN, k))
    tokens = decoder.generate(ids, 32)
    result, expected = judged(tokens, setup, ids, 32)
    assert result, result
    assert sum(decoder.kept) + len(decoder.kept) + 1 >= len(tokens)  # every token came from a call or the prefill
    assert sum(decoder.kept) / (k * len(decoder.kept)) > 0.5, decoder.kept  # trained: most drafts are the target's


@pytest.mark.parametrize("wrong", [False, True])
def test_every_draft_kept_or_every_draft_rejected(setup, wrong):
    backend, model, assistant, _, ids = setup
    k, n = 4, 24
    _, expected = judged([], setup, ids, n, stop=False)
    oracle = Oracle(model, assistant, backend, MAX_LEN, k, sequence=ids[0].tolist() + expected, wrong=wrong)
    tokens = eager(oracle).generate(ids, n, stop_ids=())
    result, _ = judged(tokens, setup, ids, n, stop=False)
    assert result, result
    assert set(oracle.kept[:-1]) == ({0} if wrong else {k})  # the last call may be cut by the length


def test_a_stop_token_inside_the_drafts_ends_the_run_there(setup):
    backend, model, assistant, _, ids = setup
    k, n = 6, 32
    _, expected = judged([], setup, ids, n)
    stops = set(model.generation_config.eos_token_id)
    assert expected[-1] in stops and len(expected) < n  # the series' prompt: the twin ends its turn
    oracle = eager(Oracle(model, assistant, backend, MAX_LEN, k, sequence=ids[0].tolist() + expected + [5] * 16))
    tokens = oracle.generate(ids, n)
    assert tokens == expected  # the oracle drafts the reference itself: the verify's argmax decides, checked below
    assert judged(tokens, setup, ids, n)[0]
    assert 1 + sum(kept + 1 for kept in oracle.kept) > len(tokens)  # the last call made tokens past the stop


def test_a_prompt_several_windows_long_on_the_ring(setup):
    backend, model, assistant, _, _ = setup
    prompt = torch.randint(3, 512, (1, 3 * W + 5), generator=torch.Generator().manual_seed(0))
    for k in (2, 5):
        decoder = eager(draft.DraftRingDecoder(model, assistant, backend, MAX_LEN, k))
        tokens = decoder.generate(prompt, 24, stop_ids=())
        result, _ = judged(tokens, setup, prompt, 24, stop=False)
        assert result, result
        assert decoder.cache.slot_positions.numel() == W + 16 + k  # a block's spare slots, then the drafts'


def test_a_ring_of_window_slots_loses_a_position_the_next_query_sees(setup):
    """A rejected draft's position takes a slot: with ``window`` slots it held a position still in the window."""
    backend, model, assistant, _, _ = setup
    prompt = torch.randint(3, 512, (1, 2 * W + 3), generator=torch.Generator().manual_seed(1))
    k = 4
    rejected = torch.full((1, k), 511)  # a token the twin hardly makes
    for spare, loses in ((0, True), (k, False)):
        decoder = eager(draft.DraftRingDecoder(model, assistant, backend, MAX_LEN, k))
        decoder.spare = spare
        decoder.cache = decoder.new_cache(model, MAX_LEN)
        decoder.draft = lambda token, hidden, position: (rejected, None)
        token, start = decoder.prefill(prompt)
        _, _, position = decoder.call(token, start)
        q = int(position)  # the next query: it sees positions q - window + 1 .. q - 1 in the ring
        assert q - int(start) <= k - 1  # at least two drafts rejected: their positions written, then forgotten
        held = set(decoder.cache.slot_positions.tolist())
        assert (not set(range(q - W + 1, q)) <= held) == loses


def test_a_drafting_ring_goes_on_after_a_block_read_back_past_its_stop(setup):
    """Blocks of 16 tokens and a call's K drafts past a stop: the ring's 16 + K spare slots keep them off every slot
    the next run's queries see, and the next run, from the stop, gives the reference's tokens."""
    backend, model, assistant, reference, _ = setup
    prompt = torch.randint(3, 512, (1, 2 * W + 3), generator=torch.Generator().manual_seed(2))
    turn = torch.randint(3, 512, (1, 5), generator=torch.Generator().manual_seed(3))
    k = 4
    decoder = eager(draft.DraftRingDecoder(model, assistant, backend, MAX_LEN, k))
    assert decoder.cache.slot_positions.numel() == W + 16 + k
    stop = decoder.generate(prompt, 16, stop_ids=())[1]
    reply = decoder.generate(prompt, 40, stop_ids=[stop])
    held = prompt.shape[1] + len(reply) - 1
    assert len(reply) <= 2 and decoder.cache.get_seq_length() > held + 1  # kept tokens past the stop
    went_on = decoder.generate(torch.cat([torch.tensor([reply[-1:]]), turn], dim=1), 12, stop_ids=(), start=held)
    history = torch.cat([prompt, torch.tensor([reply]), turn], dim=1)
    result, _ = judged(went_on, setup, history, 12, stop=False)
    assert result, result


@pytest.mark.parametrize("k", [2, 4])
def test_a_drafting_ring_moves_up_its_buckets_as_the_context_grows(setup, k):
    """Buckets of the full layers' buffer, the smallest first: a call may write K+1 positions, so it moves up before
    them (past the first bucket a full layer would otherwise write over its own first slots: wrong tokens from
    there, seen at bucket 16)."""
    backend, model, assistant, _, ids = setup
    prompt = ids[:, :10]  # in the first bucket
    decoder = eager(draft.DraftRingDecoder(model, assistant, backend, MAX_LEN, k, buckets=(W, 2 * W)))
    tokens = decoder.generate(prompt, 48, stop_ids=())
    result, _ = judged(tokens, setup, prompt, 48, stop=False)
    assert result, result
    assert decoder.cache.max_len == MAX_LEN and decoder.at == 10 + 48


def test_tokens_per_verify_after_a_run_with_no_call_says_why(setup):
    backend, model, assistant, _, ids = setup
    decoder = eager(draft.DraftDecoder(model, assistant, backend, MAX_LEN, 2))
    assert len(decoder.generate(ids, 1)) == 1  # the prefill's token: no call
    for count in (decoder.tokens_per_verify, decoder.kept_at):
        with pytest.raises(ValueError, match="made no call"):
            count()


def test_the_assistants_attention_is_grouped_and_gives_hfs_output(setup):
    """Each draft reads the target's K/V once per K/V head (notebook 06's grouped attention), within float32's
    tolerance of transformers' SDPA attention, which repeats them per query head."""
    import copy

    from helpers import ring

    backend, model, assistant, _, ids = setup
    assert assistant.config._attn_implementation == ring.GROUPED
    hfs = copy.deepcopy(assistant)
    hfs.set_attn_implementation("sdpa")
    decoder = eager(draft.DraftDecoder(model, assistant, backend, MAX_LEN, 3))
    token, position = decoder.prefill(ids)
    embedding = model.get_input_embeddings()(token)
    with torch.no_grad():
        hidden = model.model(ids, use_cache=False).last_hidden_state[:, -1:]  # what the prefill drafted from
    outputs = []
    for helper in (assistant, hfs):
        decoder.assistant = helper
        shared_kv, masks = decoder.shared(position)
        outputs.append(draft.assist(helper, embedding, hidden, position, shared_kv, masks))
    for grouped, repeated in zip(*outputs):
        torch.testing.assert_close(grouped, repeated)


def test_hf_assisted_generate_gives_the_targets_tokens(setup):
    backend, model, assistant, _, ids = setup
    assistant.generation_config.num_assistant_tokens = 3
    out = model.generate(ids, generation_config=greedy_config(model, 32), assistant_model=assistant)
    result, _ = judged(out.sequences[0, ids.shape[1] :].tolist(), setup, ids, 32)
    assert result, result


def test_ordered_embeddings_score_the_top_centroids_tokens_as_hfs_embedder():
    torch.manual_seed(0)
    text = Gemma4TextConfig(**offline.ASSISTANT_CONFIG)
    config = Gemma4AssistantConfig(
        text_config=text,
        backbone_hidden_size=64,
        use_ordered_embeddings=True,
        num_centroids=32,
        centroid_intermediate_top_k=4,
    )
    assistant = Gemma4AssistantForCausalLM(config).eval()
    assistant.masked_embedding.token_ordering.copy_(torch.randperm(text.vocab_size))
    hidden = torch.randn(1, 1, text.hidden_size)
    hfs = assistant.masked_embedding(hidden, assistant.lm_head.weight).argmax(-1)
    assert torch.equal(draft.draft_token(assistant, hidden), hfs)  # the same products, one scatter apart


def test_refusals(setup):
    backend, model, assistant, _, ids = setup
    with pytest.raises(ValueError, match="draft at least one"):
        draft.DraftDecoder(model, assistant, backend, MAX_LEN, 0)
    decoder = draft.DraftDecoder(model, assistant, backend, 64, 6)
    with pytest.raises(ValueError, match="the last call's"):
        decoder.generate(ids, 64 - ids.shape[1] - 2)


@pytest.mark.parametrize("kind", [draft.DraftDecoder, draft.DraftRingDecoder], ids=lambda kind: kind.__name__)
def test_a_call_is_one_compiled_graph_besides_the_prefill(backend, setup, kind):
    checkpoint, model, _, ids = series.load_for_series(backend)  # on this run's backend (xla in CI's xla job)
    with torch.no_grad():
        model(ids)
    decode.strip_compressed_wrappers(model)
    folder = offline.build_twin_assistant(checkpoint.path)
    assistant = draft.load_assistant(folder, backend, torch.float32)
    torch.compiler.reset()
    decoder = kind(model, assistant, backend, MAX_LEN, 2)
    with backend.compile_counter() as count:
        tokens = decoder.generate(ids, 16)
    with backend.compile_counter() as again:
        assert decoder.generate(ids, 16) == tokens  # equal lists: the same programs on the same inputs
    assert (count.graphs, again.graphs) == (2, 0)  # the prefill chunk (it drafts), a call (verify, draft); none a token
    result, _ = judged(tokens, setup, ids.cpu(), 16)
    assert result, result


def test_a_chat_that_drafts_replies_as_the_one_that_does_not(setup):
    """Notebook 08's chat on notebook 09's ring: each turn goes on after drafts kept past the last reply's stop."""
    from helpers.chat import Chat
    from helpers.checkpoint import load_tokenizer
    from helpers.course import hub
    from helpers.course.offline import CHATS
    from helpers.ring import RingDecoder

    backend, model, assistant, reference, _ = setup
    tokenizer = load_tokenizer(hub.choose_checkpoint(backend).path)
    plain = Chat(eager(RingDecoder(model, backend, MAX_LEN)), tokenizer, max_new_tokens=24)
    drafted = Chat(eager(draft.DraftRingDecoder(model, assistant, backend, MAX_LEN, 4)), tokenizer, max_new_tokens=24)
    for question, _ in CHATS[1:3]:
        plain.say(question)
        drafted.say(question)
        ids = torch.tensor([plain.tokens[: len(plain.tokens) - len(plain.replies[-1])]])
        result = verdict.compare_tokens(drafted.replies[-1], plain.replies[-1], reference, ids)
        assert result, result


def chi2_999(df: int) -> float:
    """Chi-square's 0.999 quantile (Wilson-Hilferty: within 3% at 1 degree, closer past it): a correct sampler fails 1 time in 1,000."""
    a = 2 / (9 * df)
    return df * (1 - a + 3.0902 * a**0.5) ** 3


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of ``counts`` against ``probs`` and its degrees of freedom, tokens expected fewer than 5
    times pooled in one bin (the statistic's approximation needs 5)."""
    assert counts[probs == 0].sum() == 0  # nothing outside what top-k keeps
    expected = probs * counts.sum()
    rare = (expected < 5) & (probs > 0)
    observed = torch.cat([counts[expected >= 5], counts[rare].sum().view(1)])
    expected = torch.cat([expected[expected >= 5], expected[rare].sum().view(1)])
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    return float(((observed - expected) ** 2 / expected).sum()), len(expected) - 1


def test_speculative_sampling_keeps_the_targets_distribution(setup):
    """Tokens 2 and 3 of 1,200 seeds, drafted by an untrained assistant (most drafts rejected: the residual draws) and
    by the trained one (most kept), against their exact distributions under the target, summed over token 1 (and 2)."""
    from transformers.generation.logits_process import TopKLogitsWarper

    from helpers.sampling import sampling_config

    backend, model, assistant, _, ids = setup
    top_k, runs = 3, 1200
    warp = TopKLogitsWarper(top_k=top_k)
    vocab = model.config.get_text_config().vocab_size

    def probs(prefixes: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return warp(None, model(prefixes).logits[:, -1].float()).softmax(-1)

    p1 = probs(ids)[0]
    first = p1.nonzero()[:, 0]
    p2_given = probs(torch.cat([ids.repeat(len(first), 1), first[:, None]], dim=1))  # [top_k, vocab]
    p2 = (p1[first, None] * p2_given).sum(0)
    pairs = [(a, b) for i, a in enumerate(first.tolist()) for b in p2_given[i].nonzero()[:, 0].tolist()]
    p3_given = probs(torch.cat([ids.repeat(len(pairs), 1), torch.tensor(pairs)], dim=1))
    weights = torch.tensor([p1[a] * p2_given[first.tolist().index(a), b] for a, b in pairs])
    p3 = (weights[:, None] * p3_given).sum(0)

    torch.manual_seed(0)
    untrained = Gemma4AssistantForCausalLM(assistant.config).eval()
    for drafter in (untrained, assistant):
        decoder = eager(
            draft.SpeculativeDecoder(model, drafter, backend, MAX_LEN, 2, sampling=sampling_config(top_k=top_k))
        )
        counts = torch.zeros(2, vocab)
        for seed in range(runs):
            tokens = decoder.generate(ids, 3, seed=seed, stop_ids=())
            counts[0, tokens[1]] += 1
            counts[1, tokens[2]] += 1
        for c, exact in zip(counts, (p2, p3)):
            stat, df = chi2(c, exact)
            assert stat < chi2_999(df), (stat, df)
    # the statistic sees a wrong distribution: token 2's counts against its probabilities sharpened (p squared)
    stat, df = chi2(counts[0], p2**2 / (p2**2).sum())
    assert stat > chi2_999(df), (stat, df)


def test_speculative_greedy_is_draft_and_verify(setup):
    backend, model, assistant, _, ids = setup
    greedy = eager(draft.SpeculativeRingDecoder(model, assistant, backend, MAX_LEN, 3)).generate(ids, 24, stop_ids=())
    plain = eager(draft.DraftRingDecoder(model, assistant, backend, MAX_LEN, 3)).generate(ids, 24, stop_ids=())
    assert greedy == plain  # the same code path (no sampler): the same program on the same inputs
