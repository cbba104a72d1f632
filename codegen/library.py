"""The one way an operator of a kernel family is registered: :func:`fused_op`.

A fused operator is a ``torch.library`` custom op ``fastopt::<name>`` with a fake (meta)
implementation and an autograd formula whose backward is itself a custom op
``fastopt::<name>_backward``, so ``torch.compile``, fx and ``gradcheck`` see a single node each
way. The five registrations differ between families only in a few facts, which :func:`fused_op`
takes:

- the forward's signature and fake, as one annotated function: the schema is inferred from the
  annotations, the body returns empty outputs of the right shapes;
- the names of the outputs, those of them without a gradient (a log-sum-exp kept for the
  backward) and whether the backward reads them;
- the inputs that get gradients;
- a ``(kernel launcher, reference)`` pair per direction; :func:`select_backend` picks one per call.

The backward op takes the gradients of the differentiable outputs, the inputs that get
gradients, the outputs (where the backward reads them) and the remaining inputs, in that order,
and returns one gradient per input that gets one; its fake returns tensors like those inputs.
Implementations take the tensors of the first three groups by position and the remaining inputs
by name (``mask=..., scale=...``), so a launcher and its reference share one signature.

A family may also ask for a direct path (``eager_backward``): an ``autograd.Function`` twin of
the op's autograd (same kernels, same saved tensors, same formula) that runs the launchers
without the custom-op dispatch layers, for kernels that take less device time at training batch
sizes than those layers take host time (the attention). Only plain tensors outside any trace
take it (:func:`eager_kernels`); traces and compiled graphs keep seeing the one custom op.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import operator
import os
import warnings
from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils import _python_dispatch

from fastopt.config import default_config
from fastopt.errors import KernelError

__all__ = ["fused_op", "FusedOp", "select_backend", "eager_kernels", "triton_available"]

# (kernel launcher, plain-PyTorch reference) of one direction of an operator
Implementations = Tuple[Callable, Callable]


def select_backend(t: Tensor) -> str:
    """``"triton"`` or ``"reference"`` for an operator whose inputs live where ``t`` lives.

    Read from ``config.kernels`` at call time: ``backend = "auto"`` runs the generated kernels on
    CUDA tensors and the references on CPU tensors; ``"triton"`` runs the kernels everywhere (on
    the CPU through the Triton interpreter, ``TRITON_INTERPRET=1``: how CI tests the kernels);
    ``"reference"`` (or ``enabled = False``) runs the references everywhere.

    triton is optional (``pip install "fastopt[gpu]"``): without it ``"auto"`` runs the references
    on CUDA tensors too, with a warning, and ``"triton"`` is an error naming the package.
    """
    cfg = default_config().kernels
    if not cfg.enabled or cfg.backend == "reference":
        return "reference"
    if cfg.backend == "auto":
        if t.is_cuda and not triton_available():
            warnings.warn("triton is not installed, so the generated kernels cannot run on CUDA: "
                          "fastopt runs their references or the code they replace (slower); pip "
                          "install \"fastopt[gpu]\" to get them", RuntimeWarning, stacklevel=2)
            return "reference"
        return "triton" if t.is_cuda else "reference"
    if not triton_available():
        raise KernelError("kernels.backend='triton' needs the triton package, which is not installed; "
                          "pip install \"fastopt[gpu]\" (or triton), or use backend 'auto' or 'reference'")
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise KernelError(
            f"kernels.backend='triton' on a {t.device} tensor needs the Triton interpreter; set "
            f"TRITON_INTERPRET=1 before importing triton, or use backend 'auto'"
        )
    return "triton"


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether the ``triton`` package is installed (looked up once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)


def eager_kernels(*tensors: Optional[Tensor]) -> bool:
    """Whether a call may run the kernels directly: eager mode, plain tensors, Triton backend
    for the first tensor."""
    if torch.compiler.is_compiling() or _python_dispatch._get_current_dispatch_mode() is not None:
        return False
    if torch._C._is_torch_function_mode_enabled():
        return False
    if any(t is not None and type(t) not in _PLAIN_TENSORS for t in tensors):
        return False
    return select_backend(tensors[0]) == "triton"


def _is_tensor_type(annotation) -> bool:
    return annotation is Tensor or annotation == Optional[Tensor]


def _getter(indices: Sequence[int]) -> Callable[[Sequence], tuple]:
    """``values -> tuple(values[i] for i in indices)``, at the speed of ``itemgetter``."""
    if len(indices) == 1:
        index = indices[0]
        return lambda values: (values[index],)
    return operator.itemgetter(*indices) if indices else (lambda values: ())


def _custom_op(name: str, run: Callable, signature: inspect.Signature, fake: Callable):
    """``fastopt::<name>`` running ``run``, its schema inferred from ``signature``."""
    def implementation(*args):
        return run(*args)

    implementation.__signature__ = signature
    op = torch.library.custom_op(f"fastopt::{name}", implementation, mutates_args=())
    op.register_fake(fake)
    return op


class FusedOp:
    """A registered operator (see :func:`fused_op`).

    ``op(*args)`` runs ``fastopt::<name>`` on the forward's arguments, all given by position,
    and returns its differentiable outputs (one tensor, or a tuple); ``op(*args, eager=True)``
    runs the direct twin instead (only for a family registered with ``eager_backward``, and only
    where :func:`eager_kernels` holds).
    """

    def __init__(self, name: str, prototype: Callable, *, grad_inputs: Sequence[str],
                 outputs: Sequence[str], nondifferentiable: Sequence[str], save_outputs: bool,
                 forward: Implementations, backward: Implementations,
                 eager_backward: Optional[Callable]):
        signature = inspect.signature(prototype, eval_str=True)
        params = list(signature.parameters.values())
        names = [p.name for p in params]
        if not grad_inputs or not set(grad_inputs) <= set(names) or \
                not set(nondifferentiable) < set(outputs):
            raise KernelError(f"fused_op {name!r}: grad_inputs {tuple(grad_inputs)} must name "
                              f"inputs of {tuple(names)} and nondifferentiable "
                              f"{tuple(nondifferentiable)} some of the outputs {tuple(outputs)}")
        self.name = name
        self.fake = prototype
        self._forward, self._backward = forward, backward
        grad_at = [names.index(n) for n in grad_inputs]
        rest_at = [i for i, n in enumerate(names) if n not in grad_inputs]
        tensor_rest = [i for i in rest_at if _is_tensor_type(params[i].annotation)]
        hyper = [i for i in rest_at if i not in tensor_rest]
        visible = [i for i, n in enumerate(outputs) if n not in nondifferentiable]
        self._first_grad_input = grad_at[0]
        self._grad_inputs, self._rest = _getter(grad_at), _getter(rest_at)
        self._tensor_rest, self._hyper = _getter(tensor_rest), _getter(hyper)
        self._rest_names = tuple(names[i] for i in rest_at)
        # saved tensors and hyperparameters -> the remaining inputs in the forward's order
        self._rest_order = _getter([(tensor_rest + hyper).index(i) for i in rest_at])
        self._visible = _getter(visible)
        self._single = visible[0] if len(visible) == 1 else None
        self._hidden = _getter([i for i in range(len(outputs)) if i not in visible])
        self._saved_outputs = len(outputs) if save_outputs else 0
        self._grad_count, self._visible_count = len(grad_at), len(visible)
        # where each gradient goes among the forward's arguments (None elsewhere); where the
        # inputs with gradients come first, the gradients followed by Nones
        self._gradient_slots = tuple(grad_at.index(i) if i in grad_at else None
                                     for i in range(len(names)))
        leading = grad_at == list(range(len(grad_at)))
        self._padding = (None,) * (len(names) - len(grad_at)) if leading else None

        def tensor(param_name: str) -> inspect.Parameter:
            return inspect.Parameter(param_name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                     annotation=Tensor)

        gradients = Tuple[(Tensor,) * len(grad_at)] if len(grad_at) > 1 else Tensor
        backward_signature = inspect.Signature(
            [*(tensor(f"grad_{outputs[i]}") for i in visible), *(params[i] for i in grad_at),
             *(tensor(n) for n in outputs[:self._saved_outputs]), *(params[i] for i in rest_at)],
            return_annotation=gradients)
        self.op = _custom_op(name, self._run_forward, signature, prototype)
        self.backward_op = _custom_op(f"{name}_backward", self._run_backward, backward_signature,
                                      self._backward_fake)
        self.op.register_autograd(self._op_grad, setup_context=self._op_setup)
        self._packet = getattr(torch.ops.fastopt, name)
        self._backward_packet = getattr(torch.ops.fastopt, f"{name}_backward")
        self._eager = None if eager_backward is None else self._eager_function(eager_backward)

    def __call__(self, *args, eager: bool = False):
        if eager:
            return self._eager.apply(*args)
        return self._returned(self._packet(*args))

    # ------------------------------------------------------------------------------------------

    def _returned(self, outputs):
        """The differentiable outputs, as the op's callers get them."""
        if not isinstance(outputs, tuple):
            return outputs
        return outputs[self._single] if self._single is not None else self._visible(outputs)

    def _run_forward(self, *args):
        launcher, reference = self._forward
        chosen = launcher if select_backend(args[self._first_grad_input]) == "triton" else reference
        return chosen(*self._grad_inputs(args), **dict(zip(self._rest_names, self._rest(args))))

    def _run_backward(self, *args):
        # the gradients, the inputs with gradients and the saved outputs, then the rest
        head = self._visible_count + self._grad_count + self._saved_outputs
        launcher, reference = self._backward
        chosen = launcher if select_backend(args[self._visible_count]) == "triton" else reference
        return chosen(*args[:head], **dict(zip(self._rest_names, args[head:])))

    def _backward_fake(self, *args):
        inputs = args[self._visible_count:self._visible_count + self._grad_count]
        grads = tuple(torch.empty_like(t) for t in inputs)
        return grads if len(grads) > 1 else grads[0]

    def _save(self, ctx, args, outputs) -> None:
        ctx.save_for_backward(*self._grad_inputs(args), *outputs[:self._saved_outputs],
                              *self._tensor_rest(args))
        ctx.hyper = self._hyper(args)

    def _saved(self, ctx) -> Tuple[tuple, tuple]:
        """``(inputs with gradients + saved outputs, the remaining inputs in order)``."""
        saved = ctx.saved_tensors
        head = self._grad_count + self._saved_outputs
        return saved[:head], self._rest_order((*saved[head:], *ctx.hyper))

    def _input_grads(self, grads) -> tuple:
        """One gradient per forward argument (None for those without)."""
        grads = grads if isinstance(grads, (tuple, list)) else (grads,)
        if self._padding is not None:
            return (*grads, *self._padding)
        return tuple([None if slot is None else grads[slot] for slot in self._gradient_slots])

    def _op_setup(self, ctx, inputs, output) -> None:
        outputs = output if isinstance(output, tuple) else (output,)
        self._save(ctx, inputs, outputs)
        hidden = self._hidden(outputs)
        if hidden:
            ctx.mark_non_differentiable(*hidden)

    def _op_grad(self, ctx, *grads):
        # autograd hands zeros (never None) for an output the loss does not reach
        tensors, rest = self._saved(ctx)
        incoming = [g.contiguous() for g in self._visible(grads)]
        return self._input_grads(self._backward_packet(*incoming, *tensors, *rest))

    def _eager_function(self, eager_backward: Callable) -> type:
        op = self
        launcher = self._forward[0]

        def forward(ctx, *args):
            inputs = op._grad_inputs(args)
            outputs = launcher(*inputs, **dict(zip(op._rest_names, op._rest(args))))
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            ctx.save_for_backward(*inputs, *outputs[:op._saved_outputs], *op._tensor_rest(args))
            # a key held in a tensor is copied: the backward redraws this call's dropout mask,
            # and the caller may draw the next key into the same tensor first
            ctx.hyper = [h.clone() if isinstance(h, Tensor) else h for h in op._hyper(args)]
            return op._returned(outputs)

        def backward(ctx, *grads):
            tensors, rest = op._saved(ctx)
            incoming = [g.contiguous() for g in grads]
            return op._input_grads(eager_backward(*incoming, *tensors,
                                                  **dict(zip(op._rest_names, rest))))

        title = "".join(part.title() for part in self.name.split("_"))
        return type(f"Eager{title}", (torch.autograd.Function,), dict(
            forward=staticmethod(forward), backward=staticmethod(once_differentiable(backward)),
            __doc__=f"``fastopt::{self.name}`` run directly (see :func:`fused_op`)."))


