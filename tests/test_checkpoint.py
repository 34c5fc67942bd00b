"""Loading the checkpoint: names, E2B figures, preflight, errors, both load paths, tokens.

Every ``torch.equal`` here compares data identical by construction: integer codes, packed words,
weights, rows gathered and dequantized exactly (one rounding to bf16, as the checkpoint's
values were made), or one program's output twice. Two programs are compared within a dtype's
tolerance or by the series' token verdict instead."""

import json
import pathlib

import pytest
import torch

import helpers
from helpers import checkpoint as ck
from helpers import generate, packed
from helpers.course import audits, e2b, hub, offline, series, verdict


@pytest.fixture(scope="module")
def tiny():
    return hub.Checkpoint(str(offline.build_tiny_twin()), None, True, "test")


def _one_line(err):
    text = str(err.value)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize(
    "ckpt, text",
    [
        ("model.language_model.layers.3.mlp.up_proj.weight_packed", "model.layers.3.mlp.up_proj.weight_packed"),
        ("model.language_model.embed_tokens_per_layer.weight", "model.embed_tokens_per_layer.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ],
)
def test_name_mapping_both_ways(ckpt, text):
    assert packed.text_key(ckpt) == text and packed.checkpoint_key(text) == ckpt


def test_towers_map_to_nothing():
    assert packed.text_key("model.vision_tower.encoder.layers.0.mlp.fc1.weight") is None
    assert packed.text_key("model.audio_tower.layers.0.norm_out.weight") is None


def test_name_map_accounts_for_every_tensor(tiny):
    rows = {r["checkpoint"]: r for r in audits.name_map(tiny.path)}
    assert rows["model.language_model.*"]["text model"] == "model.*"
    assert "tied" in rows["lm_head.weight"]["text model"]
    assert rows["model.vision_tower.*"]["text model"].startswith("not read")


def test_e2b_bytes_on_the_meta_device_equal_the_reference_figures():
    rows = {r["component"]: r for r in e2b.component_bytes(e2b.meta_model(e2b.real_config()))}
    assert (rows["embed_tokens"]["bf16_bytes"], rows["embed_tokens"]["int4_bytes"]) == (805_306_368, 226_492_416)
    assert (rows["embed_tokens_per_layer"]["bf16_bytes"], rows["embed_tokens_per_layer"]["int4_bytes"]) == (
        4_697_620_480,
        1_321_205_760,
    )
    assert rows["lm_head copy"]["bf16_bytes"] == 805_306_368
    assert rows["embed_tokens_per_layer"]["shape"] == [262144, 8960]


def test_e2b_kv_cache_bytes_equal_the_reference_figures():
    config = e2b.real_config()
    assert e2b.kv_cache_bytes(config, 131_328) == 2_420_637_696  # 15 cache-owning layers, full length
    assert e2b.kv_cache_bytes(config, 131_328, ring=True) == 813_170_688  # sliding layers keep 512 slots


def test_preflight_refuses_with_the_numbers_and_what_to_change():
    config, cpu = e2b.real_config(), helpers.get_backend("cpu")
    with pytest.raises(ck.CheckpointError) as err:
        hub.preflight(config, cpu, dequantize=True, available=4 * 10**9, where="v5e-1")
    text = _one_line(err)
    assert "9.26 GB" in text and "4.00 GB" in text and "HELPERS_MODEL=tiny" in text
    assert "fits" in hub.preflight(config, cpu, dequantize=True, available=16 * 2**30)


def _gated(*args, **kwargs):
    from huggingface_hub.errors import GatedRepoError

    err = GatedRepoError.__new__(GatedRepoError)  # as the Hub raises it, without an HTTP response
    Exception.__init__(err, "403: access to model is restricted")
    raise err


def test_a_public_repository_is_read_without_a_token_and_none_is_looked_up(monkeypatch, tmp_path):
    import huggingface_hub

    asked, downloads = [], []
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: pytest.fail("a token was looked up"))
    monkeypatch.setattr(huggingface_hub, "auth_check", lambda repo, token=None: asked.append(token))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: downloads.append(k) or str(tmp_path))
    monkeypatch.delenv("HELPERS_MODEL", raising=False)
    chosen = hub.choose_checkpoint(TPU)
    assert not chosen.tiny and chosen.source == hub.REPO_ID and "(public)" in chosen.reason
    assert chosen.path == tmp_path
    assert asked == [False, False] and downloads[0]["token"] is False  # False: not even a stored token is sent


