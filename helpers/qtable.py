"""The per-layer embedding table kept in 4-bit on the device: packed int4 codes, one scale per
group of 32 (bf16 where that is exact, else float32), and only the rows of the current tokens
dequantized, inside the step (the codes and kernels are ``int4``'s)."""

from __future__ import annotations

import torch

from .int4 import (
    ROWS_PER_BLOCK,
    dequantize,
    quantize_int4,
    recover_grid,
    unpack_rows,
)
from .packed import GROUP_SIZE, CheckpointTensors, checkpoint_key, table_row_words


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
        with CheckpointTensors(checkpoint.path) as tensors:
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
