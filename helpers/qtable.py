"""The per-layer embedding table kept in 4-bit on the device: packed int4 codes, one scale per
group of 32 (bf16 where that is exact, else float32), and only the rows of the current tokens
dequantized, inside the step; and packed int4 times activations (``packed_linear``), which
notebook 07's int4 linears run."""

from __future__ import annotations

import torch

from .hub import local_folder
from .packed import GROUP_SIZE, CheckpointTensors, checkpoint_key, table_row_words

ROWS_PER_BLOCK = 1024  # E2B's table is 2.3 G values: work through it on the host in blocks
# The peak's level, most likely first: a QAT grid's step is set by its largest value (level 7
# or 8); smaller ones hold for groups whose values all share a factor.
_PEAK_LEVELS = (7, 8, 6, 5, 4, 3, 2, 1)


def _bf16_neighbours(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reals bf16 rounds to the non-negative bf16 numbers of ``bits`` (int32): from halfway to
    the one below to halfway to the one above, in float32 (exact there: bf16 keeps 8 significant
    bits of float32's 24)."""

    def value(b):
        return b.to(torch.int16).view(torch.bfloat16).float()

    here = value(bits)  # halves first: the sum of two numbers near float32's largest would overflow
    return value((bits - 1).clamp_min(0)) / 2 + here / 2, here / 2 + value(bits + 1) / 2


def _bf16_at_least(x: torch.Tensor) -> torch.Tensor:
    """The smallest bf16 number >= ``x`` (float32, positive)."""
    down = x.to(torch.bfloat16)
    bits = down.view(torch.int16).int() + (down.float() < x).int()
    return bits.to(torch.int16).view(torch.bfloat16).float()


def _bf16_at_most(x: torch.Tensor) -> torch.Tensor:
    """The largest bf16 number <= ``x`` (float32, positive)."""
    up = x.to(torch.bfloat16)
    bits = up.view(torch.int16).int() - (up.float() > x).int()
    return bits.to(torch.int16).view(torch.bfloat16).float()


def recover_grid(table: torch.Tensor, group_size: int = GROUP_SIZE):
    """The 4-bit grid a QAT table lies on, group by group: int8 codes in [-8, 7] and one step
    per group (either sign) such that bf16(codes x step), the product taken in float32 as
    ``dequantize`` takes it, is the table's value bit for bit.

    The step may be finer than bf16, as in Google's ``-ct`` export (its tables are bf16(level x
    step) with a step wider than bf16 or fp16). For each group the steps that reproduce every
    value form an interval: bf16 rounds each |value| from halfway to its lower neighbour to
    halfway to its upper one, so |level| x step must lie there, and the step in that range divided
    by |level|. The levels follow from the peak's (tried as ``_PEAK_LEVELS``); the intervals are
    intersected (in float32: a division by a level may round the ends by a unit, so every step
    kept is checked), and a step inside is kept: a bf16 one if there is one, else float32.

    Returns (codes [rows, cols] int8, steps [rows, groups] float32, found [rows, groups]); a
    group on no such grid is not found (codes 0, step 1). Codes -7..8 (the grid centred the
    other way) are the same grid with the step's sign flipped, and are stored so."""
    rows = table.shape[0]
    flat = table.float().reshape(-1, group_size)
    value = flat.to(torch.bfloat16)
    codes = torch.zeros(flat.shape, dtype=torch.int8)
    steps = torch.ones(flat.shape[0], dtype=torch.float32)
    found = (flat == 0).all(-1)  # an all-zero group is exact with any step
    on_bf16 = (value.float() == flat).all(-1)  # else on no bf16 grid at all
    todo = (~found & on_bf16 & torch.isfinite(flat).all(-1)).nonzero().squeeze(1)
    for k in _PEAK_LEVELS:
        if todo.numel() == 0:
            break
        v = flat[todo]
        low, high = _bf16_neighbours(value[todo].abs().view(torch.int16).int())
        levels = torch.round(v / (v.abs().amax(-1, keepdim=True) / k))
        nonzero = levels != 0
        ok = (levels.abs() <= 8).all(-1) & ~((levels.amin(-1) < -7) & (levels.amax(-1) > 7))
        ok &= (nonzero | (v == 0)).all(-1)  # a level 0 only for a zero
        size = levels.abs().clamp_min(1)
        lo = torch.where(nonzero, low / size, 0.0).amax(-1)
        hi = torch.where(nonzero, high / size, torch.inf).amin(-1)
        ok &= lo <= hi
        step = torch.zeros(todo.numel(), dtype=torch.float32)
        exact = torch.zeros(todo.numel(), dtype=torch.bool)
        for candidate in (_bf16_at_least(lo), _bf16_at_most(hi), lo / 2 + hi / 2):
            fits = ok & ~exact & (candidate > 0) & torch.isfinite(candidate)
            fits &= ((levels.float() * candidate[:, None]).to(torch.bfloat16) == value[todo]).all(-1)
            step = torch.where(fits, candidate, step)
            exact |= fits
        flip = levels.amax(-1) > 7  # codes -7..8: negate codes and step, the values stay
        codes[todo[exact]] = torch.where(flip[:, None], -levels, levels)[exact].to(torch.int8)
        steps[todo[exact]] = torch.where(flip, -step, step)[exact]
        found[todo[exact]] = True
        todo = todo[~exact]
    return codes.reshape(table.shape), steps.reshape(rows, -1), found.reshape(rows, -1)


def exact_scales(steps: torch.Tensor) -> torch.Tensor:
    """``steps`` in bf16 where every one is a bf16 number (half the bytes), else in float32."""
    narrow = steps.to(torch.bfloat16)
    return narrow if torch.equal(narrow.float(), steps.float()) else steps.float()  # a cast, no arithmetic


def quantize_int4(table: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """For a table on no 4-bit grid: compressed-tensors' own symmetric int4 group quantization."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    groups = table.float().reshape(table.shape[0], -1, group_size)
    peak = groups.abs().amax(-1)
    scale, zero_point = calculate_qparams(-peak, peak, args)
    codes = quantize(table.float(), scale, zero_point, args, dtype=torch.int8)
    return codes, scale.to(torch.bfloat16)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes x scales (one per group of 32 along the last dimension) as the grid's values."""
    return grid_values(codes, scales.float().repeat_interleave(GROUP_SIZE, dim=-1), dtype)


def grid_values(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes x scales (broadcast to the codes) rounded to bf16, as the QAT grid's values are (and
    compressed-tensors' bf16 dequantization gives), then in ``dtype``."""
    return (codes.float() * scales.float()).to(torch.bfloat16).to(dtype)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int4 codes from int32 words, eight per word, low nibble first: compressed-tensors'
    `pack-quantized` layout. Written out because compressed-tensors' own unpack returns wrong
    codes on PyTorch/XLA (notebook 02): there `>>` of a negative int32 rounds like a division
    (measured: codes off by one in words with the top bit set). So only non-negative words are
    shifted: the sign bit is cleared first and given back as the top nibble's high bit. All in
    int32: a TPU has no 64-bit integers, XLA would emulate every op over the table in pairs."""
    return code_planes(packed).transpose(-1, -2).flatten(-2)


def code_planes(packed: torch.Tensor) -> torch.Tensor:
    """``unpack_rows``' codes by plane, [..., 8, words]: plane k holds every word's k-th code."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device).view(8, 1)
    top = ((shifts + 4) & 32) >> 2  # the sign bit's place: 8 in the last nibble (shift 28), 0 elsewhere
    negative = packed < packed.new_zeros(())  # an int32 zero: PyTorch/XLA compares with a Python 0 in 64 bits
    nibbles = ((packed & 0x7FFFFFFF).unsqueeze(-2) >> shifts) & 15
    return (nibbles | negative.to(torch.int32).unsqueeze(-2) * top) - 8


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, by_planes: bool = False
) -> torch.Tensor:
    """``F.linear(x, weight)`` for the weight [out, in] that int32 words [out, in / 8] and their
    scales [out, in / 32] hold, its values exactly the grid's (``dequantize``). As written for a
    TPU (the default): the weight unpacked and dequantized, then a matmul, which XLA may fuse so
    that the matrix unit reads the packed words. With ``by_planes`` (a CPU's form,
    ``Backend.int4_by_planes``), one row of ``x`` (a decode step's) is multiplied plane by plane
    instead: plane k holds every word's k-th code, which multiplies the inputs 8j + k, so each
    word is read once and shifted by a constant per plane; elementwise work a TPU's vector unit
    would do, not its matrix unit. The same products, summed in float32 in another order;
    unpacked into columns, a CPU compiler interleaves the eight codes with a shift that varies
    along the row and leaves the loop scalar (``benchmarks/int4_cpu.py``: five times slower at
    E2B's widest linears)."""
    if not by_planes or x.shape[:-1].numel() != 1:
        return torch.nn.functional.linear(x, dequantize(unpack_rows(packed), scales, dtype))
    out, words = packed.shape
    groups, per_group = scales.shape[-1], words // scales.shape[-1]  # 4 words per group of 32
    planes = code_planes(packed).view(out, 8, groups, per_group)  # [out, plane, group, word]
    weight = grid_values(planes, scales.view(out, 1, groups, 1), dtype)
    inputs = x.reshape(groups, per_group, 8).permute(2, 0, 1)  # [plane, group, word], as the weight's
    return (weight.float() * inputs.float()).sum((-3, -2, -1)).to(x.dtype).view(*x.shape[:-1], out)


class QTable(torch.nn.Module):
    """A drop-in for Gemma 4's scaled word embedding (same call, same embed scale), holding the
    table in 4-bit as one int32 row per token, laid out for a TPU's gather: the row's packed
    codes (compressed-tensors' ``pack-quantized`` words, eight codes -8..7 each, low nibble
    first), then its float32 steps (one per group of 32, their bits), then zeros to a multiple of
    128 words (``packed.table_row_words``). A lookup gathers the tokens' rows, then dequantizes
    only those.

    Args: ``rows`` and ``cols``, the table's shape; ``embed_scale``, the embedding's scalar
    factor; ``dtype``, that of the rows it returns; ``device``. Its rows are written by ``put``
    (or built by ``of``, ``from_embedding``, ``from_checkpoint``). ``forward(input_ids)``: int64
    ids of any shape [...]; returns [..., cols] in ``dtype``, the rows times the embed scale, as
    ``Gemma4TextScaledWordEmbedding`` does. ``packed`` and ``scales`` read back as views."""

    def __init__(self, rows: int, cols: int, embed_scale: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.words, self.groups, self.embedding_dim = cols // 8, cols // GROUP_SIZE, cols
        self.register_buffer("table", torch.zeros(rows, table_row_words(cols), dtype=torch.int32, device=device))
        # a device buffer, as Gemma 4's embedding keeps it: a host scalar made inside the
        # compiled step would be a host-to-device copy per call
        self.register_buffer("embed_scale", torch.tensor(embed_scale, device=device), persistent=False)
        self.dtype = dtype

    @classmethod
    def of(cls, packed: torch.Tensor, scales: torch.Tensor, embed_scale: float, dtype: torch.dtype) -> "QTable":
        """The table of ``packed`` [rows, cols / 8] int32 codes and ``scales`` [rows, cols / 32]
        (either sign; bf16 or float32, kept as float32, exactly)."""
        module = cls(packed.shape[0], packed.shape[1] * 8, embed_scale, dtype, packed.device)
        module.put(0, packed, scales)
        return module

    def put(self, start: int, packed: torch.Tensor, scales: torch.Tensor) -> None:
        """Write rows ``start``.. of the table: their codes, then their steps as float32 bits."""
        rows = self.table[start : start + packed.shape[0]]
        rows[:, : self.words] = packed
        rows[:, self.words : self.words + self.groups] = scales.float().view(torch.int32)

    @property
    def packed(self) -> torch.Tensor:
        return self.table[:, : self.words]

    @property
    def scales(self) -> torch.Tensor:
        return self.table[:, self.words : self.words + self.groups].view(torch.float32)

    @classmethod
    def from_embedding(cls, embedding, exact_only: bool = False) -> tuple["QTable", dict]:
        """Built from a model's embedding: its exact 4-bit grid, group by group; a group on no
        grid is quantized by compressed-tensors, and the report says how many and the largest
        error that introduced (``exact_only``: raise instead)."""
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
        from tqdm.auto import tqdm

        table = embedding.weight.detach()
        module = cls(*table.shape, embedding.scalar_embed_scale, table.dtype, table.device)  # written block by block
        starts = range(0, table.shape[0], ROWS_PER_BLOCK)
        missed, error = 0, 0.0
        for start in tqdm(starts, desc="recovering the 4-bit grid", disable=len(starts) < 4):
            block = table[start : start + ROWS_PER_BLOCK].cpu()
            c, sc, found = recover_grid(block)
            if not found.all():  # only the groups on no grid are quantized, by compressed-tensors
                if exact_only:
                    raise ValueError(f"{int((~found).sum())} groups of the table are on no 4-bit grid")
                qc, qs = quantize_int4(block)
                c = torch.where(found.repeat_interleave(GROUP_SIZE, dim=1), c, qc)
                sc = torch.where(found, sc, qs)
                missed += int((~found).sum())
                error = max(error, (dequantize(c, sc, block.dtype) - block).abs().max().item())
            module.put(start, pack_to_int32(c, 4).to(table.device), sc.to(table.device))
        groups = table.numel() // GROUP_SIZE
        report = {
            "from": "the table's own 4-bit grid" if not missed else "its grid, compressed-tensors where off it",
            "exact grid": not missed,
            "groups": groups,
            "groups off the grid": missed,
            "max abs error": error,
            "row words": module.table.shape[1],
            "bytes before": table.numel() * table.element_size(),
            "bytes after": module.nbytes(),
        }
        return module, report

    @classmethod
    def from_checkpoint(cls, checkpoint, name: str, embedding) -> tuple["QTable", dict] | None:
        """Built from the checkpoint's own packed data, if it saved table ``name`` packed
        (``weight_packed``, ``weight_scale``, ``weight_shape``); else None. Read from the
        safetensors files directly: transformers' default path drops such an embedding's weight."""
        key = checkpoint_key(f"model.{name}")
        with CheckpointTensors(local_folder(checkpoint)) as tensors:
            if f"{key}.weight_packed" not in tensors:
                return None
            packed, scales = tensors.get(f"{key}.weight_packed"), tensors.get(f"{key}.weight_scale")
            shape, where = tuple(tensors.get(f"{key}.weight_shape").tolist()), tensors.file(f"{key}.weight_packed")
        if shape != (embedding.num_embeddings, embedding.embedding_dim):
            raise ValueError(
                f"{key} is saved packed as {shape}, the model expects "
                f"{(embedding.num_embeddings, embedding.embedding_dim)}"
            )
        device = embedding.weight.device
        module = cls.of(packed.to(device), scales.to(device), embedding.scalar_embed_scale, embedding.weight.dtype)
        return module, {
            "from": f"packed in {where}",
            "exact grid": True,  # the checkpoint's own codes and scales, the scales widened to float32 exactly
            "row words": module.table.shape[1],
            "bytes before": shape[0] * shape[1] * embedding.weight.element_size(),
            "bytes after": module.nbytes(),
        }

    def nbytes(self) -> int:
        """The table's bytes, its padding counted: what it holds on the device."""
        return self.table.numel() * self.table.element_size()

    def rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The dequantized rows of ``input_ids`` (any shape), in the table's dtype: one gather of
        whole 128-word rows, codes and steps together."""
        gathered = self.table[input_ids]
        steps = gathered[..., self.words : self.words + self.groups].view(torch.float32)
        return dequantize(unpack_rows(gathered[..., : self.words]), steps, self.dtype)

    def dequantized(self) -> torch.Tensor:
        """The whole table, dequantized (what a tied output head multiplies by)."""
        return dequantize(unpack_rows(self.packed), self.scales, self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # as Gemma4TextScaledWordEmbedding rounds it: a float32 scalar cast to the table dtype
        return self.rows(input_ids) * self.embed_scale.to(self.dtype)


class QHead(torch.nn.Module):
    """The output head tied to a ``QTable``: the table dequantized inside the step, then the
    bf16 head's own matmul, so logits read exactly the values the lookups do. Not plane by plane
    (``packed_linear``): XLA's CPU compiler fuses this dequantization into its matmul, but makes
    the head's plane products whole, 1.61 GB in float32 at E2B
    (``benchmarks/xla_programs-cpu-2026-12-05-planes-head.txt``)."""

    def __init__(self, table: QTable):
        super().__init__()
        self.table = table

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.table.dequantized())


def keep_table_in_4bit(model, checkpoint=None) -> dict:
    """Swap the model's per-layer embedding table for a ``QTable``, from the checkpoint's packed
    data if it has it, else from the table's own grid; the bf16 table is freed."""
    old = model.model.embed_tokens_per_layer
    built = QTable.from_checkpoint(checkpoint, "embed_tokens_per_layer", old) if checkpoint else None
    model.model.embed_tokens_per_layer, report = built or QTable.from_embedding(old)
    return report


def keep_embed_in_4bit(model) -> dict:
    """The measured extra, off by default: the main table in 4-bit as well. It is tied with the
    output head, so the head becomes a ``QHead`` on the same packed table."""
    model.model.embed_tokens, report = QTable.from_embedding(model.model.embed_tokens)
    model.lm_head = QHead(model.model.embed_tokens)
    return report
