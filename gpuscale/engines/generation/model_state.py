"""What the engine notices about the model at each call: its train/eval mode (left as found) and its
structure (modules, hooks, parameter addresses), whose changes invalidate fused weights, compiled
steps and captured CUDA graphs."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def evaluation_mode(model: torch.nn.Module):
    """The model in eval mode (dropout off: log-probs must be the model's own) for the duration, then
    every submodule back in the mode it was in, so that a training loop's model stays in training.
    A model already in eval mode (inference) costs one walk over its modules."""
    training = [module for module in model.modules() if module.training]
    if training:
        model.eval()
    try:
        yield
    finally:
        for module in training:
            module.training = True


def structure_signature(model: torch.nn.Module) -> tuple:
    """Equal between two calls unless a module was added, replaced or hooked, or a parameter or buffer
    moved to another address (a captured CUDA graph reads them at the old one).

    One walk over the modules and tensors per engine call, not per decode step. In-place updates
    (an optimizer step) keep the signature: graphs see them, fused copies refresh on their own.
    """
    hooks = torch.nn.modules.module
    modules = tuple(
        (id(m), type(m), (tuple(m._forward_hooks), tuple(m._forward_pre_hooks), "forward" in m.__dict__)
         if m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ else None)
        for m in model.modules()
    )
    tensors = tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))
    return modules, tensors, tuple(hooks._global_forward_hooks), tuple(hooks._global_forward_pre_hooks)
