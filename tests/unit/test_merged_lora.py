"""A LoRA model decoded through a plain copy with its adapter merged (engines/merged_lora.py, engines/rollout.py's
decoding copy), on the embedded model with the recipe's own LoRA config and adapters whose B is not zero: the
copy's weights are peft's own merge's and its logits the LoRA model's, again once an optimizer step has changed
the adapters and the copy merged them again (the adapted weights alone); the async rollout on it at staleness 0
samples what the synchronous rollout samples from the LoRA model itself, and a real trainer's LoRA run trains
the same either way; the synchronous rollout decodes a merged copy too where memory allows; a LoRA model the
merge cannot follow is decoded as it is by the synchronous rollout, and fails the async one at once."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_off_policy import fake_trainer

from gpuscale.data.models import load_model
from gpuscale.engines import rollout as rollout_module
from gpuscale.engines.async_rollout import AsyncEngineRollout, LocalSampler
from gpuscale.engines.merged_lora import adapter_parameters, is_peft
from gpuscale.engines.off_policy import STALENESS
from gpuscale.engines.rollout import EngineRollout, copy_weights, decoding_copy
from gpuscale.recipes.grpo_mtl import Settings
from gpuscale.recipes.shared.training import lora_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IDS = torch.tensor([[1, 45, 23, 87, 5, 9, 112, 64, 3, 30]])


def lora_model(config: LoraConfig | None = None):
    """(tiny-math under LoRA of rank 4 on every linear, as grpo-mtl configures it, each lora_B drawn so that
    the adapter changes the model, its tokenizer)."""
    model, tokenizer = load_model("tiny-math")
    peft_model = get_peft_model(model, config or lora_config(Settings(lora_rank=4)))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.05 * torch.randn(parameter.shape, generator=generator))
    return peft_model, tokenizer


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def optimizer_step(peft_model) -> None:
    """One AdamW step of the adapters on a language-modelling loss (what the trainer changes)."""
    optimizer = torch.optim.AdamW([parameter for _, parameter in adapter_parameters(peft_model)], lr=1e-2)
    peft_model(input_ids=IDS, labels=IDS).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_the_merged_copy_holds_peft_s_merge_and_decodes_the_lora_model_s_logits():
    peft_model, _ = lora_model()
    copied, why = decoding_copy(peft_model, torch.float32)
    assert why == ("a torch.float32 copy of the model with its LoRA adapter merged, merged again after each "
                   "optimizer step")
    assert type(copied) is type(peft_model.get_base_model()) and not is_peft(copied)
    merged = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    assert all(torch.equal(weight, merged[name]) for name, weight in copied.state_dict().items())
    assert torch.allclose(logits(copied), logits(peft_model), atol=1e-4)
    with peft_model.disable_adapter():  # the adapter matters: a copy of the base would not pass
        assert (logits(copied) - logits(peft_model)).abs().max() > 0.1
    half, _ = decoding_copy(peft_model, torch.bfloat16)
    assert all(torch.equal(weight, merged[name].to(torch.bfloat16)) for name, weight in half.state_dict().items())


def test_after_an_optimizer_step_the_copy_merges_the_adapted_weights_again_and_only_those():
    peft_model, _ = lora_model()
    copied, _ = decoding_copy(peft_model, torch.float32)
    frozen = copied.model.norm.weight  # no LoRA layer adapts it: a refresh leaves it as it is
    with torch.no_grad():
        frozen.add_(1.0)
    optimizer_step(peft_model)
    assert (logits(copied) - logits(peft_model)).abs().max() > 0.1  # stale
    copy_weights(peft_model, copied, trained_only=True)
    assert torch.equal(frozen, peft_model.get_base_model().model.norm.weight + 1.0)
    with torch.no_grad():
        frozen.sub_(1.0)
    assert torch.allclose(logits(copied), logits(peft_model), atol=1e-4)


def test_at_staleness_0_the_async_rollout_on_the_merged_copy_samples_what_the_sync_one_does_on_the_lora_model(
        monkeypatch):
    """The synchronous rollout decodes the LoRA model as it is (no room for a copy, here by its memory share
    set to 0); the async one its merged copy, merged again after each step's optimizer step: the same
    completions, the log-probs within float noise."""
    monkeypatch.setattr(rollout_module, "MERGED_COPY_MAX_MEMORY_SHARE", 0.0)
    peft_model, tokenizer = lora_model()
    reference = copy.deepcopy(peft_model)
    prompts = [[{"role": "user", "content": "What is 7 - 4?"}]] * 3
    sync, sync_trainer = EngineRollout(tokenizer, 8, 1.0, seed=5), fake_trainer(reference)
    trainer = fake_trainer(peft_model, upcoming=prompts)
    rollout = AsyncEngineRollout(LocalSampler(EngineRollout(tokenizer, 8, 1.0, seed=5, own_weights=True)),
                                 max_staleness=0)
    for step in range(3):
        sync_trainer.state.global_step = trainer.state.global_step = step
        got, expected = rollout(prompts, trainer), sync(prompts, sync_trainer)
        assert got["completion_ids"] == expected["completion_ids"]
        assert all(torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)
                   for a, b in zip(got["logprobs"], expected["logprobs"], strict=True))
        optimizer_step(peft_model)
        optimizer_step(reference)
    assert sync.engine.model is reference and not is_peft(rollout.sampler.rollout.engine.model)
    assert trainer._metrics["train"][STALENESS] == [0.0, 0.0, 0.0]
    rollout.on_train_end(None, None, None)


def test_the_sync_rollout_decodes_a_merged_copy_where_memory_allows_and_the_lora_model_where_it_does_not(
        monkeypatch, capsys):
    """Decoded as it is, a LoRA model runs its adapters' matmuls beside every layer at every step (its cost on a
    GPU: bench/RESULTS.md, "LoRA's step"): the synchronous rollout decodes its merged copy, merged again after
    each optimizer step, and samples what the LoRA model itself samples; where the copy would take more than
    its share of the device's memory, it decodes the LoRA model as it is and the rank log says why."""
    peft_model, tokenizer = lora_model()
    prompts = [[{"role": "user", "content": "What is 7 - 4?"}]] * 3
    merged, trainer = EngineRollout(tokenizer, 8, 1.0, seed=5), fake_trainer(peft_model)
    as_is, as_is_trainer = EngineRollout(tokenizer, 8, 1.0, seed=5), fake_trainer(copy.deepcopy(peft_model))
    first = merged(prompts, trainer)  # each engine is built at its first call: the copy, room permitting
    monkeypatch.setattr(rollout_module, "MERGED_COPY_MAX_MEMORY_SHARE", 0.0)
    calls = [(first, as_is(prompts, as_is_trainer))]
    for step in (1, 2):
        optimizer_step(peft_model)
        optimizer_step(as_is_trainer.model)
        trainer.state.global_step = as_is_trainer.state.global_step = step
        calls.append((merged(prompts, trainer), as_is(prompts, as_is_trainer)))
    for got, expected in calls:
        assert got["completion_ids"] == expected["completion_ids"]
        assert all(torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)
                   for a, b in zip(got["logprobs"], expected["logprobs"], strict=True))
    assert not is_peft(merged.engine.model) and merged.masters is peft_model
    assert as_is.engine.model is as_is_trainer.model and as_is.masters is None
    log = capsys.readouterr().out
    assert "speed: the engine decodes a torch.float32 copy of the model with its LoRA adapter merged" in log
    assert "speed: the engine decodes the LoRA model as it is: a merged copy would take" in log
    assert "over 0.0% of the cpu device's" in log


