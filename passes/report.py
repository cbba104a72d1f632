"""The rewrite report every optimized module carries as ``.fastopt_report``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

__all__ = ["Rewrite", "LeftAlone", "RewriteReport"]


@dataclass
class Rewrite:
    """One subgraph replaced by a fused operator.

    Attributes:
        pattern: The pattern variant that matched (e.g. ``explicit[mul_sum,masked_fill,...]``).
        where: ``module.path:node`` of the match.
        op: The fastopt operator the replacement runs.
        site: Key of the run-time shape record (see :func:`kernel_config`).
    """

    pattern: str
    where: str
    op: str
    site: str = ""

    def kernel_config(self) -> str:
        """The kernel configuration for the shape this site ran with, or when it is chosen."""
        from fastopt.passes.lowering import site_shapes

        shape = site_shapes(self.site)
        if shape is None or self.op not in ("temporal_attention",):
            return "chosen per call from config.kernels (shape not seen yet)" if shape is None \
                else f"per call from config.kernels, first shape {shape}"
        from fastopt.codegen.kernel_config import heuristic_config

        slots, heads, dim = shape
        cfg = heuristic_config(slots, heads, dim)
        knobs = ", ".join(f"{k}={v}" for k, v in cfg.to_dict().items())
        return f"K={slots} H={heads} d={dim}: {knobs}"


@dataclass
class LeftAlone:
    """A candidate (or a whole module) not rewritten, and why."""

    pass_name: str
    where: str
    reason: str


@dataclass
class RewriteReport:
    """What :func:`fastopt.optimize` did to a model.

    Attributes:
        model: Class name of the optimized model.
        traced: Module paths traced as a whole (``<root>`` for the model itself).
        rewrites: Every rewrite applied.
        left_alone: Every candidate or module left as it was, with the reason.
        passes: Names of the passes in the pipeline, in order.
    """

    model: str
    traced: List[str] = field(default_factory=list)
    rewrites: List[Rewrite] = field(default_factory=list)
    left_alone: List[LeftAlone] = field(default_factory=list)
    passes: List[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.rewrites)

    def rewritten_modules(self) -> List[str]:
        """Module paths with at least one rewrite, in order."""
        seen: List[str] = []
        for r in self.rewrites:
            path = r.where.split(":")[0]
            if path not in seen:
                seen.append(path)
        return seen

    def count(self, op: Optional[str] = None) -> int:
        return sum(1 for r in self.rewrites if op is None or r.op == op)

    def __str__(self) -> str:
        lines = [f"fastopt report for {self.model}: {len(self.rewrites)} rewrite(s), "
                 f"{len(self.left_alone)} left alone"]
        lines.append(f"  traced: {', '.join(self.traced) or 'nothing'}")
        lines.append(f"  pipeline: {' -> '.join(self.passes)}")
        if self.rewrites:
            lines.append("  rewrites:")
            for r in self.rewrites:
                lines.append(f"    {r.where}  {r.pattern} -> fastopt.codegen.{r.op}")
                lines.append(f"        kernel: {r.kernel_config()}")
        if self.left_alone:
            lines.append("  left alone:")
            for a in self.left_alone:
                lines.append(f"    {a.where}  [{a.pass_name}] {a.reason}")
        return "\n".join(lines)

    __repr__ = __str__
