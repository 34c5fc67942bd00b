"""Where a model's bytes are, by kind and device; how a checkpoint's tensor names land in the text model; and the
programs XLA is handed, read from the ``xla`` backend's dumps: 64-bit integer ops (pairs of 32-bit ones on a TPU), the
KV cache aliased or copied per step, the largest intermediate, memory. TorchTPU's StableHLO is not read."""

import contextlib
import dataclasses
import math
import pathlib
import re

import torch

from ..packed import CHECKPOINT_PREFIX, TEXT_PREFIX, CheckpointTensors, text_key


def tensor_kind(name: str, tensor: torch.Tensor) -> str:
    """What a model tensor holds, by its name and dtype: packed int4, its scales, bf16, ..."""
    int4 = {"weight_packed": "packed int4", "weight_scale": "int4 scales", "weight_shape": "int4 shapes"}
    floats = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(tensor.dtype, str(tensor.dtype))
    return next((kind for end, kind in int4.items() if name.endswith(end)), floats)


def name_map(folder) -> list[dict]:
    """How the checkpoint's tensor names land in the text model, grouped (names only, no data)."""
    groups: dict[tuple[str, str], int] = {}
    with CheckpointTensors(folder) as tensors:
        for key in tensors.keys():
            name = text_key(key)
            if name is None:
                group = (".".join(key.split(".")[:2]) + ".*", "not read (audio/vision)")
            elif name == "lm_head.weight":
                group = (key, "tied to model.embed_tokens.weight: the copy is redundant")
            else:
                group = (CHECKPOINT_PREFIX + "*", TEXT_PREFIX + "*")
            groups[group] = groups.get(group, 0) + 1
    return [{"checkpoint": c, "text model": t, "tensors": n} for (c, t), n in groups.items()]


def memory_report(model) -> list[dict]:
    """Bytes the model holds by kind (packed int4, int4 scales, bf16, ..., buffers) and device; tied tensors once."""
    seen, rows = set(), {}
    named = [(n, t, False) for n, t in model.named_parameters(remove_duplicate=False)]
    named += [(n, t, True) for n, t in model.named_buffers(remove_duplicate=False)]
    for name, tensor, is_buffer in named:
        if id(tensor) in seen:  # identity, as parameters() dedups: XLA tensors have no data_ptr
            continue
        seen.add(id(tensor))
        kind = "buffers" if is_buffer else tensor_kind(name, tensor)
        device = str(tensor.device)
        row = rows.setdefault((kind, device), {"kind": kind, "device": device, "tensors": 0, "bytes": 0})
        row["tensors"] += 1
        row["bytes"] += tensor.numel() * tensor.element_size()
    return sorted(rows.values(), key=lambda r: -r["bytes"])


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s64": 8, "u64": 8, "f64": 8}  # else 4
NOT_WORK = ("parameter", "constant", "tuple", "get-tuple-element", "bitcast")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")


def array_bytes(shape_text: str) -> int:
    """Bytes of every array in an HLO shape, e.g. ``(bf16[1,8,256]{2,1,0}, s32[])``."""
    return sum(_count(dims) * _BYTES.get(dtype, 4) for dtype, dims in _ARRAY.findall(shape_text))


def _count(dims: str) -> int:
    """Elements of an HLO array from its dims, e.g. ``1,8,256`` (a scalar's are empty: 1)."""
    return math.prod(int(d) for d in dims.split(",") if d)


@dataclasses.dataclass
class Program:
    """One module XLA compiled: its name, its HLO text after optimizations, its buffer assignment."""

    name: str
    hlo: str
    buffers: str


@contextlib.contextmanager
def captured(folder: pathlib.Path):
    """The programs XLA compiles inside the block (dumped into ``folder``), filled at its end."""
    before = set(folder.glob("*after_optimizations.txt"))
    programs: list[Program] = []
    try:
        yield programs
    finally:
        for path in sorted(set(folder.glob("*after_optimizations.txt")) - before):
            buffers = path.with_name(path.name.replace(".txt", "-buffer-assignment.txt"))
            name = ".".join(path.name.split(".")[:3])  # module_0038.SyncTensorsGraph.5092
            programs.append(Program(name, path.read_text(), buffers.read_text() if buffers.exists() else ""))


def parameters(hlo: str) -> dict[int, str]:
    """The entry computation's parameters: number -> shape text."""
    entry = hlo[hlo.index("\nENTRY ") :].split("\n}\n", 1)[0]
    return {int(m[2]): m[1] for m in re.finditer(r"= (.+?) parameter\((\d+)\)", entry)}


def aliased(hlo: str) -> dict[int, int]:
    """The module's input-output aliasing: parameter number -> output index (top level)."""
    header = hlo.split("\n", 1)[0]
    m = re.search(r"input_output_alias=\{(.*?)\}, (?:entry_computation_layout|alias_passthrough|$)", header)
    pairs = re.findall(r"\{(\d+)\}: \((\d+),", m.group(1)) if m else []
    return {int(param): int(out) for out, param in pairs}