def test_a_lora_model_the_merge_cannot_follow_is_decoded_as_it_is_or_fails_the_async_rollout_at_once():
    """DoRA scales the merged weight by a magnitude: base + delta would decode another model."""
    peft_model, tokenizer = lora_model(LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    copied, why = decoding_copy(peft_model, torch.bfloat16)
    assert copied is None
    assert why.startswith("the LoRA model as it is: no torch.bfloat16 copy (ValueError: ") and "variant" in why
    rollout = EngineRollout(tokenizer, 4, 1.0, own_weights=True)
    with pytest.raises(RuntimeError, match="rollout=async: the engine needs weights of its own to decode while "
                                           "the trainer steps, and decodes the LoRA model as it is"):
        rollout([[{"role": "user", "content": "What is 2 + 3?"}]], fake_trainer(peft_model))


def trained_lora_run(rollout: str, tmp_path) -> list[dict]:
    """A 1-rank MultiTaskGRPOTrainer on tiny-math with LoRA (rank 4), 2 optimizer steps: its logged steps."""
    from gpuscale.data.tasks import load_examples
    from gpuscale.engines.distributed import RankContext
    from gpuscale.engines.reporter import Reporter
    from gpuscale.recipes.grpo_mtl.data import grpo_rows
    from gpuscale.recipes.grpo_mtl.trainer import build_trainer

    torch.manual_seed(0)  # lora_A's initialisation
    model, tokenizer = load_model("tiny-math")
    rows, _ = grpo_rows(load_examples("tiny-math", "train", 16), tokenizer, 256)
    settings = Settings(num_generations=4, prompts_per_step=4, batch_size=16, max_steps=2, max_completion_length=24,
                        lora_rank=4, learning_rate=2e-3, rollout=rollout, max_staleness=0)
    ctx = RankContext(0, 0, 1, torch.device("cpu"), torch.float32, tmp_path)
    reporter = Reporter(tmp_path, 0)
    try:
        trainer, _ = build_trainer(rows, settings, ctx, reporter, model, tokenizer)
        trainer.train()
    finally:
        reporter.close()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def test_a_lora_trainer_trains_the_same_with_the_async_rollout_at_staleness_0(tmp_path):
    """TRL's own PEFT model behind the trainer, its adapters stepped by its optimizer: the async rollout decodes
    the merged copy, merged again after step 1, so that each step's sampler is the trained policy (the
    log-probs of what it sampled are the loss's own, within float noise; a copy left stale is off by nats at
    step 2) and samples what the synchronous rollout samples from the LoRA model: the same rewards, the same
    losses and gradient norms up to float noise."""
    sync = trained_lora_run("sync", tmp_path / "sync")
    asynchronous = trained_lora_run("async", tmp_path / "async")
    assert [entry["step"] for entry in sync] == [entry["step"] for entry in asynchronous] == [1, 2]
    assert all(entry["grad_norm"] > 0 for entry in sync)  # step 2 learns from what the stepped adapters sampled
    assert all(entry["sampling/sampling_logp_difference/max"] < 1e-4 for entry in asynchronous)
    assert [entry["reward"] for entry in sync] == [entry["reward"] for entry in asynchronous]
    for name in ("loss", "grad_norm"):
        assert [entry[name] for entry in asynchronous] == pytest.approx([entry[name] for entry in sync], rel=1e-4,
                                                                         abs=1e-6)
