"""Train (and evaluate) the embedded `tiny-math` model from a seed.

    python tools/train_tiny.py --out DIR --seed 0 [--device cpu|cuda] [--steps N]
    python tools/train_tiny.py --eval-only DIR

A tool of the repository, outside the package (no run uses it): run from a checkout where gpuscale is
importable (`pip install -e .`). It was `python -m gpuscale.data.train_tiny` before.

The committed model under gpuscale/data/models/tiny-math/ is what this script produced:

    python tools/train_tiny.py --out gpuscale/data/models/tiny-math --seed 0 --device cpu --steps 800

- 2026-11-26, CPU, 2 cores (AMD EPYC, shared with other jobs: load average about 3), no GPU;
  torch 2.13.0+cpu, transformers 5.24.0, tokenizers 0.23.3; one torch thread (the default).
- Training 783 s wall, 586 s CPU (800 steps of 64 problems); the whole command 13 min 49 s.
- Llama, 4 layers, hidden 128, 4 heads, vocab 512: 0.92M parameters, 3.7 MB of fp32 safetensors.
- 500 held-out tiny-math test problems (test-v1, the test split until 2026-11-29), greedy / temperature-1 sampled
  (4 samples per problem, no top-k or top-p): overall 56.8% / 37.0%; arithmetic 44.8% / 24.8%;
  comparison 69.1% / 47.3%; counting 66.1% / 49.3%.
- Two runs of this training (one with one thread, one with two) gave the same weights bit for bit.

What it builds: a byte-level BPE tokenizer trained on tiny-math text (digits always split one per
token, so numbers are spelled out for the model), wrapped as a `PreTrainedTokenizerFast` with the
model's chat template; a small Llama trained on the answers only (the prompt tokens carry no loss),
with label smoothing 0.02 (see `answer_loss`), AdamW with warm-up and cosine decay. It is deliberately
a short training: the recipes need a model that is right often but not always, and whose
temperature-1 samples are clearly worse than its greedy answers (room for power sampling, RFT and
GRPO to improve on it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections import defaultdict
from pathlib import Path

import torch

from gpuscale.data.answers import is_correct
from gpuscale.data.prompts import prompt_ids
from gpuscale.data.tasks import gold_answer, load_examples
from gpuscale.data.tiny_math import pretraining_examples

PAD, END, USER, ASSISTANT = "<|pad|>", "<|end|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = [PAD, END, USER, ASSISTANT]
# A user turn, then the assistant's answer closed by <|end|>. System messages are not rendered: the
# model never saw one in training.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}" + USER + "{{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}" + ASSISTANT + "{{ message['content'] }}" + END + "\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)

VOCAB_SIZE = 512  # the task text has about 520 distinct BPE pieces; 256 of them are the bytes
TOKENIZER_TRAINING_EXAMPLES = 20_000
MAX_NEW_TOKENS = 48  # the longest tiny-math answer is about 36 tokens
MODEL_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4)


# ---------------------------------------------------------------------------------------------------
# Tokenizer and model


def build_tokenizer(texts):
    """A byte-level BPE over the task text, as a transformers fast tokenizer with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    # Byte level: any text encodes (GSM8K questions too). Digits split one per token: arithmetic is
    # learnable when "37" is always "3", "7" rather than whatever merge BPE happened to make.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        pre_tokenizers.Digits(individual_digits=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=END, pad_token=PAD,
        padding_side="left",  # prompts are batched for generation, so pad on the left
        model_max_length=512,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_model(tokenizer, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), max_position_embeddings=256, tie_word_embeddings=True,
        num_key_value_heads=MODEL_SHAPE["num_attention_heads"], **MODEL_SHAPE,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def generation_config_for(tokenizer):
    from transformers import GenerationConfig

    return GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None, max_new_tokens=MAX_NEW_TOKENS,
    )


# ---------------------------------------------------------------------------------------------------
# Training


