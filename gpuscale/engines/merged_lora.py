"""A PEFT LoRA model's weights as a plain transformers model holds them: what the generation engine decodes in
place of a LoRA model (engines/rollout.py's decoding copy: grpo-mtl's `rollout=async`; engines/placement.py's
generators, which receive only the adapters).

A weight a LoRA layer adapts is its base layer's plus the adapter's delta, computed by peft itself
(`get_delta_weight`: B @ A, its scaling, fan_in_fan_out), cast to the base weight's dtype and added as
peft's `merge` adds it, so that the merged weights are those `merge_and_unload` gives (the model a run
saves). Every other weight is the base model's, frozen: a copy follows the adapters by merging the adapted
weights alone (`trained_only`). A LoRA model merged otherwise (a variant such as DoRA, a bias in lora_B,
several active adapters, modules trained whole beside the adapters) is refused (ValueError): the copy would
decode other weights than the model's.

No torch at import.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

BASE_LAYER = ".base_layer."  # where peft moves a wrapped layer's own weights


def is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # peft not installed: no model is one
        return False
    return isinstance(model, PeftModel)


def plain_model(model):
    """The transformers model under a PEFT model (its LoRA layers inside it), else the model itself."""
    return model.get_base_model() if is_peft(model) else model


def plain_name(name: str) -> str:
    """A name of the model under a PEFT model as the plain model names it (`q_proj.base_layer.weight`:
    `q_proj.weight`)."""
    return name.replace(BASE_LAYER, ".")


def active_adapter(model) -> str:
    """The one adapter a PEFT model trains and decodes with."""
    adapters = model.active_adapters
    if len(adapters) != 1:
        raise ValueError(f"{len(adapters)} active adapters ({', '.join(adapters)}): the merged copy takes one")
    return adapters[0]


def lora_layers(model) -> dict[str, Any]:
    """A PEFT LoRA model's LoRA layers by the name of the weight each adapts in the plain model
    (`model.layers.0.self_attn.q_proj.weight`); ValueError for one a merge of base + delta would not follow."""
    from peft.tuners.lora import Embedding, Linear
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    adapter = active_adapter(model)
    layers = {}
    for name, module in plain_model(model).named_modules():
        if not isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper)):
            continue
        if type(module) not in (Linear, Embedding):  # a ParamWrapper's, a modules_to_save wrapper's weights...
            raise ValueError(f"{name}: {type(module).__name__} is not a LoRA linear or embedding layer")
        if adapter in module.lora_variant or module.lora_bias.get(adapter):  # DoRA and the others merge otherwise
            raise ValueError(f"{name}: a LoRA variant or bias, which base + delta does not merge")
        layers[f"{name}.weight"] = module
    return layers


def decoded_weights(model, trained_only: bool = False) -> Iterator[tuple[str, Any]]:
    """The weights a plain copy of `model` decodes, by the copy's names, one at a time (a merged weight is
    computed when it is reached, never all at once): a plain model's parameters, which a full fine-tune
    trains all; a PEFT LoRA model's merged weights (above), and unless `trained_only` its frozen ones."""
    if not is_peft(model):
        yield from model.named_parameters()
        return
    adapter, layers = active_adapter(model), lora_layers(model)
    for name, layer in layers.items():
        base = layer.get_base_layer().weight
        yield name, base + layer.get_delta_weight(adapter).to(base.dtype)
    if trained_only:
        return
    adapters = {id(parameter) for name, parameter in adapter_parameters(model)}
    for name, parameter in plain_model(model).named_parameters():
        if id(parameter) not in adapters and plain_name(name) not in layers:
            yield plain_name(name), parameter


def adapter_parameters(model) -> list[tuple[str, Any]]:
    """A PEFT LoRA model's adapter tensors (each LoRA layer's lora_A and lora_B, or lora_embedding_A and _B, of
    the active adapter), by their names in `model`: all that training changes in it."""
    from peft.tuners.lora import LoraLayer

    lora_layers(model)  # a model whose adapters are not all of what it trains is refused
    adapter = active_adapter(model)
    marks = tuple(f".{part}.{adapter}." for part in LoraLayer.adapter_layer_names)
    return [(name, parameter) for name, parameter in model.named_parameters()
            if any(mark in f"{name}." for mark in marks)]


def trained_parameters(model) -> list[tuple[str, Any]]:
    """What training changes in `model`, by name: a LoRA model's adapters, a full fine-tune's every parameter."""
    return adapter_parameters(model) if is_peft(model) else list(model.named_parameters())


def adapter_config(model) -> dict | None:
    """A PEFT LoRA model's adapter config as a dict (what `with_adapter` builds the same adapter from), else None."""
    return model.peft_config[active_adapter(model)].to_dict() if is_peft(model) else None


def with_adapter(model, config: dict):
    """`model` (a plain transformers model) wrapped by peft in a fresh adapter built from `adapter_config`'s dict:
    the same LoRA layers, tensor names and scaling as the model the dict was taken from."""
    from peft import get_peft_model
    from peft.config import PeftConfig

    return get_peft_model(model, PeftConfig.from_peft_type(**config))
