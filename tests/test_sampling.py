"""Sampling in the compiled step: transformers' warpers, reproducible draws keyed on (seed,
position), frequencies that match generate's probabilities, and stop strings.

Every ``torch.equal`` here compares data identical by construction: integer codes, packed words,
weights, rows gathered and dequantized exactly (one rounding to bf16, as the checkpoint's
values were made), or one program's output twice. Two programs are compared within a dtype's
tolerance or by the series' token verdict instead."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GenerationConfig

import helpers
from helpers import generate as g
from helpers import sampling as s
from helpers.course import verdict

VOCAB, DRAWS = 40, 200_000
SETTINGS = [dict(temperature=0.7, top_k=12, top_p=0.9), dict(temperature=1.6), dict(top_p=0.5)]


@pytest.fixture(scope="module")
def series():
    return helpers.course.series.prepare(helpers.get_backend(), after=4)


def generate_processors(model, config):
    """The warpers transformers' generate itself builds for ``config`` (its private builder)."""
    return model._get_logits_processor(generation_config=config, input_ids_seq_length=1, device="cpu")


def chi2_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of ``counts`` against ``probs``, tokens expected under 5 times
    pooled into one bin; the p-value from the chi-square survival function (torch.special)."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = expected > 0
    stat = (((observed - expected) ** 2)[keep] / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda x: ",".join(f"{k}={v}" for k, v in x.items()))
def test_draws_follow_the_probabilities_of_generates_own_processors(series, settings):
    """200,000 draws of one step (one per position), compiled. For truly random draws the test
    fails with probability 1e-6 (the p-value threshold); the draws are a fixed function of the
    seed, so it is deterministic. Its power: the same counts against the unwarped softmax fail."""
    backend = helpers.get_backend()
    config = s.sampling_config(**settings)
    logits = 2 * torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    probs = generate_processors(series.model, config)(None, logits).softmax(-1)[0]
    sampler = s.Sampler(config)
    draw = backend.compile(sampler, fullgraph=True)
    tokens = draw(
        logits.expand(DRAWS, VOCAB).to(backend.device),
        torch.arange(DRAWS, device=backend.device),
        torch.tensor([7], device=backend.device),
    )
    counts = torch.bincount(tokens.view(-1).cpu(), minlength=VOCAB)
    assert counts[probs == 0].sum() == 0  # what top-k or top-p removed is never drawn
    assert chi2_p_value(counts, probs) > 1e-6
    assert chi2_p_value(counts, logits.softmax(-1)[0]) < 1e-6


def test_greedy_settings_give_the_argmax_of_the_models_logits(series):
    """do_sample=False and top_k=1 both choose generate's greedy tokens, at every position of
    notebook 03's answer."""
    ids = torch.cat([series.ids, torch.tensor([series.reference], device=series.ids.device)], dim=1)
    with torch.no_grad():
        logits = series.model(ids).logits[0, series.ids.shape[1] - 1 : -1]
    positions, seed = torch.arange(logits.shape[0]), torch.tensor([3])
    for config in (None, GenerationConfig(do_sample=False), s.sampling_config(top_k=1, temperature=0.5)):
        assert s.Sampler(config)(logits, positions, seed)[:, 0].tolist() == series.reference


def test_settings_the_step_does_not_run_are_refused():
    with pytest.raises(ValueError, match="min_p: not in the compiled step"):
        s.Sampler(s.sampling_config(min_p=0.1))
    with pytest.raises(ValueError, match="top_p"):  # transformers' own warper checks its range
        s.Sampler(s.sampling_config(top_p=-0.1))


def test_stop_strings_cut_where_generates_own_stop_strings_cut(series):
    """The chunk check (transformers' StopStringCriteria) stops at the token generate stops at."""
    backend, model, tokenizer, ids = helpers.get_backend(), series.model, series.tokenizer, series.ids
    answer = series.reference
    stop = tokenizer.decode(answer[4:6])[1:]  # a string that ends inside the answer, mid-token or not
    criteria = g.stop_strings_criteria(tokenizer, [stop])
    keep = g.first_stop(ids[0].tolist(), answer, set(), criteria)
    hf, _, _ = g.generate(model, tokenizer, ids, backend, len(answer), stop_strings=[stop])
    assert keep is not None and keep < len(answer) and verdict.compare_tokens(hf, answer[:keep], model, ids)


