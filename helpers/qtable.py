"""The per-layer embedding table kept in 4-bit on the device, only the current tokens' rows dequantized in the step."""

from __future__ import annotations

import torch

from .int4 import (
    ROWS_PER_BLOCK,
    bf16_pieces,
    dequantize,
    int4pack,
    int4pack_linear,
    kernel_refusal,
    quantize_int4,
    recover_grid,
    unpack_rows,
)
from .packed import GROUP_SIZE, CheckpointTensors, checkpoint_key, table_row_words


def gather_rows(table: torch.Tensor, input_ids: torch.Tensor, words: int, groups: int, dtype) -> torch.Tensor:
    """The rows of ``input_ids`` dequantized: one gather of whole int32 rows (``words`` of codes, then ``groups``
    float32 steps' bits), then only those rows unpacked and scaled."""
    gathered = table[input_ids]
    steps = gathered[..., words : words + groups].view(torch.float32)
    return dequantize(unpack_rows(gathered[..., :words]), steps, dtype)


class QTable(torch.nn.Module):
    """A drop-in for Gemma 4's scaled embedding: one int32 row per token (codes, the float32 steps' bits, zeros to
    ``packed.table_row_words``), laid out for a TPU's gather."""

    def __init__(self, rows: int, cols: int, embed_scale: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.words, self.groups, self.embedding_dim, self.dtype = cols // 8, cols // GROUP_SIZE, cols, dtype
        self.register_buffer("table", torch.zeros(rows, table_row_words(cols), dtype=torch.int32, device=device))
        # on the device, as Gemma 4 keeps it: a host scalar would be a host-to-device copy per call
        self.register_buffer("embed_scale", torch.tensor(embed_scale, device=device), persistent=False)

    @classmethod
    def of(cls, packed: torch.Tensor, scales: torch.Tensor, embed_scale: float, dtype: torch.dtype) -> "QTable":
        """From ``packed`` [rows, cols / 8] int32 and ``scales`` [rows, cols / 32] (kept as float32, exactly)."""
        module = cls(packed.shape[0], packed.shape[1] * 8, embed_scale, dtype, packed.device)
        module.put(0, packed, scales)
        return module

    def put(self, start: int, packed: torch.Tensor, scales: torch.Tensor) -> None:
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
        """From an embedding's exact 4-bit grid; groups on none are quantized, counted and their error reported
        (``exact_only``: raise)."""
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
        from tqdm.auto import tqdm

        table = embedding.weight.detach()
        module = cls(*table.shape, embedding.scalar_embed_scale, table.dtype, table.device)
        starts = range(0, table.shape[0], ROWS_PER_BLOCK)
        missed, error = 0, 0.0
        for start in tqdm(starts, desc="recovering the 4-bit grid", disable=len(starts) < 4):
            block = table[start : start + ROWS_PER_BLOCK].cpu()
            c, sc, found = recover_grid(block)
            if not found.all():
                if exact_only:
                    raise ValueError(f"{int((~found).sum())} groups of the table are on no 4-bit grid")
                qc, qs = quantize_int4(block)
                c = torch.where(found.repeat_interleave(GROUP_SIZE, dim=1), c, qc)
                sc = torch.where(found, sc, qs)
                missed += int((~found).sum())
                error = max(error, (dequantize(c, sc, block.dtype) - block).abs().max().item())
            module.put(start, pack_to_int32(c, 4).to(table.device), sc.to(table.device))
        return module, {
            "from": "the table's own 4-bit grid" if not missed else "its grid, compressed-tensors where off it",
            "exact grid": not missed,
            "groups": table.numel() // GROUP_SIZE,
            "groups off the grid": missed,
            "max abs error": error,
            "row words": module.table.shape[1],
            "bytes before": table.numel() * table.element_size(),
            "bytes after": module.nbytes(),
        }

    @classmethod
    def from_checkpoint(cls, folder, name: str, embedding) -> tuple["QTable", dict] | None:
        """From the checkpoint's own packed table ``name``, read from its files (transformers drops such a weight); else
        None."""
        key = checkpoint_key(f"model.{name}")
        with CheckpointTensors(folder) as tensors:
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
            "exact grid": True,  # the checkpoint's own codes and scales, widened to float32 exactly
            "row words": module.table.shape[1],
            "bytes before": shape[0] * shape[1] * embedding.weight.element_size(),
            "bytes after": module.nbytes(),
        }

    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    def rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        return gather_rows(self.table, input_ids, self.words, self.groups, self.dtype)

    def dequantized(self) -> torch.Tensor:
        return dequantize(unpack_rows(self.packed), self.scales, self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.rows(input_ids) * self.embed_scale.to(self.dtype)  # rounded as Gemma 4's embedding does


class QHead(torch.nn.Module):
    """The head tied to a ``QTable``: dequantized, then a matmul; or with ``kernel`` (``Backend.int4_kernel``) the
    table's codes and scales repacked once for torch's int4 kernel, a copy of its own (a gather and the kernel want
    different layouts), where the kernel holds them exactly. Steps finer than bf16 go through it as two bf16 pieces,
    one pass over the codes each (``passes``). At full size on a CPU, the head rows were 0.41x the bf16 loops through
    its float32 path, 1.41-1.60x through two bf16 passes (docs/full-size.md)."""

    def __init__(self, table: QTable, kernel: str | None = None):
        super().__init__()
        self.out_features = table.table.shape[0]  # as the linear it replaces says
        if kernel:  # the codes unpacked only where a kernel may take them (a TPU has none)
            codes, pieces = unpack_rows(table.packed).to(torch.int8), bf16_pieces(table.scales) or [table.scales]
            kernel = None if kernel_refusal(codes, pieces[0], table.dtype, "int4", kernel) else kernel
        self.kernel = kernel
        if kernel:
            packed, scales_and_zeros = int4pack(codes, pieces[0], self.kernel)
            each = [scales_and_zeros] + [scales_and_zeros.clone() for _ in pieces[1:]]
            for piece, laid_out in zip(pieces[1:], each[1:]):
                laid_out[..., 0] = piece.t()  # int4pack's layout, the remainders
            self.register_buffer("codes", packed)
            self.register_buffer("scales", torch.stack(each))
        else:
            self.table = table

    @property
    def passes(self) -> int:
        """The kernel's passes over the codes a step: one per bf16 piece of the steps (1 with no kernel)."""
        return self.scales.shape[0] if self.kernel else 1

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            pieces = [int4pack_linear(hidden, self.codes, scales, self.kernel).float() for scales in self.scales]
            return sum(pieces).to(hidden.dtype)
        return torch.nn.functional.linear(hidden, self.table.dequantized())


def keep_table_in_4bit(model, folder=None) -> dict:
    """Swap the per-layer table for a ``QTable``: from the packed data in ``folder``, else its grid."""
    old = model.model.embed_tokens_per_layer
    built = QTable.from_checkpoint(folder, "embed_tokens_per_layer", old) if folder else None
    model.model.embed_tokens_per_layer, report = built or QTable.from_embedding(old)
    return report


def keep_embed_in_4bit(model, kernel: str | None = None) -> dict:
    """The measured extra, off by default: the main table in 4-bit too, its tied head a ``QHead`` on it (through
    ``kernel`` where it holds the table exactly)."""
    model.model.embed_tokens, report = QTable.from_embedding(model.model.embed_tokens)
    model.lm_head = QHead(model.model.embed_tokens, kernel)
    return report | {"head": f"torch's {model.lm_head.kernel} int4 kernel" if model.lm_head.kernel else "dequantized"}
