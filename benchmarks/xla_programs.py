"""The series' compiled programs at E2B's shapes, as XLA compiles them (issue 25): for each
program notebooks 04-07 hand the compiler (the prefill and the decode step of each model, the
ring's prefill chunk and step at 131,328 positions, notebook 07's variants), the audit of
``helpers.course.audits``: 64-bit integer ops, the KV cache buffers aliased input to output (and
the bytes copied per call where not), the largest intermediate, and the program's memory as
XLA's buffer assignment sizes it (inputs, outputs, temporaries: the most it holds at once),
beside the 15.75 GiB a TPU v5e-1 gives programs (``helpers.backend.V5E_HBM_BYTES``); the CPU compiler's
float32 copies of bf16 inputs, which a TPU never makes, are shown apart.

    .venv-xla/bin/python benchmarks/xla_programs.py [--max-len 256] [--ks 1 4] [--variants ...]

Computed by XLA's CPU compiler (PyTorch/XLA's CPU client), not a TPU's: the TPU compiler fuses
and lays out differently, so its figures differ, but what a program takes as input, aliases and
computes in 64-bit integers is the program's own. The weights are zeros with the real shapes and
dtypes (the model is built from the checkpoint's configuration on the meta device, then
allocated on the device): a program does not depend on the values it is given. Notebook 07's
linears come from the checkpoint's own packed codes (``HELPERS_MODEL``: the synthetic E2B by
default, built once into the cache; ``tiny``: the twin, in a minute).
"""

import argparse
import os
import pathlib
import time

os.environ.setdefault("HELPERS_BACKEND", "xla")
os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import helpers
from helpers import decode, roofline
from helpers.course import audits, e2b, hub
from helpers.course.offline import SYNTHETIC
from helpers.course.report import fmt_bytes, table
from helpers.fused import fuse_projections
from helpers.qlinear import keep_linears_compressed
from helpers.qtable import QTable, keep_embed_in_4bit
from helpers.ring import RingDecoder, group_query_heads

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--max-len", type=int, default=256, help="positions the static cache holds (04, 05, 07)")
parser.add_argument("--ks", type=int, nargs="*", default=[1], help="notebook 07's K tokens per call")
parser.add_argument(
    "--ring-chunk",
    type=int,
    default=128,
    help="the ring's prefill chunk (notebook 06: one window, 512 at E2B; at 131,328 positions that program's"
    " float32 attention scores took this 24 GB host out of memory when it ran, after it compiled)",
)
parser.add_argument(
    "--variants",
    nargs="*",
    default=["int4 linears", "4-bit head", "fused"],
    help="notebook 07's variants after the 4-bit table, in order",
)
args = parser.parse_args()

os.environ.setdefault(helpers.backend.AUDIT_VAR, "1")  # before the backend starts: XLA reads its flags once
os.environ.setdefault("HELPERS_MODEL", SYNTHETIC)
backend = helpers.get_backend()
if not backend.lazy:
    raise SystemExit(f"this reads what XLA compiles: run it with the xla backend (got {backend.name})")
folder = helpers.backend.dump_folder()
checkpoint = hub.choose_checkpoint(backend)
print(helpers.course.hub.describe(backend))
print(checkpoint, "| XLA dumps into a temporary folder,", pathlib.Path(folder).name)  # no machine path in the output

config = AutoConfig.from_pretrained(checkpoint.path).get_text_config()
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # as loading makes it: buffers too
model.to_empty(device="cpu")  # allocated on the host first: a device's empty() is lazy work for XLA
for tensor in [*model.parameters(), *model.buffers()]:
    tensor.data.zero_()
model.to(backend.device)  # tensor by tensor: each host copy is freed once it is on the device
model.tie_weights()
model.eval()
print(f"the text model, zeros: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} G parameters")

ids = torch.arange(3, 3 + 28, device=backend.device)[None]  # 28 tokens, as the series' chat prompt
rows = []
whole = f"{config.vocab_size},{config.hidden_size}"  # the main table's shape, as HLO writes it