@pytest.fixture(scope="module")
def sampled(series):
    backend = helpers.get_backend()
    decoder = s.SampledDecoder(series.model, backend, 128, sampling=s.sampling_config(temperature=2.0))
    with backend.compile_counter() as count:
        first = decoder.generate(series.ids, 12, seed=1, stop_ids=())
    return decoder, first, count


def test_one_seed_gives_the_same_tokens_twice_and_a_new_seed_no_recompile(sampled, series):
    decoder, first, count = sampled
    backend = decoder.backend
    assert count.graphs == 2  # the prefill and the step, sampling inside
    with backend.compile_counter() as again:
        second = decoder.generate(series.ids, 12, seed=1, stop_ids=())
        others = [decoder.generate(series.ids, 12, seed=seed, stop_ids=()) for seed in (2, 3)]
    assert second == first and again.graphs == 0  # equal lists: the same programs on the same inputs
    assert any(other != first for other in others)
    assert first != series.reference[:12]  # at temperature 2 the twin's answer does not survive


def test_a_stop_string_ends_a_sampled_run_and_the_streamer_sees_every_token(sampled, series):
    decoder, first, _ = sampled
    tokenizer = series.tokenizer
    # two tokens from the middle that decode to whole characters (a byte-level token alone may not)
    i = next(i for i in range(5, len(first) - 1) if "\ufffd" not in tokenizer.decode(first[i : i + 2]))
    stop = tokenizer.decode(first[i : i + 2])
    keep = g.first_stop(series.ids[0].tolist(), first, set(), g.stop_strings_criteria(tokenizer, [stop]))
    streamer = g.StepStreamer(tokenizer, decoder.backend)
    tokens = decoder.generate(
        series.ids,
        12,
        readback_every=4,
        seed=1,
        stop_ids=(),
        stop_strings=[stop],
        tokenizer=tokenizer,
        streamer=streamer,
    )
    assert tokens == first[:keep] and keep <= i + 2  # the same programs and seed, read back otherwise
    assert streamer.counts[0] == series.ids.shape[1] and sum(streamer.counts[1:]) == len(tokens)
    assert streamer.text == tokenizer.decode(tokens, skip_special_tokens=True)
    with pytest.raises(ValueError, match="stop_strings need the tokenizer"):
        decoder.generate(series.ids, 4, stop_strings=[stop])


def test_the_noise_is_the_unsigned_32_bit_hash_computed_in_int32():
    """The Gumbel noise in int32 only (a TPU has no 64-bit integers) gives exactly the noise of
    the same hash on unsigned 32-bit words computed in int64, seeds past 2**31 included."""
    from helpers.sampling import gumbel

    mask = 0xFFFFFFFF

    def mix64(x):  # Wellons' lowbias32, as written on 64-bit integers
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & mask
        x = x ^ (x >> 15)
        x = (x * 0x846CA68B) & mask
        return x ^ (x >> 16)

    positions = torch.tensor([0, 5, 100_005, 131_327])
    for seed in (0, 12345, 2**31 + 7, 2**32 - 1):
        key = mix64(mix64(torch.tensor([[seed]]) & mask) ^ positions.view(-1, 1))
        bits = mix64(key ^ torch.arange(3000).view(1, -1))
        expected = -torch.log(-torch.log(((bits >> 9).float() + 0.5) / 2**23))  # 23 bits and a half: below 1
        assert torch.equal(gumbel(torch.tensor([seed]), positions, 3000), expected)

    made = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view:  # viewing the int64 inputs moves no data
                made.append(out.dtype)
            return out

    with Watch():
        gumbel(torch.tensor([7]), positions, 3000)
    assert torch.int64 not in made and torch.int32 in made  # past reading its int64 inputs, all 32-bit
