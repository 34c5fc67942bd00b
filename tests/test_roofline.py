"""The roofline: bytes a decode step reads from the tensors, the read probe, E2B's figures by
step and variant, K tokens per compiled call, and the linears kept compressed (notebook 07).

Every ``torch.equal`` here compares data identical by construction: integer codes, packed words,
weights, rows gathered and dequantized exactly (one rounding to bf16, as the checkpoint's
values were made), or one program's output twice. Two programs are compared within a dtype's
tolerance or by the series' token verdict instead."""

import copy

import pytest
import torch

import helpers
from conftest import linear_rows, within_bf16_rounding
from helpers import decode as d
from helpers import fused, int4, packed, qlinear, qtable, roofline
from helpers.course import (
    audits,
    e2b,
    measure,
    verdict,
)


@pytest.fixture(scope="module")
def series():
    return helpers.course.series.prepare(helpers.get_backend(), after=5)  # notebook 05's model


def test_e2b_figures_by_step_meet_the_targets_and_the_sources_ceilings():
    rows = {r["step"]: r for r in e2b.step_figures()}
    # the tables' float32 steps (exact for Google's tables), rows padded for a TPU: 6.04 GB at step 05
    assert round(rows["05 4-bit table"]["weights_on_device"] / 1e9, 2) == 6.04
    assert round(rows["04 compiled decode"]["ceiling_tok_s"]) == 179  # all bf16: 4.57 GB a token
    assert round(rows["07 past the source, int4 linears"]["ceiling_tok_s"], -1) == 440  # int4 linears, bf16 head: ~438
    best = rows[
        "07 past the source, int4 linears, 4-bit head"
    ]  # under 2.8 GB but for the tables' 25 MB of padding for a TPU
    assert 2.8e9 < best["weights_on_device"] < 2.8e9 + 25_165_824 and best["bytes_per_token"] < 1.4e9
    ring = rows["06 ring cache, 131,328 positions"]  # held once, read by every layer that reads it
    # the source's 813,170,688 B and the decoder's 16 spare slots: 12 sliding owners x 16 x K and V x 256 x bf16
    assert ring["cache_held"] == 813_170_688 + 12 * 16 * 2 * 256 * 2
    assert ring["cache_read"] == e2b.kv_read_bytes(e2b.real_config(), 131_328, True, spare=16)


def test_step_bytes_counts_each_tensor_once_one_row_of_the_gathered_table_and_the_cache(series):
    model = series.model
    decoder = d.Decoder(model, helpers.get_backend(), max_len=64)
    table = model.model.embed_tokens_per_layer
    every = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    in_table = {id(t) for t in [*table.parameters(), *table.buffers()]}
    whole = sum(t.numel() * t.element_size() for k, t in every.items() if k not in in_table)
    row = packed.table_row_words(table.embedding_dim) * 4  # one packed row: codes, steps, padding to 128 words
    assert row % (packed.TPU_ROW_WORDS * 4) == 0 and row > table.words * 4 + table.groups * 4
    read = d.cache_read_bytes(model, decoder.cache)  # each layer reads its buffers or its owner's
    assert read > d.cache_bytes(decoder.cache)  # K/V-sharing layers read what others hold
    assert roofline.step_bytes(model, decoder.cache) == whole + row + read


def test_the_read_probe_and_the_columns():
    bandwidth, how = measure.read_bandwidth(helpers.get_backend())
    assert bandwidth > 1e8 and how.startswith(("measured", "published"))
    cols = roofline.columns(2_000_000, 50.0, 1e9)
    assert cols == {"bytes_per_token": 2_000_000, "GB_per_s": 0.1, "pct_of_bw": 10.0, "ceiling_tok_s": 500.0}