def audit(what: str, decoder) -> None:
    """Compile ``decoder``'s programs (a run of a few tokens) and add a row for each."""
    torch.compiler.reset()
    shapes = {audits.hlo_shape(t) for t in decode.kv_buffers(decoder.cache)}
    start = time.perf_counter()
    with audits.captured(folder) as compiled:
        decoder.generate(ids, 1 + 2 * getattr(decoder, "tokens_per_call", 1), stop_ids=())
    seconds = time.perf_counter() - start
    for program in compiled:
        row = audits.audit(program, shapes)
        if not row["cache_buffers"]:
            continue  # not one of the decoder's programs (a copy, a seed)
        step = any(s.startswith("s64[1,1]") for s in audits.parameters(program.hlo).values())  # fed one token
        rows.append(
            {
                "what": what,
                "program": f"{'step' if step else 'prefill'} ({row['program'].split('.')[0]})",
                "s64_ops": row["s64_ops"],
                "s64_kinds": row["s64_kinds"],
                "s64_largest": row["s64_largest_shape"],
                "cache_aliased": f"{row['cache_aliased']}/{row['cache_buffers']}",
                "copied_per_call": fmt_bytes(row["cache_bytes_copied"]),
                "largest_intermediate": fmt_bytes(row["largest_intermediate"]),
                "largest_is": row["largest_is"][:60],
                "inputs": fmt_bytes(row["parameters_bytes"]),
                "temporaries": fmt_bytes(row["temporaries_bytes"]),
                "f32_input_copies": fmt_bytes(row["upcast_bytes"]),
                "total": fmt_bytes(row["total_bytes"]),
                "total_less_copies": fmt_bytes(row["total_bytes"] - row["upcast_bytes"]),
                "of_v5e_limit": f"{100 * row['total_bytes'] / helpers.backend.V5E_HBM_BYTES:.0f}%",
                "bytes": row["total_bytes"],
                "table_made_whole": any(
                    shape.split("{")[0] in (f"f32[{whole}]", f"bf16[{whole}]")
                    for allocation in audits.temporaries(program)
                    for _, _, _, shape in allocation
                ),
                "first_run_s": round(seconds, 1),
            }
        )
    hidden = ("bytes", "table_made_whole", "largest_is")
    print(table([{k: v for k, v in r.items() if k not in hidden} for r in rows if r["what"] == what]))


audit("04 compiled decode (bf16 per-layer table)", decode.Decoder(model, backend, args.max_len))

# 05: the per-layer table as notebook 05 keeps it: a row of packed int4 words and float32 steps
# (E2B's are finer than bf16), padded to 128 words; here zeros of that shape
old = model.model.embed_tokens_per_layer
model.model.embed_tokens_per_layer = QTable(
    old.num_embeddings, old.embedding_dim, old.scalar_embed_scale, old.weight.dtype, backend.device
)
del old
backend.flush()
audit("05 4-bit table", decode.Decoder(model, backend, args.max_len))
# notebook 06's attention, kept for 07: the query heads grouped over their one K/V head
print("attention:", group_query_heads(model), "->", model.config._attn_implementation)
# at 131,328 positions each full layer's chunk scores every position the ring holds
ring_chunk = min(args.ring_chunk, config.sliding_window)  # no longer than the window (RingCache)
ring = RingDecoder(model, backend, e2b.CONTEXT, chunk_size=ring_chunk)
for chunk in sorted({ring_chunk, config.sliding_window}):
    sizes = e2b.full_attention_bytes(config, e2b.CONTEXT, chunk)
    print(
        f"a prefill chunk of {chunk} at {e2b.CONTEXT:,} positions, in a full layer (computed): float32 scores"
        f" {fmt_bytes(sizes['scores'])}; K repeated for each query head, as transformers' attention would,"
        f" {fmt_bytes(sizes['k_repeated'])} in bf16"
    )
audit(f"06 ring cache, {e2b.CONTEXT:,} positions, chunks of {ring_chunk}", ring)
del ring  # its cache: 0.81 GB at E2B

for k in args.ks:
    if k > 1:
        audit(f"07 past the source, K={k}", roofline.KDecoder(model, backend, args.max_len, k))


def head_in_4bit() -> dict:
    """Notebook 07's 4-bit head: the main table's grid recovered on the host (zeros: on any grid),
    the packed table and its tied head back on the device."""
    model.model.embed_tokens.to("cpu")
    report = keep_embed_in_4bit(model)
    model.model.embed_tokens.to(backend.device)
    return report


changes = {
    "int4 codes a byte each": lambda: keep_linears_compressed(model, checkpoint.path, "int4-bytes"),
    "int4 linears": lambda: keep_linears_compressed(model, checkpoint.path, "int4"),
    "4-bit head": head_in_4bit,
    "fused": lambda: fuse_projections(model),
}
labels = {"4-bit head": "+ 4-bit head", "fused": "+ fused q/k/v, gate/up"}  # each after the ones before
for name in args.variants:
    if name not in changes:
        raise SystemExit(f"unknown variant {name!r}: pick from {list(changes)}")
    print(name, changes[name]())
    backend.flush()
    audit(f"07 past the source, {labels.get(name, name)}", decode.Decoder(model, backend, args.max_len))

print(f"\n{checkpoint.name}: every program, as XLA's CPU compiler assigned its buffers")
print(table([{k: v for k, v in r.items() if k not in ("bytes", "table_made_whole")} for r in rows]))
worst = max(rows, key=lambda r: r["bytes"])
print(
    f"largest program: {worst['what']} ({worst['program']}), {worst['total']} on XLA's CPU compiler"
    f" ({worst['total_less_copies']} without its float32 copies of bf16 inputs), {worst['of_v5e_limit']} of the"
    f" {helpers.backend.V5E_HBM_BYTES / 2**30} GiB a v5e-1 gives programs"
)
head = [r for r in rows if "4-bit head" in r["what"] and r["program"].startswith("step")]
if head:
    print(
        f"the 4-bit head's step: largest intermediate {head[0]['largest_intermediate']} ({head[0]['largest_is']});"
        f" the main table dequantized ([{whole}], {fmt_bytes(config.vocab_size * config.hidden_size * 2)} in bf16):"
        f" {'made whole' if head[0]['table_made_whole'] else 'never made whole (fused into its matmul)'}"
    )