def fused_op(name: str, *, grad_inputs: Sequence[str], forward: Implementations,
             backward: Implementations, outputs: Sequence[str] = ("out",),
             nondifferentiable: Sequence[str] = (), save_outputs: bool = False,
             eager_backward: Optional[Callable] = None) -> Callable[[Callable], FusedOp]:
    """Register ``fastopt::<name>`` and its backward from the annotated fake it decorates.

    Args:
        name: Operator name in the ``fastopt`` namespace.
        grad_inputs: Inputs that get gradients, in the order the backward returns them.
        forward: ``(launcher, reference)`` computing every output.
        backward: ``(launcher, reference)`` computing the gradients of ``grad_inputs``.
        outputs: Names of the forward's outputs.
        nondifferentiable: Outputs without a gradient (the op's callers do not see them).
        save_outputs: Whether the backward reads the outputs.
        eager_backward: The backward the direct twin runs (a launcher, perhaps with options the
            custom op may not use, such as outputs that alias each other); None: no twin.

    Returns:
        A decorator turning the fake (annotated like the op) into a :class:`FusedOp`.
    """
    def register(prototype: Callable) -> FusedOp:
        return FusedOp(name, prototype, grad_inputs=grad_inputs, outputs=outputs,
                       nondifferentiable=nondifferentiable, save_outputs=save_outputs,
                       forward=forward, backward=backward, eager_backward=eager_backward)

    return register