def s64_ops(hlo: str) -> tuple[dict[str, int], tuple[int, str]]:
    """Instructions making a 64-bit integer value, by opcode, in every computation, and the largest
    such array (elements, shape); ``NOT_WORK`` instructions left out."""
    counts: dict[str, int] = {}
    largest = (0, "")
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (.+?) ([a-z][\w\-]*)\(", line)
        if not m or m.group(2) in NOT_WORK:
            continue
        arrays = [dims for dtype, dims in _ARRAY.findall(m.group(1)) if dtype in ("s64", "u64")]
        if not arrays:
            continue
        counts[m.group(2)] = counts.get(m.group(2), 0) + 1
        largest = max(largest, *((_count(dims), f"s64[{dims}]") for dims in arrays))
    return counts, largest


def temporaries(program: Program) -> list[list[tuple]]:
    """(bytes, offset, name, shape) of each value, a list per temporary allocation (not an input,
    output or constant) of the buffer assignment; offsets are within the allocation."""
    found = []
    for block in program.buffers.split("\nallocation ")[1:]:
        head = block.split("\n", 1)[0]
        if any(tag in head for tag in ("parameter", "maybe-live-out", "constant", "thread-local")):
            continue
        values = re.finditer(r"value: <\d+ ([^>]+)> \(size=(\d+),offset=(\d+)\): (\S+)", block)
        found.append([(int(m[2]), int(m[3]), m[1], m[4]) for m in values])
    return found


def largest_intermediate(program: Program) -> tuple[int, str]:
    """The largest temporary value XLA assigned (bytes and what it holds); (0, "") if none."""
    values = [v for allocation in temporaries(program) for v in allocation]
    size, _, name, shape = max(values, default=(0, 0, "", ""), key=lambda v: v[0])
    return size, f"{name}: {shape}" if size else ""


def assigned_bytes(program: Program) -> dict[str, int]:
    """The program's memory per XLA's buffer assignment: parameters, outputs not aliased to an input,
    temporaries (sharing space where lifetimes do not overlap), and their total, its peak."""
    sizes = {"parameters": 0, "outputs": 0, "temporaries": 0}
    for block in program.buffers.split("\nallocation ")[1:]:
        head = block.split("\n", 1)[0]
        m = re.match(r"\d+: size (\d+)", head)
        if not m or "constant" in head or "thread-local" in head:
            continue
        kind = "parameters" if "parameter" in head else "outputs" if "maybe-live-out" in head else "temporaries"
        sizes[kind] += int(m.group(1))
    sizes["total"] = sum(sizes.values())
    return sizes


def _union(spans: list[tuple[int, int]]) -> int:
    """Bytes covered by (start, stop) spans, counting overlaps once."""
    total, end = 0, 0
    for start, stop in sorted(spans):
        total, end = total + max(0, stop - max(start, end)), max(end, stop)
    return total


def upcast_bytes(program: Program) -> int:
    """Temporary bytes holding float32 copies of bf16 inputs (shared space once): XLA's CPU compiler
    runs a bf16 matmul in float32, converting the weight first; a TPU's matrix unit takes bf16."""
    copies = {s.split("{")[0].replace("bf16[", "f32[") for s in parameters(program.hlo).values() if "bf16[" in s}
    return sum(
        _union([(offset, offset + size) for size, offset, _, shape in allocation if shape.split("{")[0] in copies])
        for allocation in temporaries(program)
    )


def hlo_shape(tensor) -> str:
    """A tensor's shape as HLO writes it, e.g. ``bf16[1,1,256,64]``."""
    dtype = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int32": "s32", "int64": "s64"}
    return f"{dtype[str(tensor.dtype).removeprefix('torch.')]}[{','.join(map(str, tensor.shape))}]"


def audit(program: Program, cache_shapes: list[str] | None = None) -> dict:
    """One program's row. ``cache_shapes``: HLO shapes of the KV cache buffers; a cache parameter
    not aliased to an output is copied whole into a new buffer every call."""
    params, alias = parameters(program.hlo), aliased(program.hlo)
    cache = [n for n, shape in params.items() if cache_shapes and shape.split("{")[0] in cache_shapes]
    copied = sum(array_bytes(params[n]) for n in cache if n not in alias)
    size, what = largest_intermediate(program)
    s64, s64_largest = s64_ops(program.hlo)
    return {
        "program": program.name,
        "s64_ops": sum(s64.values()),
        "s64_kinds": ", ".join(f"{k} {v}" for k, v in sorted(s64.items(), key=lambda kv: -kv[1])[:4]),
        "s64_largest": s64_largest[0],
        "s64_largest_shape": s64_largest[1],
        "cache_buffers": len(cache),
        "cache_aliased": sum(n in alias for n in cache),
        "cache_bytes_copied": copied,
        "largest_intermediate": size,
        "largest_is": what,
        **{f"{k}_bytes": v for k, v in assigned_bytes(program).items()},
        "upcast_bytes": upcast_bytes(program),
    }


def summary(compiled: list[Program], cache_shapes: set[str]) -> dict:
    """Audit columns over a variant's programs (prefill, step): the largest of each figure, and
    whether every cache buffer was aliased in all."""
    rows = [row for row in (audit(p, cache_shapes) for p in compiled) if row["cache_buffers"]]
    if not rows:
        return {}
    return {
        "s64_ops": max(r["s64_ops"] for r in rows),
        "cache_in_place": all(r["cache_aliased"] == r["cache_buffers"] for r in rows),
        "cache_bytes_copied": max(r["cache_bytes_copied"] for r in rows),
        "largest_intermediate": max(r["largest_intermediate"] for r in rows),
        "program_bytes": max(r["total_bytes"] for r in rows),
    }
