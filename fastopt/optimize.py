"""``fastopt.optimize``: the front door. Hand over a PyTorch TGNN, get it back fused."""

from __future__ import annotations

import contextlib
from typing import Tuple, Union

import torch
from torch import nn

from fastopt.config import Config, default_config, patch, resolve_config
from fastopt.errors import TraceError

__all__ = ["optimize"]


# the config groups an optimized model runs under, the only ones a tuning record sets here
_TUNED_GROUPS = ("kernels", "passes")


def _changes(cfg: Config) -> dict:
    """``patch`` keywords turning the process configuration's kernels/passes groups into ``cfg``'s."""
    base = default_config().to_dict()
    return {f"{group}__{name}": value
            for group in _TUNED_GROUPS
            for name, value in cfg.to_dict()[group].items() if base[group][name] != value}


def optimize(model: nn.Module, *, config: Union[str, Config, dict, None] = "auto",
             verify: bool = False) -> nn.Module:
    """Rewrite ``model``'s attention, aggregation and time-encoding code onto fused operators.

    The model is traced with torch.fx (per submodule where the whole model does not trace) and
    the pipeline of :mod:`fastopt.passes` replaces each recognized subgraph by a fused operator
    of :mod:`fastopt.codegen`. What cannot be traced or proved equivalent is left as it was.

    Args:
        model: An ``nn.Module``; it is not modified.
        config: ``"auto"`` (the process configuration, :func:`fastopt.default_config`, with
            the ``kernels`` and ``passes`` values of the tuning record of this device and model,
            see :mod:`fastopt.tuner.records`), a :class:`fastopt.Config` or a dict of config
            groups. Its ``kernels`` group (backend, thread mapping) and ``passes`` group
            (``fuse_dropout``, ``cuda_graphs``, ...) apply while the passes rewrite and while the
            optimized modules run; ``"auto"`` follows the process configuration as it changes,
            except for the values a record set. The device is that of the model's parameters
            (move the model before optimizing it); the report's ``config`` line names the record
            used, or says that none matched.
        verify: Run the eager and the optimized computation side by side on the first calls of
            every rewritten module (outputs, and parameter and input gradients where autograd
            records) and raise if they disagree; the report's ``verified against
            eager`` section states the calls compared and the largest difference.

    On CUDA, the optimized model's forward and backward are captured in CUDA graphs, one pair per
    call signature (``config.passes.cuda_graphs``, ``max_graphs``; see
    :mod:`fastopt.runtime.graphs`): the whole model where its forward can be captured, else its
    rewritten layers. The report's ``cuda graphs`` section says what was captured and why not.

    Returns:
        A module sharing ``model``'s parameters, buffers and submodules (same ``state_dict`` keys;
        an optimizer built on either trains both), with ``.fastopt_report`` (a
        :class:`fastopt.passes.RewriteReport`; ``print`` it). ``model`` itself when nothing was
        rewritten (its report attached to it says why).

    Raises:
        TraceError: A pass failed (naming the pass and the passes before it), or, with
            ``verify=True``, optimized and eager outputs or gradients differ (naming the
            largest difference).
        ConfigError: ``config`` is not a valid configuration.
    """
    # here, not at the top: ``import fastopt`` re-exports this function and must not load the
    # passes (torch.fx) for a user of the runtime or the kernels alone
    from fastopt.passes import optimize_module

    if not isinstance(model, nn.Module):
        raise TraceError(f"optimize expects a torch.nn.Module (got {type(model).__name__}); "
                         f"wrap the function in an nn.Module")
    cfg = resolve_config(config)
    tuning = None
    if config is None or isinstance(config, str):
        cfg, tuning = _apply_record(cfg, model)
    changes = _changes(cfg)
    # the passes read the configuration too (fuse_time_encoding, decided when optimizing)
    with patch(**changes) if changes else contextlib.nullcontext():
        optimized, report = optimize_module(model, verify=verify, changes=changes)
    report.tuning = tuning
    object.__setattr__(optimized, "fastopt_report", report)
    return optimized


def _apply_record(cfg: Config, model: nn.Module) -> Tuple[Config, str]:
    """``cfg`` with the kernel and pass values of the tuning record matching ``model`` on its
    parameters' device (no dataset: a record of the same model fingerprint), and the report's
    line saying which record, if any."""
    from fastopt.trainer import tuning_fingerprint
    from fastopt.tuner.records import apply_tuned

    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    cfg, match = apply_tuned(cfg, lambda: tuning_fingerprint(model), None, device,
                             groups=_TUNED_GROUPS)
    return cfg, match.describe() if match else "no tuned record matches this device and model; defaults"
