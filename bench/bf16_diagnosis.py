"""Where grpo-mtl's weights turn non-finite under bf16 autocast on CUDA (and not on CPU).

Two probes, both on the embedded tiny model:

1. `--probe attention`: TRL's training batch shape (left-padded prompts, right-padded completions)
   through the model's forward and backward under bf16 autocast over fp32 weights, with each
   attention path (sdpa with every CUDA backend it may pick, sdpa with one backend at a time, eager),
   over many random shapes; counts the batches whose hidden states or gradients hold a NaN/Inf, and
   where the NaN sits (padded query positions or real ones).
2. `--probe training`: the grpo-mtl recipe's own trainer at its defaults, in this process, with a
   watch that stops at the first non-finite gradient or weight and names the step and the tensor;
   `--variant` picks the attention path or the optimizer to compare.

Usage: python bench/bf16_diagnosis.py --probe attention
       python bench/bf16_diagnosis.py --probe training --variant sdpa --steps 200
"""

from __future__ import annotations

import argparse
import contextlib
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, also when loaded by path
from record import one_card, write_result  # noqa: E402


def attention_contexts():
    """(name, context manager factory, attn_implementation) for each attention path to try."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    paths = [("sdpa-default", contextlib.nullcontext, "sdpa")]
    for backend in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "FLASH_ATTENTION", "MATH"):
        if hasattr(SDPBackend, backend):
            paths.append((f"sdpa-{backend.lower()}", lambda b=backend: sdpa_kernel(getattr(SDPBackend, b)), "sdpa"))
    paths.append(("eager", contextlib.nullcontext, "eager"))
    return paths


def trl_like_batch(rng: random.Random, device, vocab: int, rows: int):
    """Left-padded prompts of 20-90 tokens and right-padded completions of 1-200 tokens."""
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(20, 90))] for _ in range(rows)]
    completions = [[rng.randrange(2, vocab) for _ in range(rng.randint(1, 200))] for _ in range(rows)]
    p_len, c_len = max(map(len, prompts)), max(map(len, completions))
    ids = torch.zeros(rows, p_len + c_len, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (p, c) in enumerate(zip(prompts, completions)):
        ids[row, p_len - len(p): p_len] = torch.tensor(p)
        mask[row, p_len - len(p): p_len] = 1
        ids[row, p_len: p_len + len(c)] = torch.tensor(c)
        mask[row, p_len: p_len + len(c)] = 1
    return ids.to(device), mask.to(device), p_len


def probe_attention(args) -> dict:
    from gpuscale.data.models import load_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = {}
    for name, context, implementation in attention_contexts():
        model, _ = load_model("tiny-math", dtype=torch.float32, device=device)
        model.set_attn_implementation(implementation)
        model.train()
        rng = random.Random(0)
        counts = {"batches": 0, "errors": 0, "nan_hidden_padded": 0, "nan_hidden_real": 0, "nan_grad": 0,
                  "first_error": None}
        for _ in range(args.batches):
            ids, mask, p_len = trl_like_batch(rng, device, model.config.vocab_size, args.rows)
            model.zero_grad(set_to_none=True)
            try:
                with context(), torch.autocast(device.type, dtype=torch.bfloat16):
                    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
                    logps = torch.log_softmax(out.logits[:, p_len - 1:-1].float(), -1)
                    chosen = logps.gather(-1, ids[:, p_len:, None]).squeeze(-1)
                    loss = -(chosen * mask[:, p_len:]).sum() / mask[:, p_len:].sum()
                loss.backward()
            except RuntimeError as error:
                counts["errors"] += 1
                counts["first_error"] = counts["first_error"] or str(error).splitlines()[0][:200]
                continue
            counts["batches"] += 1
            bad = ~torch.isfinite(out.hidden_states[-1]).all(-1)
            counts["nan_hidden_padded"] += int((bad & (mask == 0)).any())
            counts["nan_hidden_real"] += int((bad & (mask == 1)).any())
            counts["nan_grad"] += int(any(p.grad is not None and not torch.isfinite(p.grad).all()
                                          for p in model.parameters()))
        results[name] = counts
        print(name, counts, flush=True)
    return {"probe": "attention", "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "results": results}


class NonFiniteWatch:
    """A TrainerCallback that records the first non-finite gradient (before the optimizer step) and
    the first non-finite weight (after it), and stops training there."""

    def __init__(self, model):
        self.model = model
        self.found: dict = {}
        self.grad_norms: list[float] = []

    def as_callback(self):
        from transformers import TrainerCallback

        watch = self

        class Callback(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                bad = [n for n, p in watch.model.named_parameters() if p.grad is not None
                       and not torch.isfinite(p.grad).all()]
                if bad and "grad" not in watch.found:
                    watch.found["grad"] = {"step": state.global_step + 1, "tensors": bad[:8], "count": len(bad)}

            def on_step_end(self, args, state, control, **kwargs):
                bad = [n for n, p in watch.model.named_parameters() if not torch.isfinite(p).all()]
                if bad:
                    watch.found["weight"] = {"step": state.global_step, "tensors": bad[:8], "count": len(bad)}
                    control.should_training_stop = True

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "grad_norm" in logs:
                    watch.grad_norms.append(float(logs["grad_norm"]))

        return Callback()


def forward_watch(model, found: dict):
    """Forward hooks on every decoder layer and the head: the first training forward whose output
    holds a non-finite value, with where it sits (padded positions or real ones)."""
    state = {"mask": None, "calls": 0}

    def remember_mask(module, args, kwargs):
        state["mask"] = kwargs.get("attention_mask")
        state["calls"] += 1

    def check(name):
        def hook(module, args, output):
            if "forward" in found or not torch.is_grad_enabled():
                return
            tensor = output[0] if isinstance(output, tuple) else getattr(output, "logits", output)
            if not isinstance(tensor, torch.Tensor) or torch.isfinite(tensor).all():
                return
            bad = ~torch.isfinite(tensor)
            while bad.dim() > 2:
                bad = bad.any(-1)
            mask = state["mask"]
            where = {}
            if mask is not None and mask.dim() == 2 and mask.shape == bad.shape:
                where = {"padded": int((bad & (mask == 0)).sum()), "real": int((bad & (mask == 1)).sum())}
            found["forward"] = {"forward_call": state["calls"], "module": name, **where,
                                "shape": list(tensor.shape)}
        return hook

    model.register_forward_pre_hook(remember_mask, with_kwargs=True)
    for name, module in model.named_modules():
        if name.endswith(("self_attn", "mlp")) or name.count(".") == 2 and ".layers." in name or name == "lm_head":
            module.register_forward_hook(check(name))


def watch_before_clipping(trainer, found: dict) -> None:
    """The first step whose gradients hold a non-finite value before clipping (clipping by a
    non-finite norm spreads one bad value over every gradient): which tensors, how many values."""
    clip = trainer.accelerator.clip_grad_norm_

    def checked_clip(parameters, *args, **kwargs):
        parameters = list(parameters)
        bad = {name: int((~torch.isfinite(p.grad)).sum()) for name, p in trainer.model.named_parameters()
               if p.grad is not None and not torch.isfinite(p.grad).all()}
        if bad and "grad_before_clipping" not in found:
            found["grad_before_clipping"] = {"step": trainer.state.global_step + 1, "tensors": bad}
        return clip(parameters, *args, **kwargs)

    trainer.accelerator.clip_grad_norm_ = checked_clip


def capture_first_bad_micro_batch(trainer, found: dict) -> None:
    """After each micro-batch's backward, check the gradients; at the first that holds a non-finite
    value, keep that micro-batch's inputs and replay its loss and backward under each attention path
    and with the head in fp32 (`found["replay"]`), then stop training."""
    step = trainer.training_step

    def checked_step(model, inputs, *args, **kwargs):
        loss = step(model, inputs, *args, **kwargs)
        if "replay" in found or all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters()):
            return loss
        prepared = trainer._buffered_inputs[(trainer._step - 1) % trainer.args.steps_per_generation]
        found["replay"] = replay(trainer, model, prepared)
        trainer.control.should_training_stop = True
        return loss

    trainer.training_step = checked_step


def replay(trainer, model, inputs: dict) -> dict:
    """The micro-batch's loss and backward again from the same weights, once per variant: are the
    gradients finite, and in which layers' attention did a non-finite gradient first appear."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from trl.trainer.utils import add_fused_lm_head

    prompt_mask, completion_mask = inputs["prompt_mask"], inputs["completion_mask"]
    shape = {"rows": int(prompt_mask.shape[0]), "prompt_columns": int(prompt_mask.shape[1]),
             "completion_columns": int(completion_mask.shape[1]), "scored_tokens": int(completion_mask.sum()),
             "rows_left_padded": int((prompt_mask[:, 0] == 0).sum())}
    variants = {"as-trained": contextlib.nullcontext}
    for backend in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH"):
        variants[backend.lower()] = lambda b=backend: sdpa_kernel(getattr(SDPBackend, b))
    outcome = {"batch": shape}
    for name, context in [*variants.items(), ("eager", contextlib.nullcontext), ("fp32-head", contextlib.nullcontext)]:
        if name == "eager":
            model.set_attn_implementation("eager")
        if name == "fp32-head":
            model.set_attn_implementation("sdpa")
            add_fused_lm_head(model, temperature=trainer.temperature, cast_lm_head_to_fp32=True,
                              outputs=("log_probs", "entropy"))
        outcome[name] = replay_once(trainer, model, inputs, context)
    return outcome


