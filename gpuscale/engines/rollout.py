"""gpuscale's generation engine as TRL's `rollout_func`: GRPOTrainer(rollout_func=EngineRollout(...)).

TRL 1.16 calls `rollout_func(prompts, trainer)` with this rank's prompts, each already repeated
num_generations times in a row (its docstring says otherwise), and wants one completion per entry:
{"prompt_ids", "completion_ids", "logprobs"} as lists per row. Each run of identical prompts is
prefilled once and sampled for all its rows (`samples_per_prompt`). The log-probs returned are those
of the distribution sampled from (temperature applied), which is what TRL's own recomputation gives
(its fused LM head divides the logits by the same temperature).

The engine is built on first use on the unwrapped model (trainer.model: the PEFT model with LoRA, the
plain model otherwise; never the DDP wrapper, whose forward would prepare a backward) and leaves the
train/eval mode as it found it. Under bf16/fp16 autocast the trainer keeps fp32 master weights, and
the engine decodes a half-precision copy of them instead (`half_precision_copy`), refreshed in place
after each optimizer step: TRL's own generation runs under the same autocast, and decoding the fp32
masters ran fp32 GEMMs without tensor cores and fp32 attention (the rollout's profile in
bench/RESULTS.md, grpo-mtl). With fp32 training the engine decodes the masters and follows their
updates by itself. A LoRA model (its base in the rank's dtype, no masters) is decoded through a plain
copy with the adapter merged (engines/merged_lora.py), of which each refresh merges the adapted weights
again: decoded as it is, every adapter's own small matmuls run beside each layer it adapts at every decode
step, and grpo-mtl's generation fell far behind the full fine-tune's (bench/RESULTS.md, "LoRA's step").
The copy holds the model's weights a second time, so the synchronous rollout makes it only where it takes
at most MERGED_COPY_MAX_MEMORY_SHARE of the device's memory, and otherwise decodes the LoRA model as it is
(the rank log says which, and why); where the engine needs weights of its own (`own_weights`) it always
makes it.
"""

from __future__ import annotations

import time
from itertools import groupby

from gpuscale.data.step_phases import WEIGHT_SYNC
from gpuscale.engines.merged_lora import is_peft
from gpuscale.engines.step_phases import phase

# The share of a device's memory a LoRA model's merged copy may take for the synchronous rollout to make it.
# LoRA is often chosen to fit a model on a card: a copy as large as the base model is made for small models
# (0.5B in bf16: 1 GB, under 1% of an H200) and left out for those that fill a card (7B in bf16 on 80 GB).
MERGED_COPY_MAX_MEMORY_SHARE = 1 / 16


