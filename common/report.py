"""Results as Markdown tables (with their rows as JSON next to them) and PNG plots, and the number
formatting the tables share."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from common.errors import DataError

NEEDS_GPU = "needs GPU"
GIB = 2**30
MIB = 2**20


@dataclass
class Table:
    """One of the chapter's tables, reproduced: chapter claim | our analytic | measured here."""

    name: str  # file stem under the output directory
    title: str
    setup: list[str]  # lines saying at which scale and on which hardware each column was made
    columns: list[str]
    rows: list[list[str]]
    notes: list[str] = field(default_factory=list)  # verdicts: where the chapter is wrong and why
    plot: Callable[[Path], None] | None = None

    def markdown(self) -> str:
        lines = [f"# {self.title}", ""]
        lines += [f"- {line}" for line in self.setup]
        lines += ["", "| " + " | ".join(self.columns) + " |", "|" + "|".join("---" for _ in self.columns) + "|"]
        lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in self.rows]
        if self.notes:
            lines += ["", "**Verdict**", ""]
            lines += [f"- {note}" for note in self.notes]
        if self.plot is not None:
            lines += ["", f"![{self.title}]({self.name}.png)"]
        return "\n".join(lines) + "\n"

    def write(self, out_dir: Path) -> list[Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        written = [out_dir / f"{self.name}.md"]
        written[0].write_text(self.markdown())
        if self.plot is not None:
            png = out_dir / f"{self.name}.png"
            self.plot(png)
            written.append(png)
        return written


def new_figure(ncols: int = 1, width: float = 6.0, height: float = 4.0):
    """A matplotlib figure on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height))
    return fig, axes


def save_figure(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def gib(nbytes: float) -> str:
    value = nbytes / GIB
    if value >= 100:
        return f"{value:,.0f} GiB"
    if value >= 1:
        return f"{value:.1f} GiB"
    return f"{nbytes / MIB:.1f} MiB"


def human_bytes(nbytes: float) -> str:
    if nbytes >= GIB:
        return gib(nbytes)
    if nbytes >= MIB:
        return f"{nbytes / MIB:.2f} MiB"
    return f"{nbytes / 1024:.1f} KiB"


def sci(value: float) -> str:
    """A float in the short form a format table wants: 448, 6.1e-05, 3.4e+38."""
    if value == 0 or 1e-3 <= abs(value) < 1e6:
        return f"{value:g}"
    return f"{value:.2g}"


def text_table(headers: list[str], rows: list[list[str]], numeric: bool = True, left: int = 1) -> str:
    """Aligned plain-text table: the first ``left`` columns left-aligned, the rest right-aligned if ``numeric``."""
    cells = [headers] + rows
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i >= left and numeric else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        ).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def markdown_table(headers: list[str], rows: list[list[str]], left: int = 1) -> str:
    """A pipe table; the first ``left`` columns left-aligned, the rest right-aligned; '|' in a cell escaped."""
    align = ["---" if i < left else "---:" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    return "\n".join(lines + ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows])


# --------------------------------------------------------------------------- rows as data

# A bench that writes a Markdown table also writes the rows it was made from, as JSON next to it
# (same stem), so that other tools read numbers instead of parsing each other's Markdown.


def relative_link(target: Path, markdown_path: Path) -> str:
    """How a Markdown file links ``target``: relative to its own folder where it can, else as given."""
    try:
        return str(Path(target).resolve().relative_to(Path(markdown_path).resolve().parent))
    except ValueError:
        return str(target)


def rows_path(markdown_path: Path) -> Path:
    """Where the rows of a Markdown results file live: the same stem, ``.json``."""
    return Path(markdown_path).with_suffix(".json")


def json_ready(value: Any) -> Any:
    """``value`` with dataclasses as dicts and non-finite floats as None (strict JSON has no NaN)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_results(markdown_path: Path, markdown: str, title: str, rows: list, **extra: Any) -> list[Path]:
    """Write ``markdown`` and, next to it, ``{"title", **extra, "rows"}`` as JSON; returns both paths.

    ``title`` is the line a reader quotes when it cites the file (what, where, when).
    """
    markdown_path = Path(markdown_path)
    markdown_path.parent.mkdir(parents=True, exist_ok=True)
    markdown_path.write_text(markdown)
    document = json_ready({"title": title, **extra, "rows": rows})
    json_path = rows_path(markdown_path)
    json_path.write_text(json.dumps(document, indent=1, allow_nan=False) + "\n")
    return [markdown_path, json_path]


def print_and_publish(heading: str, command: str, settings: str, headers: list[str], rows: list[list[str]],
                      markdown_path: Path | None) -> None:
    """A benchmark's settings line and table on stdout; with ``markdown_path``, the same under
    ``heading`` with the command that produced it, and the rows as JSON beside it."""
    print(settings)
    print(text_table(headers, rows))
    if markdown_path:
        text = f"# {heading}\n\n- `{command}`\n- {settings}\n\n{markdown_table(headers, rows)}\n"
        written = write_results(markdown_path, text, f"{heading}: {settings}", [dict(zip(headers, r)) for r in rows])
        print("wrote " + ", ".join(str(p) for p in written))


def read_results(path: Path) -> dict:
    """A results document written by ``write_results``; a damaged one is a one-line error naming the file."""
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: cannot read the results ({exc}); regenerate it with the tool that wrote it") from None
    if not isinstance(document, dict) or not isinstance(document.get("rows"), list) or "title" not in document:
        raise DataError(f"{path}: not a results file (needs 'title' and a list of 'rows'); regenerate it")
    return document