def test_k_tokens_per_call_give_the_same_tokens_with_one_compilation(series):
    backend, k = helpers.get_backend(), 3  # not a divisor of the lengths asked: the last call overshoots
    torch.compiler.reset()
    decoder = roofline.KDecoder(series.model, backend, max_len=128, tokens_per_call=k)
    with backend.compile_counter() as count:
        tokens = decoder.generate(series.ids, series.new_tokens)
    assert series.same_tokens(tokens) and count.graphs == 2  # the prefill bucket and the K-step program
    with backend.compile_counter() as again, measure.no_recompiles():
        exact = decoder.generate(series.ids, 11, stop_ids=())
    assert again.graphs == 0 and len(exact) == 11  # not a multiple of K: the last call's extra dropped
    with pytest.raises(ValueError, match=f"\\+ {k - 1}: the last call's"):
        decoder.generate(series.ids, 128 - series.ids.shape[1])


def test_matvec_loops_make_every_one_row_matmul_a_loop_with_the_same_tokens_and_one_compilation(series):
    from torch._dynamo.utils import counters

    backend = helpers.get_backend()
    if backend.use_matvec_loops() is None:
        pytest.skip("inductor's decompose_mm_pass decomposes one-row matmuls on the CPU only")
    model = copy.deepcopy(series.model)
    qlinear.keep_linears_compressed(model, series.checkpoint.path, "int4-bytes")  # dequantized inside the loops
    torch.compiler.reset()
    before = counters["inductor"]["decompose_mm"]
    decoder = d.Decoder(model, backend, max_len=64, **backend.use_matvec_loops())
    # no compiled-graph cache: a cache hit skips the passes, and the count of what they did
    with torch._inductor.config.patch(fx_graph_cache=False), backend.compile_counter() as count:
        tokens = decoder.generate(series.ids, series.new_tokens)
    assert series.same_tokens(tokens) and count.graphs == 2
    # every matmul with a weight in the step (the head among them), and the prefill's on its last real row alone: the
    # layers that keep no K/V and the head
    last = torch.tensor([series.ids.shape[1] - 1], device=series.ids.device)
    d.set_length(decoder.cache, 0)
    one_row_in_prefill = [r for r, _ in linear_rows(decoder.prefill_forward, series.ids, last)].count(
        1
    )  # eager: the same
    assert (
        counters["inductor"]["decompose_mm"] - before
        == fused.linear_calls(model, series.ids[:, :1]) + one_row_in_prefill
    )


def test_matvec_loops_round_a_dequantized_weight_to_bf16_as_eager_code_does():
    backend = helpers.get_backend("cpu")
    torch.manual_seed(0)
    codes = torch.randint(-8, 8, (256, 512), dtype=torch.int8)
    scales = torch.rand(256, 512 // 32).bfloat16()  # like the checkpoint's: codes x scales needs rounding
    linear = qlinear.QLinear.of(codes, scales, torch.float32, "int4-bytes")
    x = torch.randn(1, 1, 512)
    compiled = backend.compile(linear, **backend.use_matvec_loops())(x)
    torch.testing.assert_close(compiled, linear(x), rtol=1e-5, atol=1e-4)  # unrounded: ~0.3 off


@pytest.mark.parametrize("fmt", ["int4-bytes", "int4"])
def test_linears_kept_compressed_are_the_checkpoints_weights_and_give_the_same_tokens(series, fmt):
    model = copy.deepcopy(series.model)
    dense = {n: m.weight.detach().clone() for n, m in model.model.named_modules() if isinstance(m, torch.nn.Linear)}
    report = qlinear.keep_linears_compressed(model, series.checkpoint.path, fmt)
    assert report["linears"] == len(dense) > 0  # every text linear: the checkpoint packed them all
    per_weight = {"int4-bytes": 1, "int4": 0.5}[fmt] + 2 / 32
    assert report["bytes after"] == sum(w.numel() for w in dense.values()) * per_weight
    for name, module in model.model.named_modules():
        if name in dense:
            assert isinstance(module, qlinear.QLinear) and torch.equal(module.weight, dense[name]), name
    # eager here; compiled (one graph per shape), in notebook 07 and the tour
    assert series.same_tokens(verdict.greedy_tokens(model, series.ids, series.new_tokens))


@pytest.mark.parametrize("fmt", [None, "int4"])
def test_fused_projections_are_fewer_matmuls_of_the_same_weights_and_give_the_same_tokens(series, fmt):
    model = copy.deepcopy(series.model)
    if fmt:
        qlinear.keep_linears_compressed(model, series.checkpoint.path, fmt)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    q, k, v, gate = (m.weight.detach().clone() for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj))
    calls = fused.linear_calls(model, series.ids)
    weights = sum(r["bytes"] for r in audits.memory_report(model))
    report = fused.fuse_projections(model)
    layers = model.model.layers
    owning = sum(not layer.self_attn.is_kv_shared_layer for layer in layers)
    assert report == {"linears fused": 3 * owning + 2 * len(layers), "matmuls now": owning + len(layers)}
    assert fused.linear_calls(model, series.ids) == calls - 2 * owning - len(layers)
    assert torch.equal(attn.qkv.linear.weight, torch.cat([q, k, v])) and torch.equal(mlp.gate_proj.weight, gate)
    assert attn.qkv._last is None  # no activation held between forwards
    assert sum(r["bytes"] for r in audits.memory_report(model)) == weights  # concatenated once, the parts freed
    # eager here; compiled (one graph per shape), in notebook 07 and the tour
    assert series.same_tokens(verdict.greedy_tokens(model, series.ids, series.new_tokens))
    with pytest.raises(ValueError, match="fused already"):
        fused.fuse_projections(model)
    with pytest.raises(ValueError, match="compressed first, then fuse"):
        qlinear.keep_linears_compressed(model, series.checkpoint.path, "int4-bytes")