class EngineRollout:
    """Callable for `GRPOTrainer(rollout_func=...)`.

    tokenizer: turns prompts (chats or text) into ids as `data.prompts.prompt_ids` does.
    max_new_tokens / temperature: the trainer's max_completion_length and temperature.
    seed: the run's seed. The sampling generator is seeded afresh at every call from (seed, rank,
        optimizer step, call within the step) (data/seeds.derived_seed): a step's completions
        do not depend on the steps before it, so a run resumed from a checkpoint samples what the
        uninterrupted run sampled.
    max_columns: KV columns to reserve once (longest prompt + budget), so the buffers never regrow.
    compile: torch.compile the engine's decode step (CUDA).
    own_weights: decode a copy of the trainer's weights (in the autocast dtype, else in theirs; a LoRA
        model's merged) even in fp32, refreshed only when `_engine_for` runs: what the async rollout needs,
        whose thread decodes while the optimizer steps the masters or the adapters.
    `seconds` adds up the time spent generating.
    """

    def __init__(self, tokenizer, max_new_tokens: int, temperature: float, seed: int = 0,
                 max_columns: int = 0, compile: bool = False, own_weights: bool = False):
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.seed = seed
        self.max_columns = max_columns
        self.compile = compile
        self.own_weights = own_weights
        self.engine = None
        self.generator = None
        self.masters = None  # the trainer's weights, when the engine decodes a copy of them
        self._copied_at_step = -1  # the optimizer step of the weights the copy holds
        self.seconds = 0.0
        self._step = -1  # the optimizer step of the last call, and the calls made in it
        self._calls_in_step = 0

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        self._engine_for(trainer)
        return self.generate(prompts, self._call_seed(trainer))

    def generate(self, prompts: list, seed: int) -> dict[str, list]:
        """TRL's rollout output for `prompts`, sampled with the generator seeded at `seed`, on the
        current CUDA stream (the async rollout's own, in its thread; engines/async_rollout.py)."""
        return self.generate_ids([self.prompt_ids(prompt) for prompt in prompts], seed)

    def generate_ids(self, ids: list[list[int]], seed: int) -> dict[str, list]:
        """`generate` for prompts already tokenized (`prompt_ids`): what a generator rank is sent
        (engines/placement.py)."""
        from gpuscale.engines.generation import Sampling

        started = time.perf_counter()
        engine = self.engine
        self.generator.manual_seed(seed)
        unique, per_prompt = repeated_runs(ids)
        if per_prompt is None:  # runs of different lengths: every row prefilled by itself
            unique, per_prompt = ids, 1
        generation = engine.generate(unique, self.max_new_tokens, Sampling(temperature=self.temperature),
                                     self.generator, samples_per_prompt=per_prompt)
        completions = generation.sequences()
        logprobs = [row[: len(tokens)] for row, tokens in zip(generation.sampled_logprobs.cpu().tolist(),
                                                              completions)]
        if engine.device.type == "cuda":
            import torch

            torch.cuda.current_stream(engine.device).synchronize()  # this stream's work, not the trainer's
        self.seconds += time.perf_counter() - started
        return {"prompt_ids": [list(row) for row in ids], "completion_ids": completions, "logprobs": logprobs}

    def _engine_for(self, trainer):
        if self.engine is None:
            self.use_model(self._model_to_decode(trainer))
        elif self.masters is not None and int(trainer.state.global_step) != self._copied_at_step:
            with phase(WEIGHT_SYNC):  # a step phase of its own (engines/step_phases.py), inside generation's
                # In place: the engine's CUDA graphs stay valid. A LoRA model's frozen weights were copied once.
                copy_weights(self.masters, self.engine.model, trained_only=True)
            self._copied_at_step = int(trainer.state.global_step)
        return self.engine

    def _model_to_decode(self, trainer):
        """The trainer's model, or a copy of it (the trainer's then kept as `masters`, to refresh it from)."""
        model = trainer.accelerator.unwrap_model(trainer.model)
        dtype = decode_dtype(model, trainer.args)
        needs_copy = dtype != next(model.parameters()).dtype or self.own_weights
        if not needs_copy and is_peft(model):  # a copy for speed alone: where memory allows
            too_large = merged_copy_too_large(model)
            needs_copy = too_large is None
            if too_large:
                print(f"speed: the engine decodes the LoRA model as it is: {too_large}", flush=True)
        if not needs_copy:
            return model
        copy, why = decoding_copy(model, dtype)
        print(f"speed: the engine decodes {why}", flush=True)
        if copy is None and self.own_weights:
            raise RuntimeError(f"rollout=async: the engine needs weights of its own to decode while the "
                               f"trainer steps, and decodes {why}")
        if copy is None:
            return model
        self.masters = model
        self._copied_at_step = int(trainer.state.global_step)
        return copy

    def use_model(self, model) -> None:
        """Decode `model` from now on: the engine built on it (a generator rank's own model, or the trainer's)."""
        import torch

        from gpuscale.data.prompts import eos_token_ids, pad_token_id
        from gpuscale.engines.generation import GenerationEngine

        eos = eos_token_ids(model, self.tokenizer)
        self.engine = GenerationEngine(model, eos, pad_token_id=pad_token_id(self.tokenizer, eos),
                                       compile=None if self.compile else False,  # None: on where it can be (CUDA)
                                       max_columns=self.max_columns)
        self.generator = torch.Generator(device=self.engine.device)

    def _call_seed(self, trainer) -> int:
        """The sampling seed of this call: (seed, rank, optimizer step, call within the step)."""
        step = int(trainer.state.global_step)
        self._calls_in_step = self._calls_in_step + 1 if step == self._step else 0
        self._step = step
        return self.step_seed(trainer, step, self._calls_in_step)

    def step_seed(self, trainer, step: int, call: int = 0) -> int:
        from gpuscale.data.seeds import derived_seed

        return derived_seed(self.seed, "rollout", trainer.accelerator.process_index, step, call)

    def prompt_ids(self, prompt) -> list[int]:
        """A prompt as data.py writes it: one user message (chat template applied with the
        generation prompt, as TRL does), or text that TRL would tokenize with the special tokens."""
        from gpuscale.data.prompts import prompt_ids

        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if len(prompt) != 1 or prompt[0]["role"] != "user":
            raise ValueError("the engine's rollout takes one-message user prompts (data.py writes them)")
        return prompt_ids(self.tokenizer, prompt[0]["content"])

def repeated_runs(rows: list[list[int]]) -> tuple[list[list[int]], int | None]:
    """(the distinct rows of each run of consecutive equal rows, the common run length), or (…, None)
    when the runs differ in length."""
    runs = [(key, sum(1 for _ in group)) for key, group in groupby(rows)]
    lengths = {length for _, length in runs}
    return [list(key) for key, _ in runs], (lengths.pop() if len(lengths) == 1 else None)