def test_a_gated_repository_without_a_token_is_one_clear_line_before_any_download(monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    monkeypatch.setattr(huggingface_hub, "auth_check", _gated)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("download started"))
    with pytest.raises(ck.CheckpointError) as err:
        hub.fetch(hub.Checkpoint(hub.REPO_ID, None, False, "test"))
    assert "the Hub says google/" in _one_line(err) and "is gated" in _one_line(err) and "HF_TOKEN" in _one_line(err)


def test_a_checkpoint_is_read_from_its_folder_only_never_fetched_on_the_way(monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("download started"))
    with pytest.raises(ck.CheckpointError) as err:
        ck.load(hub.Checkpoint(hub.REPO_ID, None, False, "made by hand").path, helpers.get_backend("cpu"))
    assert "was not fetched" in _one_line(err) and "helpers.course.hub.fetch" in _one_line(err)


def test_a_gated_repository_is_read_with_the_token_once_the_hub_says_so(monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_test")
    monkeypatch.setattr(huggingface_hub, "auth_check", lambda repo, token=None: token or _gated())
    monkeypatch.delenv("HELPERS_MODEL", raising=False)
    assert hub._hub_access(hub.REPO_ID) == ("hf_test", None)
    assert "with your token" in hub.choose_checkpoint(TPU, fetch_it=False).reason


def test_licence_not_accepted_is_one_clear_line(monkeypatch):
    import huggingface_hub

    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.setattr(huggingface_hub, "auth_check", _gated)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("download started"))
    with pytest.raises(ck.CheckpointError) as err:
        hub.fetch(hub.Checkpoint(hub.REPO_ID, None, False, "test"))
    assert "accept its licence at https://huggingface.co/google/" in _one_line(err)
    assert "HELPERS_MODEL" in str(err.value)


def _policy_only(name: str):
    """A backend of ``name`` without its hardware: choose_checkpoint reads only its policy."""
    from helpers.backend import Backend

    backend = object.__new__(Backend)
    backend.name, backend.device = name, torch.device("cuda" if name == "cuda" else "cpu")
    return backend


TPU = _policy_only("tpu")


def test_a_token_stored_by_login_is_found(monkeypatch, tmp_path):
    import huggingface_hub

    monkeypatch.delenv("HF_TOKEN", raising=False)
    (tmp_path / "token").write_text("hf_from_login\n")  # where huggingface_hub.login() stores it
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    assert hub.hf_token() == "hf_from_login"


def _hub_down(monkeypatch, error):
    import huggingface_hub

    monkeypatch.delenv("HELPERS_MODEL", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.setattr(huggingface_hub, "auth_check", lambda *a, **k: (_ for _ in ()).throw(error))


@pytest.mark.parametrize("error", ["offline", "connect", "503"])
def test_hub_unreachable_takes_the_twin_with_one_line_saying_why(monkeypatch, tmp_path, error):
    import importlib

    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, HTTPError, OfflineModeIsEnabled

    http = importlib.import_module(HTTPError.__module__)  # what the pinned huggingface_hub speaks HTTP with (httpx)
    request = http.Request("GET", f"https://huggingface.co/api/models/{hub.REPO_ID}/auth-check")
    errors = {
        "offline": OfflineModeIsEnabled("offline mode is enabled"),
        "connect": http.ConnectError("[Errno 111] Connection refused", request=request),
        "503": HfHubHTTPError("503 Service Unavailable", response=http.Response(503, request=request)),
    }
    _hub_down(monkeypatch, errors[error])
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))  # nothing cached
    chosen = hub.choose_checkpoint(TPU)
    assert chosen.tiny and "the Hub is unreachable" in str(chosen) and "nothing is cached" in str(chosen)
    assert "\n" not in str(chosen)