def encode_for_training(tokenizer, examples) -> list[tuple[list[int], int]]:
    """Each example as (token ids of prompt + answer + <|end|>, number of prompt tokens)."""
    answers = tokenizer([e["answer"] for e in examples], add_special_tokens=False)["input_ids"]
    encoded = []
    for example, answer in zip(examples, answers):
        prompt = prompt_ids(tokenizer, example["question"])
        encoded.append((prompt + answer + [tokenizer.eos_token_id], len(prompt)))
    return encoded


def collate(batch, pad_id: int):
    """Right-padded input ids, attention mask, and labels that score only the answer tokens."""
    # Lengths rounded up to a multiple of 8: a handful of shapes instead of one per batch, so the CPU
    # kernels set up for a shape are reused. Right padding never changes the loss (causal attention).
    length = -(-max(len(ids) for ids, _ in batch) // 8) * 8
    input_ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), length), -100, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), length), dtype=torch.long)
    for row, (ids, prompt_length) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        labels[row, prompt_length : len(ids)] = torch.tensor(ids[prompt_length:])
    return input_ids, attention_mask, labels


def answer_loss(model, input_ids, attention_mask, labels, label_smoothing: float):
    """Next-token cross-entropy on the answer tokens.

    Label smoothing keeps a little probability on every token, like the long tail of a real LLM: the
    greedy answer stays right while temperature-1 samples now and then wander off. That gap is what
    power sampling (sharpening p to p^alpha) and RFT/GRPO (training on the model's own right answers)
    are there to close.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    targets = labels[:, 1:]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
        ignore_index=-100, label_smoothing=label_smoothing,
    )


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(args) -> tuple:
    torch.manual_seed(args.seed)
    # The pretraining problems (data/tiny_math.py's `pretraining_examples`: with the defaults, the
    # embedded model's, which the validation split leaves out).
    examples = pretraining_examples(args.steps * args.batch_size, args.seed)
    tokenizer = build_tokenizer(
        text for e in examples[:TOKENIZER_TRAINING_EXAMPLES] for text in (e["question"], e["answer"])
    )
    model = build_model(tokenizer, args.seed).to(args.device)
    encoded = encode_for_training(tokenizer, examples)
    order = torch.randperm(len(encoded), generator=torch.Generator().manual_seed(args.seed)).tolist()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"{parameters / 1e6:.2f}M parameters, {len(encoded)} training examples, {args.steps} steps", flush=True)
    model.train()
    started, cpu_started = time.perf_counter(), time.process_time()
    for step in range(args.steps):
        # Cycles over the data when steps * batch_size exceeds the train split.
        indices = [order[(step * args.batch_size + i) % len(order)] for i in range(args.batch_size)]
        batch = collate([encoded[i] for i in indices], tokenizer.pad_token_id)
        input_ids, attention_mask, labels = (t.to(args.device) for t in batch)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, warmup=max(1, args.steps // 20))
        loss = answer_loss(model, input_ids, attention_mask, labels, args.label_smoothing)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            elapsed = time.perf_counter() - started
            print(f"step {step:5d}  loss {loss.item():.4f}  {elapsed:6.1f}s", flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            print_progress_accuracy(model, tokenizer, args)
            model.train()
    return model, tokenizer, time.perf_counter() - started, time.process_time() - cpu_started


def print_progress_accuracy(model, tokenizer, args, problems: int = 200) -> None:
    """Greedy accuracy on a few held-out problems, to watch training (not the reported figure)."""
    examples = load_examples("tiny-math", "test", max_examples=problems, seed=args.eval_seed)
    model.eval()
    completions = generate_answers(model, tokenizer, [e["question"] for e in examples], sample=False)
    right = sum(is_correct(c, gold_answer(e)) for c, e in zip(completions, examples))
    print(f"  greedy accuracy on {problems} test problems: {right / problems:.1%}", flush=True)


def save(model, tokenizer, out: Path) -> None:
    model.generation_config = generation_config_for(tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


# ---------------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def generate_answers(model, tokenizer, questions, sample: bool, batch_size: int = 256) -> list[str]:
    """One completion per question: greedy, or a plain temperature-1 sample (no top-k, no top-p)."""
    completions = []
    for start in range(0, len(questions), batch_size):
        prompts = [prompt_ids(tokenizer, q) for q in questions[start : start + batch_size]]
        batch = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt").to(model.device)
        sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
        output = model.generate(**batch, max_new_tokens=MAX_NEW_TOKENS, **sampling)
        completions += tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return completions


def evaluate(model, tokenizer, examples, samples_per_question: int, seed: int) -> dict:
    """Greedy accuracy and temperature-1 sampled accuracy, overall and per domain."""
    model.eval()
    questions = [e["question"] for e in examples]
    golds = [gold_answer(e) for e in examples]
    domains = [e.get("domain", "all") for e in examples]
    greedy = generate_answers(model, tokenizer, questions, sample=False)
    torch.manual_seed(seed)
    sampled = [generate_answers(model, tokenizer, questions, sample=True) for _ in range(samples_per_question)]
    scores = defaultdict(lambda: {"n": 0, "greedy": 0.0, "sampled": 0.0})
    for index, (gold, domain) in enumerate(zip(golds, domains)):
        greedy_right = float(is_correct(greedy[index], gold))
        sampled_right = sum(is_correct(run[index], gold) for run in sampled) / samples_per_question
        for key in ("overall", domain):
            scores[key]["n"] += 1
            scores[key]["greedy"] += greedy_right
            scores[key]["sampled"] += sampled_right
    return {key: {"n": s["n"], "greedy": s["greedy"] / s["n"], "sampled": s["sampled"] / s["n"]}
            for key, s in sorted(scores.items())}


def print_scores(scores: dict) -> None:
    print(f"{'domain':<12} {'n':>5} {'greedy':>8} {'sampled':>8}")
    for key, s in scores.items():
        print(f"{key:<12} {s['n']:>5} {s['greedy']:>8.1%} {s['sampled']:>8.1%}")


def run_evaluation(model_dir: Path, args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).to(args.device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples = load_examples("tiny-math", "test", max_examples=args.eval_examples, seed=args.eval_seed)
    started = time.perf_counter()
    scores = evaluate(model, tokenizer, examples, args.samples, args.seed)
    print_scores(scores)
    print(f"evaluation took {time.perf_counter() - started:.1f}s "
          f"({len(examples)} test problems, greedy + {args.samples} samples each)")
    return scores


# ---------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="directory to save the trained model and tokenizer in")
    parser.add_argument("--eval-only", type=Path, metavar="DIR", help="evaluate a saved model, train nothing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    # One CPU thread by default: the result is then the same on every run, and on a shared 2-core
    # machine two threads spin-wait for each other whenever a neighbour runs (measured under load:
    # 1.0 s per step with one thread, 1-7 s with two).
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for torch")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--label-smoothing", type=float, default=0.02)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=0, help="steps between progress evaluations")
    parser.add_argument("--eval-examples", type=int, default=500, help="held-out tiny-math test problems")
    parser.add_argument("--eval-seed", type=int, default=0,
                        help="kept for old command lines: tiny-math's test problems are the same for every seed")
    parser.add_argument("--samples", type=int, default=4, help="temperature-1 samples per test problem")
    args = parser.parse_args(argv)
    if (args.out is None) == (args.eval_only is None):
        parser.error("give exactly one of --out DIR (train) or --eval-only DIR")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the network
    torch.set_num_threads(args.threads)
    if args.eval_only is not None:
        run_evaluation(args.eval_only, args)
        return
    model, tokenizer, seconds, cpu_seconds = train(args)
    save(model, tokenizer, args.out)
    # CPU seconds too: on a shared machine the wall time says as much about the neighbours.
    print(f"trained in {seconds:.0f}s wall, {cpu_seconds:.0f}s CPU; saved to {args.out}", flush=True)
    scores = run_evaluation(args.out, args)
    info = {"seed": args.seed, "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
            "label_smoothing": args.label_smoothing, "device": args.device,
            "train_seconds": round(seconds, 1), "train_cpu_seconds": round(cpu_seconds, 1), "eval": scores}
    (args.out / "training.json").write_text(json.dumps(info, indent=2) + "\n")


if __name__ == "__main__":
    main()
