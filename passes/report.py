"""The rewrite report every optimized module carries as ``.fastopt_report``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

from fastopt.codegen import attention_mapping
from fastopt.runtime import GraphCapture

__all__ = ["Rewrite", "LeftAlone", "Verification", "RewriteReport"]


@dataclass
class Rewrite:
    """One subgraph replaced by a fused operator.

    Attributes:
        pattern: The pattern variant that matched (e.g. ``explicit[mul_sum,masked_fill,...]``).
        where: ``module.path:node`` of the match.
        op: The fastopt operator the replacement runs.
        site: Key of the run-time shape record (:attr:`RewriteReport.site_shapes`).
    """

    pattern: str
    where: str
    op: str
    site: str = ""

    def kernel_config(self, shape: Optional[Tuple[int, ...]]) -> str:
        """The kernel configuration for ``shape``, the shape this site ran with first (None
        before its first fused call, ``()`` when that call ran the code it replaces)."""
        if self.op in ("linear_over_parts", "linears_over_parts"):
            return ("none (two matrix products; widths seen on the first split call)"
                    if shape is None else f"none (two matrix products over input widths "
                                          f"{shape[0]} without and {shape[1]} with gradient)")
        if self.op == "tensor_message_store":
            return "none (the message store and memory update on tensors; no kernel of its own)"
        if shape == ():
            return ("none: the first call ran the code it replaces (the mode in config.passes, "
                    "tensors the fused operator does not take, or a device without generated "
                    "kernels such as the CPU, where that code is the faster)")
        if shape is None or self.op not in ("temporal_attention",):
            return "chosen per call from config.kernels (shape not seen yet)" if shape is None \
                else f"per call from config.kernels, first shape {shape}"
        return attention_mapping(*shape)


@dataclass
class LeftAlone:
    """A candidate (or a whole module) not rewritten, and why."""

    pass_name: str
    where: str
    reason: str


@dataclass
class Verification:
    """``verify=True``: what was compared against eager for one rewritten module, and the result.

    Attributes:
        where: Module path (``<root>`` for the model).
        calls: Calls whose outputs were compared so far.
        with_gradients: Of those, the calls whose parameter and input gradients were compared too
            (the calls made while autograd records).
        largest: The largest absolute difference of any floating-point output or gradient element.
    """

    where: str
    calls: int = 0
    with_gradients: int = 0
    largest: float = 0.0

    def add(self, largest: float, gradients: bool) -> None:
        """Count one compared call (``gradients``: its gradients were compared too)."""
        self.calls += 1
        self.with_gradients += gradients
        self.largest = max(self.largest, largest)

    def __str__(self) -> str:
        if not self.calls:
            return f"{self.where}  waiting for its first call"
        what = "outputs" if not self.with_gradients else (
            f"outputs and, in {self.with_gradients} of them, parameter and input gradients")
        return (f"{self.where}  {self.calls} call(s) compared: {what} within tolerance, largest "
                f"absolute difference {self.largest:.3g} (float32 allows 1e-05 + 1e-04 * |eager|; "
                f"gradients 1e-05 * their largest element + 1e-04 * |eager|)")


@dataclass
class RewriteReport:
    """What :func:`fastopt.optimize` did to a model.

    Attributes:
        model: Class name of the optimized model.
        traced: Module paths traced as a whole (``<root>`` for the model itself).
        rewrites: Every rewrite applied.
        left_alone: Every candidate or module left as it was, with the reason.
        passes: Names of the passes in the pipeline, in order.
        graphs: CUDA-graph state of the root and of each rewritten module: the records their
            graph runners keep up to date as the optimized model runs (:mod:`fastopt.runtime.graphs`).
        verifications: With ``verify=True``, each rewritten module's comparisons against its
            eager forward (filled in by its first calls).
        site_shapes: The shape each rewrite site ran with first, by site (``None`` before its first
            fused call): handed over by the pipeline, which records them as the model runs.
        tuning: With ``config="auto"``, which tuning record's values apply (one line, handed over
            by :func:`fastopt.optimize`, which reads the records); None for an explicit config.
    """

    model: str
    traced: List[str] = field(default_factory=list)
    rewrites: List[Rewrite] = field(default_factory=list)
    left_alone: List[LeftAlone] = field(default_factory=list)
    passes: List[str] = field(default_factory=list)
    graphs: List[GraphCapture] = field(default_factory=list)
    verifications: List[Verification] = field(default_factory=list)
    site_shapes: Callable[[str], Optional[Tuple[int, ...]]] = field(
        default=lambda site: None, repr=False, compare=False)
    tuning: Optional[str] = None

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

    def captured_modules(self) -> List[str]:
        """Module paths whose calls replay CUDA graphs now."""
        return [g.where for g in self.graphs if g.state == "captured"]

    def count(self, op: Optional[str] = None) -> int:
        return sum(1 for r in self.rewrites if op is None or r.op == op)

    def __str__(self) -> str:
        lines = [f"fastopt report for {self.model}: {len(self.rewrites)} rewrite(s), "
                 f"{len(self.left_alone)} left alone"]
        lines.append(f"  traced: {', '.join(self.traced) or 'nothing'}")
        lines.append(f"  pipeline: {' -> '.join(self.passes)}")
        if self.tuning is not None:
            lines.append(f"  config: {self.tuning}")
        if self.rewrites:
            lines.append("  rewrites:")
            for r in self.rewrites:
                home = _HOMES.get(r.op, "codegen")
                lines.append(f"    {r.where}  {r.pattern} -> fastopt.{home}.{r.op}")
                lines.append(f"        kernel: {r.kernel_config(self.site_shapes(r.site))}")
        if self.left_alone:
            lines.append("  left alone:")
            for a in self.left_alone:
                lines.append(f"    {a.where}  [{a.pass_name}] {a.reason}")
        if self.verifications:
            lines.append("  verified against eager (verify=True; the first calls):")
            lines.extend(f"    {v}" for v in self.verifications)
        if self.graphs and _cuda_available():  # on a CPU-only machine there is nothing to capture
            lines.append("  cuda graphs:")
            lines.extend(f"    {g}" for g in self.graphs)
        return "\n".join(lines)

    __repr__ = __str__


# where the report says an operator lives, when not in fastopt.codegen
_HOMES = {"linear_over_parts": "passes.split_linear_lowering",
          "linears_over_parts": "passes.split_linear_lowering",
          "tensor_message_store": "passes.pyg_memory"}


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
