"""Measurements as a reader reads them: rows as a plain-text table, bytes in decimal units."""


def table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A plain-text table of dict rows (columns: every key seen, in order of first use)."""
    if columns is None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def fmt_bytes(n: int | None) -> str:
    """Bytes for a reader: 1,321,205,760 B -> '1.32 GB' (decimal units, as the source uses)."""
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