def test_hub_unreachable_takes_the_cached_snapshot(monkeypatch, tmp_path):
    import huggingface_hub
    from huggingface_hub.errors import OfflineModeIsEnabled

    repo = tmp_path / "models--google--gemma-4-E2B-it-qat-w4a16-ct"  # the Hub cache's own layout
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd" * 5)
    snapshot = repo / "snapshots" / ("0123abcd" * 5)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    _hub_down(monkeypatch, OfflineModeIsEnabled("offline mode is enabled"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    chosen = hub.choose_checkpoint(TPU)
    assert not chosen.tiny and chosen.source == hub.REPO_ID and "cached snapshot" in chosen.reason
    assert chosen.path == snapshot


def test_unload_leaves_no_tensor_behind_even_with_compressed_tensors_cycles(tiny, capsys):
    model, _ = ck.load(tiny.path, helpers.get_backend("cpu"), dtype=torch.float32)
    with torch.no_grad():
        model(torch.tensor([[2, 5, 7]]))  # the first forward decompresses and wraps every module's forward
    assert ck.compression_report(model)[0]["count"] > 0  # forwards bound onto modules: reference cycles
    kept = model  # a second reference, as a notebook's output history may hold
    ck.unload(model, helpers.get_backend("cpu"))
    assert {r["device"] for r in audits.memory_report(kept)} == {"meta"}
    assert "unloaded the model (" in capsys.readouterr().out


def test_not_a_gemma_checkpoint_is_one_clear_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ck.CheckpointError) as err:
        ck.read_config(tmp_path)
    assert "'llama'" in _one_line(err) and "Gemma 4" in str(err.value)
    with pytest.raises(ck.CheckpointError) as err:
        ck.read_config(tmp_path / "nowhere")
    assert "config.json" in _one_line(err)


def test_choose_checkpoint_without_a_tpu_takes_the_twin_and_says_why(monkeypatch):
    monkeypatch.delenv("HELPERS_MODEL", raising=False)
    chosen = hub.choose_checkpoint(helpers.get_backend("cpu"))
    assert chosen.tiny and "no TPU or GPU here (backend cpu)" in str(chosen)
    monkeypatch.setenv("HELPERS_MODEL", "some/repo")
    monkeypatch.setenv("HELPERS_REVISION", "abc123")
    chosen = hub.choose_checkpoint(helpers.get_backend("cpu"), fetch_it=False)
    assert str(chosen).startswith("real checkpoint: some/repo @ abc123")


CUDA = _policy_only("cuda")  # its fit is stubbed below


def test_on_a_gpu_where_the_preflight_fits_googles_checkpoint_is_chosen_else_the_twin(monkeypatch):
    import huggingface_hub

    monkeypatch.delenv("HELPERS_MODEL", raising=False)
    monkeypatch.setattr(huggingface_hub, "auth_check", lambda repo, token=None: None)
    monkeypatch.setattr(hub, "real_model_fits", lambda backend: (True, "E2B needs ~9.4 GB, 15.1 GB free"))
    chosen = hub.choose_checkpoint(CUDA, fetch_it=False)
    assert not chosen.tiny and chosen.source == hub.REPO_ID
    assert chosen.reason == "a GPU where E2B fits (E2B needs ~9.4 GB, 15.1 GB free), and the Hub (public)"
    monkeypatch.setattr(hub, "real_model_fits", lambda backend: (False, "E2B needs ~9.4 GB, 7.5 GB free"))
    chosen = hub.choose_checkpoint(CUDA, fetch_it=False)
    assert chosen.tiny and "a GPU too small for E2B (E2B needs ~9.4 GB, 7.5 GB free)" in str(chosen)


@pytest.mark.parametrize("free", [15_000_000_000, 8_000_000_000, None])
def test_the_fit_is_the_preflights_estimate_against_the_devices_free_memory(free):
    in_use = 2_000_000_000  # free is what is left of the total
    memory = None if free is None else {"in_use": in_use, "peak": in_use, "total": free + in_use}
    device = type("FakeGPU", (), {"name": "cuda", "device": torch.device("cuda"), "memory": lambda self: memory})()
    fits, numbers = hub.real_model_fits(device)
    needed = e2b.estimate_device_bytes(e2b.real_config(), dequantize=False)
    assert fits == (free is not None and needed <= free) and f"E2B needs ~{needed / 1e9:.1f} GB" in numbers
    assert fits == (free == 15_000_000_000)  # a T4's 15 GB holds E2B's 9.4 GB; 8 GB does not


def test_default_path_holds_packed_int4_and_wrappers_until_the_first_forward(tiny, backend):
    model, _ = ck.load(tiny.path, backend)
    kinds = {r["kind"] for r in audits.memory_report(model)}
    assert {"packed int4", "int4 scales", "bf16"} <= kinds
    report = {r["what"]: r["count"] for r in ck.compression_report(model)}
    assert report["modules with a wrapped forward"] == 83 and report["modules with forward hooks"] == 1
    with torch.no_grad():  # no cache: a prompt shorter than the window trips HF's cache on xla (notebook 03)
        model(torch.tensor([[2, 5, 6]], device=backend.device), use_cache=False)
    assert "packed int4" not in {r["kind"] for r in audits.memory_report(model)}
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_dequantize_path_is_plain_dense_and_tied(tiny, backend):
    model, _ = ck.load(tiny.path, backend, dequantize=True)
    assert {r["kind"] for r in audits.memory_report(model)} == {"bf16", "buffers"}
    assert all(r["count"] == 0 for r in ck.compression_report(model))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(p.device.type == torch.device(backend.device).type for p in model.parameters())


def test_memory_report_counts_tied_weights_once(tiny):
    model, _ = ck.load(tiny.path, helpers.get_backend("cpu"), dequantize=True)
    total = sum(r["bytes"] for r in audits.memory_report(model) if r["kind"] == "bf16")
    assert total == sum(p.numel() * 2 for p in model.parameters())  # parameters() dedups too


def test_a_checkpoint_missing_a_text_tensor_is_refused(tiny, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny.source, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.language_model.layers.0.mlp.up_proj.weight_packed"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ck.CheckpointError, match="lacks"):
        ck.load(broken, helpers.get_backend("cpu"))


def test_both_paths_give_the_dequantized_references_tokens_where_unpack_is_exact(tiny, backend):
    ids = ck.chat_ids(ck.load_tokenizer(tiny.path), backend.device)
    n = 3 if backend.lazy else 8
    expected = verdict.check_tokens(backend, tiny, ids, n)
    assert len(expected) == n
    dense, _ = ck.load(tiny.path, backend, dequantize=True)
    # equal lists: the same class, weights and dtype on the same device, so the same program
    assert verdict.greedy_tokens(dense, ids, n) == expected
    del dense
    default, _ = ck.load(tiny.path, backend)
    assert (verdict.greedy_tokens(default, ids, n) == expected) == verdict.unpack_is_exact(backend.device)


def _shard(source, folder):
    """``source`` as a sharded set with an index, as larger repositories ship: every packed weight
    in one file, its scale and shape in the other, so each stem spans two files."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = {1: "model-00001-of-00002.safetensors", 2: "model-00002-of-00002.safetensors"}
    shard = {k: 1 if k.endswith("weight_packed") else 2 for k in tensors}
    for i, name in names.items():
        save_file({k: t for k, t in tensors.items() if shard[k] == i}, folder / name, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: names[i] for k, i in shard.items()}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return hub.Checkpoint(str(folder), None, True, "sharded")


def test_one_file_and_a_sharded_set_with_an_index_read_the_same(tmp_path, packed_table_twin):
    from helpers import qlinear, qtable

    single = hub.Checkpoint(str(packed_table_twin), None, True, "one file")
    sharded = _shard(pathlib.Path(single.source), tmp_path / "sharded")
    assert [p.name for p in pathlib.Path(single.source).glob("*.safetensors")] == ["model.safetensors"]
    cpu = helpers.get_backend("cpu")
    models = [ck.load(c.path, cpu, dtype=torch.float32, dequantize=True)[0] for c in (single, sharded)]
    one, two = (dict(m.state_dict()) for m in models)
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    references = [verdict.reference_model(c, torch.float32).state_dict() for c in (single, sharded)]
    assert all(torch.equal(references[0][k], references[1][k]) for k in references[0])
    tables = [
        qtable.QTable.from_checkpoint(c.path, "embed_tokens_per_layer", m.model.embed_tokens_per_layer)
        for c, m in zip((single, sharded), models)
    ]
    assert tables[1][1]["from"] == "packed in model-00001-of-00002.safetensors"
    assert torch.equal(tables[0][0].packed, tables[1][0].packed) and torch.equal(
        tables[0][0].scales, tables[1][0].scales
    )
    counts = [qlinear.keep_linears_compressed(m, c.path, "int4")["linears"] for c, m in zip((single, sharded), models)]
    assert counts[0] == counts[1] > 0


@pytest.fixture(scope="module")
def dense(tiny, tmp_path_factory):
    """What google/gemma-4-E2B-it-qat-q4_0-unquantized is: the same shapes, dense bf16 on the QAT
    grid, no quantization config (the twin's weights, dequantized)."""
    import shutil

    folder = tmp_path_factory.mktemp("qat") / "dense"
    verdict.reference_model(tiny, torch.bfloat16).save_pretrained(folder)
    for path in pathlib.Path(tiny.source).iterdir():
        if path.name.startswith(("tokenizer", "chat_template", "generation_config")):
            shutil.copy(path, folder / path.name)
    return hub.Checkpoint(str(folder), None, False, "dense, as the QAT repository")


def test_a_dense_bf16_checkpoint_like_the_qat_repository_loads_through_the_same_switch(tiny, dense):
    assert json.loads((pathlib.Path(dense.source) / "config.json").read_text()).get("quantization_config") is None
    cpu = helpers.get_backend("cpu")
    model, _ = ck.load(dense.path, cpu, dtype=torch.float32)
    ids = ck.chat_ids(ck.load_tokenizer(tiny.path), "cpu")
    reference, _ = ck.load(tiny.path, cpu, dtype=torch.float32, dequantize=True)
    # equal lists: bf16 values widened to float32 are the dequantized ones, so the same program runs
    assert verdict.greedy_tokens(model, ids, 8) == verdict.greedy_tokens(reference, ids, 8)
    assert {r["kind"] for r in audits.memory_report(model)} == {"fp32", "buffers"}


def test_the_qat_repositorys_linears_are_kept_compressed_from_their_own_grid(tiny, dense):
    from helpers import qlinear

    cpu = helpers.get_backend("cpu")
    model, _ = ck.load(dense.path, cpu, dtype=torch.float32)
    linears = {n: m.weight.detach().clone() for n, m in model.model.named_modules() if isinstance(m, torch.nn.Linear)}
    report = qlinear.keep_linears_compressed(model, dense.path, "int4")
    assert report["linears"] == len(linears) > 0 and report["from"] == "each dense weight's own 4-bit grid"
    for name, module in model.model.named_modules():
        if name in linears:  # the grid's codes and steps give each weight back bit for bit
            assert isinstance(module, qlinear.QLinear) and torch.equal(module.weight, linears[name]), name
    packed, _ = ck.load(tiny.path, cpu, dtype=torch.float32, dequantize=True)
    assert qlinear.keep_linears_compressed(packed, tiny.path, "int4")["linears"] == len(linears)  # the -ct export's
    ids = ck.chat_ids(ck.load_tokenizer(tiny.path), "cpu")
    reference = verdict.reference_model(tiny, torch.float32)
    expected = verdict.greedy_tokens(reference, ids, 8)
    assert verdict.compare_tokens(verdict.greedy_tokens(model, ids, 8), expected, reference, ids)


def test_a_checkpoint_with_no_packed_weights_and_linears_off_their_grid_is_refused(dense):
    from helpers import qlinear

    model, _ = ck.load(dense.path, helpers.get_backend("cpu"), dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] += 1e-3
    with pytest.raises(
        ValueError, match="layers.0.mlp.up_proj: 1 groups .* no 4-bit grid, and the checkpoint saved no"
    ):
        qlinear.keep_linears_compressed(model, dense.path, "int4")
    assert not any(isinstance(m, qlinear.QLinear) for m in model.modules())  # refused before any swap


def test_a_model_with_no_linear_to_keep_compressed_is_refused(dense):
    from helpers import qlinear

    bare = torch.nn.Module()
    bare.model = torch.nn.Module()  # a text model with no linear at all: 0 swaps is no measurement
    with pytest.raises(ValueError, match="no text linear to keep compressed"):
        qlinear.keep_linears_compressed(bare, dense.path, "int4")


def _greedy(model, ids, n):
    """Exactly ``n`` greedy tokens (no stop: the comparison is of every position)."""
    with torch.no_grad():
        out = model.generate(ids, generation_config=generate.greedy_config(model, n, stop=False))
    return out.sequences[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def teacher(tiny):
    """The reference model of the twin, a prompt it never learned, and 16 greedy tokens."""
    model = verdict.reference_model(tiny, torch.float32)
    ids = ck.encode(ck.load_tokenizer(tiny.path), "the ring cache and the table keep", "cpu")
    return model, ids, _greedy(model, ids, 16)


def _greedy_after(model, ids, prefix, n):
    """``prefix`` then ``model``'s greedy continuation, ``n`` tokens in all."""
    return prefix + _greedy(model, torch.cat([ids, torch.tensor([prefix])], dim=1), n - len(prefix))


def test_a_pair_that_parts_at_a_near_tie_is_the_same_and_names_the_tie(teacher):
    model, ids, reference = teacher
    gaps, ulps = verdict.teacher_forced_gaps(model, ids, reference)
    assert gaps.max() == 0  # the reference's own tokens are its argmaxes
    with torch.no_grad():
        logits = model(torch.cat([ids, torch.tensor([reference])], dim=1)).logits[0, ids.shape[1] - 1 :].float()
    top2 = logits.topk(2, dim=-1)
    p = int((top2.values[:-1, 0] - top2.values[:-1, 1]).argmin())  # the closest call among the tokens
    gap = float(top2.values[p, 0] - top2.values[p, 1])
    other = _greedy_after(model, ids, reference[:p] + [int(top2.indices[p, 1])], len(reference))
    tolerance = int(gap / float(ulps[p])) + 1  # the closest call as a stated tolerance, in float32 ulps
    judged = verdict.compare_tokens(other, reference, model, ids, tolerance_ulps=tolerance)
    assert judged and judged.first_divergence == p and judged.near_ties[0][0] == p
    assert judged.gap == pytest.approx(gap, rel=1e-4) and f"near tie(s) at [{p}" in str(judged)
    strict = verdict.compare_tokens(other, reference, model, ids, tolerance_ulps=0)
    assert not strict and strict.failed_at == p  # with no tolerance, the same pair is a fault
    assert not verdict.compare_tokens(other, reference)  # and as lists, for one program run twice


def test_a_list_that_stops_where_the_reference_goes_on_is_not_the_same(teacher):
    model, ids, reference = teacher
    judged = verdict.compare_tokens(reference[:-3], reference, model, ids)
    assert not judged and judged.failed_at == len(reference) - 3 and "the other goes on" in str(judged)
    same = verdict.compare_tokens(reference, reference, model, ids)
    assert same and same.dtype == "float32" and same.largest_ulps == 0 and "float32 ulps" in str(same)


def test_a_real_fault_fails_even_when_it_parts_late(teacher):
    import copy

    model, ids, reference = teacher
    faulty = copy.deepcopy(model)
    late = len(reference) - 4
    with torch.no_grad():  # a wrong row of the per-layer table: the one of the token fed after `late`
        faulty.model.embed_tokens_per_layer.weight[reference[late]] *= -3
    tokens = _greedy(faulty, ids, len(reference))
    parted = next(i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b)
    assert parted > late  # it parts late: every token before is the reference's
    judged = verdict.compare_tokens(tokens, reference, model, ids)
    assert not judged and judged.failed_at == parted and judged.first_divergence == parted
    assert judged.gap > verdict.NEAR_TIE_ULPS * 2**-7 * 30 and "no near tie" in str(judged)


def test_a_verdict_made_is_kept_and_a_dropped_reference_model_is_rebuilt_only_for_a_new_list(tiny, monkeypatch):
    """At full size the reference model is 9 GB, dropped while a step builds something large:
    asking again about tokens already judged must not rebuild it (measured: 06's host peak)."""
    built, compared = [], []
    monkeypatch.setattr(
        verdict, "reference_model", lambda checkpoint, dtype: built.append(dtype) or f"model {len(built)}"
    )
    monkeypatch.setattr(
        verdict, "compare_tokens", lambda tokens, *args: compared.append((tokens, args[1])) or len(compared)
    )
    judged = series.Series(tiny, None, None, torch.tensor([[2, 5]]), 3, [7, 8, 9], 3)
    assert judged.same_tokens([7, 8, 9, 4]) == 1  # beyond new_tokens: a timed run's extra token is not judged
    judged.drop_reference_model()
    assert judged.same_tokens([7, 8, 9]) == 1 and len(built) == 1  # the same list: no rebuild, no new forward
    assert judged.same_tokens([7, 8, 6]) == 2 and compared[-1] == ([7, 8, 6], "model 2")  # a new list: rebuilt
    assert built == [torch.float32] * 2 and len(compared) == 2  # the twin's reference in its series dtype
