"""The fusion report: for every region its ops, shapes, bytes unfused vs fused and k; every node left eager and why."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class RegionReport:
    id: int
    graph: int
    kind: str                 # "pointwise" | "reduction" | "attention"
    ops: list[str]            # ATen op names, in graph order
    input_shapes: list[str]
    output_shapes: list[str]
    bytes_unfused: int
    bytes_fused: int
    bytes_unfused_expr: str   # sympy, in the graph's sizes
    bytes_fused_expr: str
    launches_unfused: int
    kernel: str
    source: str = field(repr=False)

    @property
    def k(self) -> float:
        return self.bytes_unfused / self.bytes_fused if self.bytes_fused else 1.0


@dataclass
class Unfused:
    op: str
    node: str
    reason: str
    graph: int = 0


@dataclass
class FusionReport:
    regions: list[RegionReport] = field(default_factory=list)
    unfused: list[Unfused] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    code: list[str] = field(default_factory=list, repr=False)  # each rewritten graph as Python
    graph: int = 0
    fallback: str | None = None  # why this graph runs as given (eager ATen), if it does
    fallbacks: list[str] = field(default_factory=list)  # merged reports: one line per such graph

    @staticmethod
    def merge(reports: list["FusionReport"]) -> "FusionReport":
        out = FusionReport()
        for r in reports:
            out.regions += r.regions
            out.unfused += r.unfused
            out.notes += [n for n in r.notes if n not in out.notes]
            out.code += r.code
            out.fallbacks += r.all_fallbacks
        return out

    @property
    def all_fallbacks(self) -> list[str]:
        """One line per graph that runs as given, with the reason."""
        return self.fallbacks + ([f"graph {self.graph}: {self.fallback}"] if self.fallback else [])

    @property
    def bytes_unfused(self) -> int:
        return sum(r.bytes_unfused for r in self.regions)

    @property
    def bytes_fused(self) -> int:
        return sum(r.bytes_fused for r in self.regions)

    def to_json(self) -> str:
        regions = [{**asdict(r), "k": r.k} for r in self.regions]
        return json.dumps({"regions": regions, "unfused": [asdict(u) for u in self.unfused],
                           "notes": self.notes, "fallbacks": self.all_fallbacks}, indent=1)

    def __str__(self) -> str:
        rows = [("#", "kind", "ops", "shape", "unfused", "fused", "k")]
        for r in self.regions:
            ops = [o.replace("aten.", "").split(".")[0] for o in r.ops]
            short = ", ".join(dict.fromkeys(ops))
            rows.append((f"{r.graph}.{r.id}", r.kind, short if len(short) < 60 else short[:57] + "...",
                         r.output_shapes[0] if r.output_shapes else "", _bytes(r.bytes_unfused),
                         _bytes(r.bytes_fused), f"{r.k:.2f}"))
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
        lines = [f"fuser: {len(self.regions)} fused regions, {len(self.unfused)} ops left to eager"]
        lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
        if self.regions:
            total = self.bytes_unfused / self.bytes_fused if self.bytes_fused else 1.0
            lines.append(f"HBM bytes in fused regions: {_bytes(self.bytes_unfused)} unfused -> "
                         f"{_bytes(self.bytes_fused)} fused (k = {total:.2f})")
        if self.unfused:
            reasons: dict[str, list[str]] = {}
            for u in self.unfused:
                reasons.setdefault(u.reason, []).append(u.op.replace("aten.", ""))
            lines.append("left to eager:")
            for reason, ops in reasons.items():
                names = ", ".join(f"{o} x{ops.count(o)}" if ops.count(o) > 1 else o for o in dict.fromkeys(ops))
                lines.append(f"  {names}: {reason}")
        lines += [f"left to eager as a whole: {f}" for f in self.all_fallbacks]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _bytes(b: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b} B"