def replay_once(trainer, model, inputs, context) -> dict:
    layers = {}

    def record(index):
        def hook(module, grad_input, grad_output):
            out_ok = all(g is None or torch.isfinite(g).all() for g in grad_output)
            in_ok = all(g is None or torch.isfinite(g).all() for g in grad_input)
            layers[index] = {"grad_output_finite": bool(out_ok), "grad_input_finite": bool(in_ok)}
        return hook

    handles = [layer.self_attn.register_full_backward_hook(record(i))
               for i, layer in enumerate(model.model.layers)]
    saved = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    try:
        with context(), trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(model, inputs)
        loss.backward()
        bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
        return {"loss": float(loss), "nonfinite_grads": bad, "attention": layers}
    except RuntimeError as error:
        return {"error": str(error).splitlines()[0][:200]}
    finally:
        for handle in handles:
            handle.remove()
        for p, g in zip(model.parameters(), saved):
            p.grad = g


def probe_training(args) -> dict:
    from gpuscale.engines.distributed import RankContext
    from gpuscale.engines.reporter import Reporter
    from gpuscale.recipes.grpo_mtl import Settings
    from gpuscale.recipes.grpo_mtl.data import grpo_rows, training_and_eval_examples
    from gpuscale.recipes.grpo_mtl.trainer import build_trainer
    from gpuscale.recipes.shared.models import load_generation_model

    if args.variant == "no-cudnn":
        torch.backends.cuda.enable_cudnn_sdp(False)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run_dir = Path(tempfile.mkdtemp(prefix="bf16-"))
    settings = Settings(max_steps=args.steps, seed=args.seed, eval_examples=0)
    ctx = RankContext(0, 0, 1, device, torch.bfloat16, run_dir)
    train, _ = training_and_eval_examples(settings)
    loaded = load_generation_model(settings.model, ctx)
    model = loaded.model.float()
    if args.variant == "eager":
        model.set_attn_implementation("eager")
    rows, _ = grpo_rows(train, loaded.tokenizer, settings.max_prompt_length)
    overrides = {"optim": "adamw_torch"} if args.variant == "unfused-adamw" else {}
    trainer, _ = build_trainer(rows, settings, ctx, Reporter(run_dir, 0), model, loaded.tokenizer)
    for key, value in overrides.items():
        setattr(trainer.args, key, value)
    watch = NonFiniteWatch(trainer.model)
    trainer.add_callback(watch.as_callback())
    forward_watch(trainer.model, watch.found)
    watch_before_clipping(trainer, watch.found)
    if args.replay:
        capture_first_bad_micro_batch(trainer, watch.found)
    started = time.perf_counter()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `timeout` ends it: keep what was found
    with contextlib.suppress(KeyboardInterrupt):
        trainer.train()
    history = [e for e in trainer.state.log_history if "reward" in e]
    return {"probe": "training", "variant": args.variant, "seed": args.seed, "steps": trainer.state.global_step,
            "seconds": time.perf_counter() - started, "optim": str(trainer.args.optim),
            "attn": trainer.model.config._attn_implementation, "found": watch.found,
            "grad_norm_max": max(watch.grad_norms, default=None),
            "reward": [round(e["reward"], 3) for e in history],
            "mean_length": [round(e.get("completions/mean_length", 0), 1) for e in history]}