def autocast_dtype(args):
    """The half-precision dtype a TRL trainer's forward runs under (its `bf16` / `fp16` flags), or None."""
    import torch

    return torch.bfloat16 if getattr(args, "bf16", False) else torch.float16 if getattr(args, "fp16", False) else None


def decode_dtype(model, args):
    """The dtype the engine decodes a trainer's `model` in: its half-precision autocast's over fp32 master
    weights, else the weights' own."""
    import torch

    master = next(model.parameters()).dtype
    return (autocast_dtype(args) if master == torch.float32 else None) or master


def merged_copy_too_large(model) -> str | None:
    """Why a LoRA model's merged copy would take more than MERGED_COPY_MAX_MEMORY_SHARE of its device's memory
    (total: CUDA's card, else the host's), or None where it would not."""
    import psutil
    import torch

    from gpuscale.engines.merged_lora import plain_model

    device = next(model.parameters()).device
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else \
        psutil.virtual_memory().total
    copy_bytes = sum(parameter.numel() * parameter.element_size() for parameter in plain_model(model).parameters())
    if copy_bytes <= MERGED_COPY_MAX_MEMORY_SHARE * total:
        return None
    return (f"a merged copy would take {copy_bytes / 2**30:.1f} GiB, over {MERGED_COPY_MAX_MEMORY_SHARE:.1%} of the "
            f"{device.type} device's {total / 2**30:.0f} GiB (rollout.MERGED_COPY_MAX_MEMORY_SHARE)")


def decoding_copy(model, dtype):
    """(the copy to decode, or None, and what the engine decodes, for the rank log). For the synchronous rollout
    the copy is a speed-up only: a model it cannot be made of is decoded as it is, never a failed run."""
    lora = is_peft(model)
    try:
        copy = half_precision_copy(model, dtype)
    except Exception as error:  # any failure of the copy leaves the run as it was
        what = "the LoRA model as it is" if lora else "the fp32 master weights"
        return None, f"{what}: no {dtype} copy ({type(error).__name__}: {error})"
    if copy is None:
        return None, f"the model as it is: {type(model).__name__} is not a plain transformers model"
    if lora:
        return copy, f"a {dtype} copy of the model with its LoRA adapter merged, merged again after each optimizer step"
    return copy, f"a {dtype} copy of the fp32 master weights, copied after each optimizer step"


def half_precision_copy(model, dtype):
    """A plain copy of a transformers model in `dtype`, built from its config (no hooks, no patches: what
    the trainer hung on its model stays there), with the weights it decodes cast into it (a PEFT LoRA
    model's adapter merged: engines/merged_lora.py) and its buffers (rotary frequencies, in fp32) copied as
    they are; or None for a model that is neither plain transformers nor PEFT's LoRA over one, which is
    then decoded as it is."""
    import torch
    from transformers import PreTrainedModel

    from gpuscale.engines.merged_lora import plain_model, plain_name

    plain = plain_model(model)
    if not isinstance(plain, PreTrainedModel):
        return None
    with torch.device("meta"):
        half = type(plain)(plain.config)
    for parameter in half.parameters():
        parameter.data = parameter.data.to(dtype)
    half.to_empty(device=next(model.parameters()).device)
    half.tie_weights()
    half.requires_grad_(False)
    copy_weights(model, half)
    buffers = {plain_name(name): buffer for name, buffer in plain.named_buffers()}
    with torch.no_grad():
        for name, copied in half.named_buffers():
            copied.copy_(buffers[name])
    return half.train(model.training)


def copy_weights(source, target, trained_only: bool = False) -> None:
    """The weights `source` decodes (engines/merged_lora.py: a plain model's own, a LoRA model's merged) into
    `target`'s parameters of the same names, cast to their dtype, in place; `trained_only`: those training
    changes alone (a LoRA model's merged ones), the others being there already. Outside any autocast the
    trainer's call runs under: a LoRA delta is computed in its adapter's dtype."""
    import torch

    from gpuscale.engines.merged_lora import decoded_weights

    targets = dict(target.named_parameters())
    written = set()
    device = next(target.parameters()).device.type
    with torch.no_grad(), torch.autocast(device, enabled=False):
        for name, weight in decoded_weights(source, trained_only):
            targets[name].copy_(weight)
            written.add(name)
    if not trained_only and written != set(targets):
        raise ValueError(f"{len(set(targets) - written)} weights of the copy have no source, e.g. "
                         f"{min(set(targets) - written)}")
