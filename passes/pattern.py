"""Graph-matching helpers shared by the pattern files, and the base class of a rewrite pass.

A pattern file (``attention.py``, ``attention_mha.py``, ...) states its pattern as the plain
Python code it recognizes (in its docstring and as the ``Before`` functions of its golden tests)
and its replacement as a plain Python function beside it (its lowering). Matching walks
the graph from an anchor node (the softmax, the ``nn.MultiheadAttention`` call, ...) because the
styles real TGNN code uses differ in ways a fixed subgraph cannot enumerate (einsum equations,
``unsqueeze`` versus ``[..., None]``, scales as products or quotients). Conditions a pattern cannot
express are checked by :meth:`RewritePass.check` at rewrite time, or by the replacement on the
actual tensors at run time, which falls back to the original computation when they fail.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import fx, nn

from fastopt.passes.report import LeftAlone, Rewrite

__all__ = [
    "Match",
    "RewritePass",
    "call",
    "gather_of",
    "literal",
    "same_value",
    "single_user",
    "unsqueeze_dim",
    "module_of",
    "bool_provenance",
    "writes_in_place",
    "is_lowering",
    "IN_PLACE_OPERATORS",
]


def call(node: Any, functions: Iterable[Callable] = (), methods: Iterable[str] = ()) -> bool:
    """Whether ``node`` calls one of ``functions`` or one of the tensor ``methods``."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        return node.target in tuple(functions)
    if node.op == "call_method":
        return node.target in tuple(methods)
    return False


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``index`` (positional) or ``name`` (keyword) of a call node."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def gather_of(node: Any) -> Optional[Tuple[fx.Node, fx.Node]]:
    """``(table, index)`` if ``node`` gathers rows of a table by a tensor index (``table[index]``
    or ``table.index_select(0, index)``), else None."""
    if call(node, (operator.getitem,)) and isinstance(node.args[1], fx.Node):
        return node.args[0], node.args[1]
    if call(node, (torch.index_select,), ("index_select",)) and arg(node, 1, "dim") == 0:
        return node.args[0], arg(node, 2, "index")
    return None