def probe_head(args) -> dict:
    """TRL's fused LM head (chunked log-probs without logits, Triton on CUDA) under bf16 autocast over
    fp32 weights, against log_softmax in fp32, for many counts of scored tokens; and the fp32-output
    bf16 GEMM it accumulates its gradients with, against the same product in fp32."""
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE
    from trl.trainer.utils import _ChunkedLogProbFunction as Chunked

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator(device=device).manual_seed(0)
    weight = (torch.randn(512, 128, device=device, generator=generator) * 0.05).requires_grad_()
    counts = list(range(1, 65)) + random.Random(0).sample(range(65, 4000), args.batches)
    bad = {"head_nonfinite": [], "head_error": [], "addmm_nonfinite": [], "addmm_error": []}
    for n in counts:
        hidden = torch.randn(n, 128, device=device, generator=generator, requires_grad=True)
        targets = torch.randint(0, 512, (n,), device=device, generator=generator)
        upstream = torch.randn(n, device=device, generator=generator)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logps, *_ = Chunked.apply(hidden, weight, None, targets, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0,
                                      ("log_probs", "entropy"))
        grad_h, grad_w = torch.autograd.grad((logps * upstream).sum(), (hidden, weight))
        reference = torch.log_softmax(hidden @ weight.t(), -1).gather(-1, targets[:, None]).squeeze(-1)
        ref_h, ref_w = torch.autograd.grad((reference * upstream).sum(), (hidden, weight))
        if not all(torch.isfinite(t).all() for t in (logps, grad_h, grad_w)):
            bad["head_nonfinite"].append(n)
        elif (grad_w - ref_w).abs().max() > 0.05 * ref_w.abs().max() + 1e-3:
            bad["head_error"].append([n, float((grad_w - ref_w).abs().max()), float(ref_w.abs().max())])
        a = torch.randn(512, n, device=device, generator=generator).to(torch.bfloat16)
        b = torch.randn(n, 128, device=device, generator=generator).to(torch.bfloat16)
        acc = torch.zeros(512, 128, device=device)
        if device.type == "cuda":
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        else:
            acc.addmm_(a.float(), b.float())
        expected = a.float() @ b.float()
        if not torch.isfinite(acc).all():
            bad["addmm_nonfinite"].append(n)
        elif (acc - expected).abs().max() > 1e-2 * expected.abs().max() + 1e-3:
            bad["addmm_error"].append([n, float((acc - expected).abs().max())])
    result = {"probe": "head", "counts_tried": len(counts), **bad}
    print(result, flush=True)
    return result


BASELINE = """No baseline: a diagnosis. It compares gpuscale's own attention paths and optimizers with one another
(--variant), not gpuscale with other code."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probe", choices=("attention", "training", "head"), required=True)
    parser.add_argument("--variant", default="sdpa", choices=("sdpa", "eager", "no-cudnn", "unfused-adamw"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replay", action="store_true", help="training: replay the first micro-batch whose "
                        "gradients turn non-finite under each attention path and with the head in fp32")
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--out", default=None, help="default: "
                        "bench/results/grpo_mtl/bf16-<probe>-<variant>-<date>-<card>.json")
    args = parser.parse_args()
    result = {"attention": probe_attention, "training": probe_training, "head": probe_head}[args.probe](args)
    name = f"bf16-{args.probe}" + (f"-{args.variant}-seed{args.seed}" if args.probe == "training" else "")
    write_result("grpo_mtl", name, vars(args), result, out=args.out,
                 card=one_card(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else "cpu")


if __name__ == "__main__":
    main()
