"""The one precision rule: what a run's `precision` setting means on a device.

`resolved_precision(precision, compute_capability)` is the rule itself, pure and without torch:
`auto` is bf16 on GPUs of compute capability 8.0 and up, fp16 on older GPUs, fp32 on the CPU (no
capability); an explicit bf16, fp16 or fp32 is kept as it is. Everything that needs the answer calls
it: the control plane and the front ends with NVML's capability (app/batch_choice: a tuning result's
key), the ranks, the tuner and the model loader with a torch device (`device_precision`), which
then take their torch dtype from `torch_dtype`.

It lives on the lowest floor (data) so that every floor may import it: runs/ (the control plane,
which never imports torch) and the model loader (data/models.py) alike. torch is imported only
inside the two functions that take or give torch objects.
"""

from __future__ import annotations

from typing import Literal

# Resolved name -> torch's dtype attribute: the one table from a precision to a torch dtype, and the
# one declaration of the precision names; every other list of them derives from it.
TORCH_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
RESOLVED_PRECISIONS = tuple(TORCH_NAMES)  # what a precision means on a device: bf16, fp16, fp32
PRECISIONS = ("auto", *RESOLVED_PRECISIONS)  # what the `precision` setting takes
# The `precision` setting's type (runs/settings.py): pydantic refuses any other name, listing these.
Precision = Literal[*PRECISIONS]
# The rule in words: the `precision` setting's help (runs/settings.py) says exactly this.
AUTO_RULE = "auto = bf16 on compute capability >= 8.0, fp16 below, fp32 on CPU"


def resolved_precision(precision: str, compute_capability: tuple[int, int] | list[int] | None) -> str:
    """bf16, fp16 or fp32: what `precision` (auto, bf16, fp16, fp32) means on a device of compute
    capability `compute_capability` (major, minor), None or empty for the CPU. See AUTO_RULE."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: not one of {', '.join(PRECISIONS)}")
    if precision != "auto":
        return precision
    if not compute_capability:
        return "fp32"
    return "bf16" if compute_capability[0] >= 8 else "fp16"


def device_precision(precision: str, device) -> str:
    """`resolved_precision` on a torch device (or its name: "cpu", "cuda:1"): a CUDA device gives
    its capability, anything else none."""
    import torch

    device = torch.device(device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return resolved_precision(precision, capability)


def torch_dtype(resolved: str):
    """The torch dtype of a resolved precision name (bf16, fp16, fp32)."""
    import torch

    return getattr(torch, TORCH_NAMES[resolved])