def _bf16_twin(series):
    """The twin's checkpoint loaded in bf16, as E2B runs (dense at load, compressed-tensors' wrappers stripped)."""
    model, _ = helpers.checkpoint.load(series.checkpoint.path, helpers.get_backend("cpu"), torch.bfloat16, True)
    d.strip_compressed_wrappers(model)
    return model


def test_in_bf16_every_linear_goes_through_torchs_int4_kernel_exactly_fused_too(series):
    """The twin in bf16 (as E2B runs): every linear repacked for torch's CPU int4 kernel, its weight read back through
    the kernel the checkpoint's values exactly; fused, the same rows; the logits within bf16's tolerance of the same
    model dequantizing in the step. Its int8 kernel is refused (the checkpoint's scales change every group)."""
    dequantized = _bf16_twin(series)
    dense = {
        n: m.weight.detach().clone() for n, m in dequantized.model.named_modules() if isinstance(m, torch.nn.Linear)
    }
    model = copy.deepcopy(dequantized)
    qlinear.keep_linears_compressed(dequantized, series.checkpoint.path, "int4")
    report = qlinear.keep_linears_compressed(model, series.checkpoint.path, "int4", "cpu")
    assert report["through torch's kernel"] == f"{len(dense)} of {len(dense)}"
    for name, module in model.model.named_modules():
        if name in dense:
            assert module.kernel == "cpu" and torch.equal(module.weight, dense[name]), name
            codes, scales = module.unpacked()
            assert torch.equal(int4.dequantize(codes, scales, torch.bfloat16), dense[name])
    attn = model.model.layers[0].self_attn
    q, k, v = (dense[f"layers.0.self_attn.{p}_proj"] for p in "qkv")
    fused.fuse_projections(model)
    assert attn.qkv.linear.kernel == "cpu" and torch.equal(attn.qkv.linear.weight, torch.cat([q, k, v]))
    with torch.no_grad():
        got, expected = (m(series.ids).logits.float() for m in (model, dequantized))
    torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05)  # bf16 sums in two orders, over 10 layers
    as_bytes = _bf16_twin(series)
    bytes_report = qlinear.keep_linears_compressed(as_bytes, series.checkpoint.path, "int4-bytes", "cpu")
    int8 = [(n, m) for n, m in as_bytes.model.named_modules() if getattr(m, "kernel", None)]
    assert bytes_report["through torch's kernel"] == f"{len(int8)} of {len(dense)} (per-group scales differ within " + (
        "a row: torch's int8 kernel takes one scale a row)"
    )
    assert len(int8) < len(dense) and all(torch.equal(m.weight, dense[n]) for n, m in int8)


