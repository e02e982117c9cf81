"""The fusion report: for every region its ops, shapes, bytes unfused vs fused and k; every node left eager and why."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Callable

import sympy


@dataclass
class RegionReport:
    """One region.  Its bytes are expressions in the graph's sizes (ints where sizes are static,
    Dynamo's size symbols where they vary); `bytes_fused`, `bytes_unfused` and `k` are their values
    at `sizes`: the sizes of the kernel's latest call, else those seen at capture."""
    id: int
    graph: int
    kind: str                 # "pointwise" | "reduction" | "attention"
    ops: list[str]            # ATen op names, in graph order
    input_shapes: list[str]
    output_shapes: list[str]
    bytes_unfused_expr: sympy.Expr
    bytes_fused_expr: sympy.Expr
    launches_unfused: int
    kernel: str
    source: str = field(repr=False)
    hints: dict = field(default_factory=dict)  # size symbol -> its value at capture
    seen: Callable | None = field(default=None, repr=False, compare=False)  # sizes of the latest call
    lowering: str = ""  # attention: which lowering (sdpa, our triton kernel) and why

    @property
    def symbolic(self) -> bool:
        return bool(self.bytes_fused_expr.free_symbols | self.bytes_unfused_expr.free_symbols)

    @property
    def sizes(self) -> dict:
        latest = self.seen() if self.seen is not None else None
        return {**self.hints, **(latest or {})}

    def _at(self, e) -> int:
        if e.is_Integer:
            return int(e)
        values = self.sizes
        return int(e.xreplace({s: values[s] for s in e.free_symbols}))

    @property
    def bytes_unfused(self) -> int:
        return self._at(self.bytes_unfused_expr)

    @property
    def bytes_fused(self) -> int:
        return self._at(self.bytes_fused_expr)

    @property
    def k(self) -> float:
        fused = self.bytes_fused
        return self.bytes_unfused / fused if fused else 1.0

    def as_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("seen", "hints")}
        out.update(bytes_unfused_expr=str(self.bytes_unfused_expr), bytes_fused_expr=str(self.bytes_fused_expr),
                   bytes_unfused=self.bytes_unfused, bytes_fused=self.bytes_fused, k=self.k,
                   sizes={str(s): v for s, v in self.sizes.items()})
        return out


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
    forward: int | None = None  # a backward graph's: the index of the forward graph it belongs to

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
        regions = [r.as_dict() for r in self.regions]
        return json.dumps({"regions": regions, "unfused": [asdict(u) for u in self.unfused],
                           "notes": self.notes, "fallbacks": self.all_fallbacks}, indent=1)

    def __str__(self) -> str:
        rows = [("#", "kind", "ops", "shape", "unfused", "fused", "k")]
        symbolic = []
        for r in self.regions:
            ops = [o.replace("aten.", "").split(".")[0] for o in r.ops]
            short = ", ".join(dict.fromkeys(ops))
            rows.append((f"{r.graph}.{r.id}", r.kind, short if len(short) < 60 else short[:57] + "...",
                         _shapes(r.output_shapes), _bytes(r.bytes_unfused),
                         _bytes(r.bytes_fused), f"{r.k:.2f}"))
            if r.symbolic:
                symbolic.append(r)
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
        lines = [f"fuser: {len(self.regions)} fused regions, {len(self.unfused)} ops left to eager"]
        lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
        if self.regions:
            total = self.bytes_unfused / self.bytes_fused if self.bytes_fused else 1.0
            lines.append(f"HBM bytes in fused regions: {_bytes(self.bytes_unfused)} unfused -> "
                         f"{_bytes(self.bytes_fused)} fused (k = {total:.2f})")
        for r in self.regions:
            if r.lowering:
                lines.append(f"  {r.graph}.{r.id} attention -> {r.lowering}" + (f": {r.source}" if r.kernel == "sdpa" else ""))
        for r in symbolic:
            at = ", ".join(f"{s}={v}" for s, v in sorted(r.sizes.items(), key=lambda kv: str(kv[0])))
            lines.append(f"  {r.graph}.{r.id} over symbolic sizes: fused {r.bytes_fused_expr} B, unfused "
                         f"{r.bytes_unfused_expr} B; values above at {at}")
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


def _shapes(shapes: list[str]) -> str:
    """The first output's shape, and how many other shapes a horizontally fused region stores."""
    others = len(set(shapes[1:]) - {shapes[0]}) if shapes else 0
    return (shapes[0] if shapes else "") + (f" (+{others} shape{'s' * (others > 1)})" if others else "")


def _bytes(b: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b} B"