def literal(value: Any) -> bool:
    """Whether ``value`` is a Python number baked into the graph (not a tensor-valued node)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def single_user(node: fx.Node) -> Optional[fx.Node]:
    """The only user of ``node``, or None."""
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def same_value(a: Any, b: Any) -> bool:
    """Whether two graph values are provably equal: the same node, or the same pure call of equal arguments."""
    if a is b:
        return True
    if isinstance(a, fx.Node) and isinstance(b, fx.Node):
        if a.op != b.op or a.target != b.target or a.op not in ("call_function", "call_method"):
            return False
        return same_value(a.args, b.args) and same_value(a.kwargs, b.kwargs)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_value, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def unsqueeze_dim(node: fx.Node) -> Optional[int]:
    """The dimension ``node`` inserts if it is ``x.unsqueeze(d)`` or ``x[..., None]``-like, else None."""
    if call(node, (torch.unsqueeze,), ("unsqueeze",)):
        d = arg(node, 1, "dim")
        return d if isinstance(d, int) else None
    if call(node, (operator.getitem,)) and isinstance(node.args[1], tuple):
        index = node.args[1]
        nones = [i for i, x in enumerate(index) if x is None]
        rest_ok = all(x is None or x is Ellipsis or x == slice(None) for x in index)
        if len(nones) != 1 or not rest_ok or index.count(Ellipsis) > 1:
            return None
        pos = nones[0]
        if Ellipsis in index and index.index(Ellipsis) < pos:
            return pos - len(index)  # counted from the end
        return pos
    return None


def module_of(gm: fx.GraphModule, node: Any, kinds: Tuple[type, ...]) -> Optional[nn.Module]:
    """The submodule a ``call_module`` node calls, if it is an instance of ``kinds``."""
    if not isinstance(node, fx.Node) or node.op != "call_module":
        return None
    mod = gm.get_submodule(node.target)
    return mod if isinstance(mod, kinds) else None


def is_lowering(target: Any) -> bool:
    """Whether a ``call_function`` target is a lowering of ``fastopt.passes``: a function an earlier
    rewrite put into the graph (each family keeps its lowering beside its pattern, so they live in
    several modules of this package; no user code calls them)."""
    return (getattr(target, "__module__", None) or "").startswith("fastopt.passes.")


# Run-time shape records are keyed by site; the counter keeps equal paths of two models apart.
_SITES = itertools.count()

_BOOL_FUNCS = (operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
               torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge, torch.logical_not,
               torch.logical_and, torch.logical_or, torch.isnan, torch.isinf, torch.isfinite)
_BOOL_METHODS = ("eq", "ne", "lt", "le", "gt", "ge", "bool", "logical_not", "logical_and",
                 "logical_or", "any", "all", "isnan")
_SHAPE_METHODS = ("unsqueeze", "view", "reshape", "expand", "expand_as", "transpose", "permute",
                  "squeeze", "contiguous", "repeat", "flatten")
_FLOAT_METHODS = ("float", "double", "half", "bfloat16", "softmax", "sum", "mean")
_ARITH = (operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.sub,
          torch.mul, torch.div)


def bool_provenance(node: Any) -> Optional[bool]:
    """Static dtype knowledge: True if ``node`` is surely boolean, False if surely not, None if unknown."""
    if not isinstance(node, fx.Node):
        return isinstance(node, bool) or None
    if call(node, _BOOL_FUNCS, _BOOL_METHODS):
        return True
    if call(node, (operator.invert, operator.and_, operator.or_, operator.xor)):
        known = [bool_provenance(a) for a in node.args if isinstance(a, fx.Node)]
        return True if known and all(known) else None
    if call(node, (torch.unsqueeze, operator.getitem, torch.reshape, torch.transpose, torch.permute),
            _SHAPE_METHODS):
        return bool_provenance(node.args[0])
    if call(node, (), ("to", "type")):
        target = node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
        if isinstance(target, torch.dtype):
            return target == torch.bool
        return None
    if call(node, _ARITH, _FLOAT_METHODS) or call(node, (torch.softmax, F.softmax)):
        return False
    return None


@dataclass
class Match:
    """One occurrence of a pattern: where it is and what the replacement needs.

    Attributes:
        anchor: The node the matcher started from (its name locates the match).
        output: The node whose value the replacement computes.
        nodes: Nodes of the subgraph the replacement removes (when unused afterwards).
        target: The replacement function (a lowering beside the pattern).
        args: Its positional arguments (nodes, or ``("module", path)`` for a submodule).
        kwargs: Its keyword literals.
        op: The fastopt operator it runs, for the report.
        pattern: The pattern variant that matched, for the report.
    """

    anchor: fx.Node
    output: fx.Node
    nodes: List[fx.Node]
    target: Callable
    args: Sequence[Any]
    kwargs: Dict[str, Any]
    op: str
    pattern: str


# Operators that write into their left operand (fx records ``x += y`` on a proxy as ``add``, but a
# graph built by hand may hold these).
IN_PLACE_OPERATORS = (operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul,
                      operator.iand, operator.ior, operator.ixor, operator.ilshift,
                      operator.irshift, operator.iconcat)


def writes_in_place(node: fx.Node) -> bool:
    """Whether ``node`` has an effect beyond its value: fx's impure nodes, in-place tensor methods
    and functions (``x.add_(1)``, ``torch.relu_(x)``, whose result nobody may read), in-place
    operators, ``out=`` and ``inplace=True`` calls, and modules built with ``inplace=True``.
    Dead-code elimination after a rewrite must keep these."""
    if node.is_impure():
        return True
    target = node.target
    if node.op == "call_method":
        return target.endswith("_") and not target.startswith("__")
    if node.op == "call_module":
        owner = node.graph.owning_module
        module = owner.get_submodule(target) if owner is not None else None
        return bool(getattr(module, "inplace", False))
    if node.op != "call_function":
        return False
    if target in IN_PLACE_OPERATORS:
        return True
    name = getattr(target, "__name__", "")
    if getattr(target, "__module__", None) != "_operator" and name.endswith("_") and \
            not name.startswith("__"):
        return True
    return node.kwargs.get("out") is not None or node.kwargs.get("inplace") is True


class RewritePass:
    """A named rewrite: find anchors, match, check, replace; count matches.

    Subclasses set ``name`` (a verb phrase) and implement :meth:`anchors` and :meth:`match`
    (returning a :class:`Match` or the reason the anchor is left alone); :meth:`check` adds the
    conditions a pattern cannot express. Calling the pass on a ``GraphModule`` returns
    ``(graph_module, modified)`` like ``torch.fx.passes.infra.pass_base.PassResult``.

    Attributes:
        matches: Rewrites applied since construction (tests assert on it).
        rewrites: :class:`Rewrite` records of this run.
        left_alone: :class:`LeftAlone` records of this run.
    """

    name = "rewrite"

    def __init__(self) -> None:
        self.matches = 0
        self.rewrites: List[Rewrite] = []
        self.left_alone: List[LeftAlone] = []
        self.module_path = ""

    def anchors(self, gm: fx.GraphModule) -> List[fx.Node]:
        raise NotImplementedError

    def match(self, gm: fx.GraphModule, anchor: fx.Node) -> Union[Match, str, None]:
        """A :class:`Match`, the reason a candidate is left alone, or None for a non-candidate."""
        raise NotImplementedError

    def check(self, gm: fx.GraphModule, m: Match) -> Optional[str]:
        """Extra conditions on a match; a string says why it is left alone."""
        interior = set(m.nodes) - {m.output}
        for node in interior:
            outside = [u for u in node.users if u not in m.nodes]
            if outside:
                return (f"intermediate {node.name} is also used by {outside[0].name}; fusing would "
                        f"recompute or drop it")
        return None

    def __call__(self, gm: fx.GraphModule) -> Tuple[fx.GraphModule, bool]:
        modified = False
        for anchor in self.anchors(gm):
            if anchor.graph is not gm.graph or anchor not in anchor.graph.nodes:
                continue  # removed by an earlier rewrite of this pass
            got = self.match(gm, anchor)
            if got is None:
                continue  # not a candidate at all
            reason = got if isinstance(got, str) else self.check(gm, got)
            where = self._where(anchor)
            if reason is not None:
                self.left_alone.append(LeftAlone(self.name, where, reason))
                continue
            self._replace(gm, got)
            self.matches += 1
            modified = True
            self.rewrites.append(Rewrite(got.pattern, where, got.op, site=got.kwargs["site"]))
        if modified:
            # Mask expressions only the removed subgraph read (e.g. a second ~mask[..., None]).
            gm.graph.eliminate_dead_code(is_impure_node=writes_in_place)
            gm.graph.lint()
            gm.recompile()
        return gm, modified

    def _where(self, anchor: fx.Node) -> str:
        stack = anchor.meta.get("nn_module_stack")
        inner = next(reversed(stack.values()))[0] if stack else ""
        path = ".".join(p for p in (self.module_path, inner) if p)
        return f"{path or '<root>'}:{anchor.name}"

    def new_site(self, anchor: fx.Node) -> str:
        """A fresh key of a rewrite's run-time shape record: its place, numbered once per process
        (equal places of two models stay apart)."""
        return f"{self._where(anchor)}#{next(_SITES)}"

    def _replace(self, gm: fx.GraphModule, m: Match) -> None:
        graph = gm.graph
        m.kwargs["site"] = self.new_site(m.anchor)
        with graph.inserting_before(m.output):
            args = [graph.get_attr(a[1]) if isinstance(a, tuple) and a and a[0] == "module" else a
                    for a in m.args]
            new = graph.call_function(m.target, tuple(args), dict(m.kwargs))
        new.meta.update({k: v for k, v in m.output.meta.items() if k == "nn_module_stack"})
        m.output.replace_all_uses_with(new)
        for node in reversed(list(graph.nodes)):
            if node in m.nodes and not node.users:
                graph.erase_node(node)