def test_in_float32_the_kernel_is_refused_and_says_why(series):
    model = copy.deepcopy(series.model)
    report = qlinear.keep_linears_compressed(model, series.checkpoint.path, "int4", "cpu")
    assert report["through torch's kernel"].startswith("0 of ") and "torch.float32" in report["through torch's kernel"]
    assert not any(getattr(m, "kernel", None) for m in model.modules())


def test_the_int8_kernel_takes_codes_a_byte_each_where_a_row_has_one_scale():
    codes = torch.randint(-8, 8, (32, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    scales = (torch.rand(32, 1, generator=torch.Generator().manual_seed(1)) / 7).bfloat16().expand(32, 2)
    linear = qlinear.QLinear.of(codes, scales, torch.bfloat16, "int4-bytes", "cpu")
    assert linear.kernel == "cpu" and linear.scales.shape == (32,)
    assert torch.equal(linear.weight, int4.dequantize(codes, scales, torch.bfloat16))
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    within_bf16_rounding(linear(x), x, linear.weight)


def test_a_4bit_head_through_the_kernel_reads_its_own_copy_and_the_main_table_one_row(series):
    model = _bf16_twin(series)
    qtable.keep_embed_in_4bit(model)
    hidden = torch.randn(1, 2, model.config.get_text_config().hidden_size).bfloat16()
    before = roofline.step_bytes(model)
    table = model.model.embed_tokens
    report_head = qtable.QHead(table, "cpu")
    assert report_head.kernel == "cpu" and report_head.passes == 2  # the twin's steps finer than bf16: two bf16 pieces
    model.lm_head = report_head
    within_bf16_rounding(model.lm_head(hidden), hidden, table.dequantized(), roundings=3)
    row = table.table[0].numel() * table.table.element_size()
    codes, scales = (t.numel() * t.element_size() for t in (report_head.codes, report_head.scales))
    copy_bytes = 2 * codes + scales  # the codes read once a pass
    held = sum(t.numel() * t.element_size() for t in helpers.checkpoint.unique_tensors(table).values())
    assert roofline.step_bytes(model) == before - held + row + copy_bytes  # a gathered table: its row, as the per-layer


def test_a_linear_on_its_grid_converts_exactly_and_one_off_it_is_refused():
    from helpers.course import offline

    linear = torch.nn.Linear(64, 16, bias=False)
    with torch.no_grad():
        linear.weight.copy_(offline.on_grid(linear.weight)[0])
    x = torch.randn(3, 64)
    for fmt in qlinear.FORMATS:  # equal: three rows go through F.linear itself, of the same values
        assert torch.equal(qlinear.QLinear.from_linear(linear, fmt)(x), linear(x))
    with torch.no_grad():
        linear.weight[0, 0] += 1e-3
    with pytest.raises(ValueError, match="1 groups of this linear's weight are on no 4-bit grid"):
        qlinear.QLinear.from_linear(linear, "int4-bytes")


def test_a_calls_cost_on_a_v5e_is_its_verify_and_its_drafts_and_grows_with_k():
    """Notebook 09's headline, from the configuration: a verify of K+1 rows reads the step's bytes once (its arithmetic
    adds a little), each draft the assistant's weights; at K = 4 about 1.3 steps (vLLM measured 346 / 144 = 2.4x)."""
    call = e2b.call_figures(k=4)
    assert 1.0 < call["verify_steps"] < 1.05 and 0.2 < call["drafts_steps"] < 0.35
    assert call["call_steps"] == pytest.approx(call["verify_steps"] + call["drafts_steps"])
    assert call["x_one_token"] == pytest.approx(3.21 / call["call_steps"])
    costs = [e2b.call_figures(k=k)["call_steps"] for k in (1, 2, 4, 6)]
    assert costs == sorted(costs) and costs[0] > 1
