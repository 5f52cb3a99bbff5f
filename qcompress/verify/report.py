"""What `qcompress verify` found: one row per quantized module, one result per consumer, and the
problems that make it exit 1 (a consumer asked about refuses a module, loads wrong weights or runs
it unquantized without saying so)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

CONSUMERS = ("load_quantized", "transformers", "vllm")


@dataclass
class ConsumerResult:
    """Whether the export loads / generates in one consumer (None: not checked)."""

    loads: Optional[bool] = None
    generates: Optional[bool] = None
    detail: str = ""


@dataclass
class ModuleRow:
    """One quantized module (an expert matrix counts once, under its per-expert names' pattern)."""

    name: str
    kind: str
    scheme: str  # what the tensors hold (load_quantized reads this)
    declared: str  # compressed-tensors' scheme from config.json
    consumers: Dict[str, str] = field(default_factory=dict)  # consumer -> what it uses / why not


@dataclass
class Problem:
    consumer: str
    module: str
    reason: str

    def line(self) -> str:
        return f"{self.consumer}: {self.module}: {self.reason}"


@dataclass
class Report:
    folder: str
    rows: Dict[str, ModuleRow] = field(default_factory=dict)
    consumers: Dict[str, ConsumerResult] = field(default_factory=dict)
    problems: List[Problem] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def problem(self, consumer: str, module: str, reason: str) -> None:
        self.problems.append(Problem(consumer, module, reason))

    def use(self, module: str, consumer: str, what: str) -> None:
        row = self.rows.get(module)
        if row is not None:
            row.consumers[consumer] = what

    @property
    def exit_code(self) -> int:
        return 1 if self.problems else 0

    def to_dict(self) -> dict:
        return {
            "folder": self.folder,
            "exit_code": self.exit_code,
            "modules": {
                n: {"kind": r.kind, "scheme": r.scheme, "declared": r.declared, "consumers": dict(r.consumers)}
                for n, r in self.rows.items()
            },
            "consumers": {
                c: {"loads": r.loads, "generates": r.generates, "detail": r.detail} for c, r in self.consumers.items()
            },
            "problems": [p.line() for p in self.problems],
            "notes": list(self.notes),
        }

    def format(self, max_rows: int = 200) -> str:
        cons = [c for c in CONSUMERS if c in self.consumers]
        head = ["module", "kind", "tensors (load_quantized)", "config.json (compressed-tensors)"] + [
            c for c in cons if c != "load_quantized"
        ]
        rows = [head]
        for r in list(self.rows.values())[:max_rows]:
            rows.append(
                [r.name, r.kind, r.scheme, r.declared]
                + [r.consumers.get(c, "-") for c in cons if c != "load_quantized"]
            )
        widths = [min(60, max(len(x[i]) for x in rows)) for i in range(len(head))]
        lines = [f"qcompress verify {self.folder}"]
        for i, r in enumerate(rows):
            lines.append("  ".join(c[:w].ljust(w) for c, w in zip(r, widths)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        if len(self.rows) > max_rows:
            lines.append(f"... and {len(self.rows) - max_rows} more modules")
        lines.append("")
        for c in cons:
            r = self.consumers[c]
            state = lambda v: "not checked" if v is None else ("yes" if v else "NO")  # noqa: E731
            lines.append(
                f"{c}: loads {state(r.loads)}, generates {state(r.generates)}" + (f" ({r.detail})" if r.detail else "")
            )
        for n in self.notes:
            lines.append(f"note: {n}")
        for p in self.problems:
            lines.append(f"PROBLEM {p.line()}")
        lines.append("ok" if not self.problems else f"{len(self.problems)} problem(s)")
        return "\n".join(lines)
