"""Placement's pieces in-process (engines/placement.py, grpo-mtl's generation_gpus): the refusals before launch,
the ranks that share a step's work, the training world a training rank is told, and a generator on a thread
of its own over a real TCPStore and gloo group, serving a trainer's async rollout: it samples what the
trainer's own engine would sample from the weights the trainer sent, and those weights are the trainer's."""

from __future__ import annotations

import copy
import os
import threading
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from gpuscale.data.models import load_model
from gpuscale.engines.async_rollout import AsyncEngineRollout
from gpuscale.engines.distributed import WORLD_VARIABLES, training_world
from gpuscale.engines.off_policy import STALENESS
from gpuscale.engines.placement import Link, RemoteSampler, generators_released, serve, weights_digest
from gpuscale.engines.rollout import EngineRollout
from gpuscale.recipes.grpo_mtl import GrpoMtl, Settings
from gpuscale.recipes.shared.rank_batches import run_ranks
from gpuscale.runs.settings import SettingsError

PLACED = {"rollout": "async", "generation_gpus": 1, "gpus": 2, "max_examples": 32, "prompts_per_step": 16}


@pytest.mark.parametrize(("update", "line"), [
    ({"generation_gpus": 2}, "generation_gpus: 2: the run has 2 CPU ranks (gpus=2) and at least one must train; "
                             "give more gpus or fewer generation_gpus"),
    ({"rollout": "sync"}, "generation_gpus: 1: needs rollout=async: with rollout=sync each training rank generates "
                          "its own step's completions"),
    ({"generator": "transformers"}, "generation_gpus: 1: needs generator=engine, not transformers: the generating "
                                    "devices decode with gpuscale's engine"),
    ({"nnodes": 2, "rdzv_endpoint": "node1:29500"}, "generation_gpus: 1: on one node only for now (nnodes=2)"),
    ({"gpus": 3, "generation_gpus": 2}, "generation_gpus: 2: more than the 1 training rank(s) left: each training "
                                        "rank's prompts go to one generator, and 1 would idle"),
])
def test_placement_is_refused_before_launch_where_it_cannot_run(update, line):
    with pytest.raises(SettingsError) as refused:
        GrpoMtl().check(Settings(**{**PLACED, **update}))
    assert str(refused.value) == line


def test_the_generators_take_no_share_of_a_step():
    """3 CPU ranks, 1 generating: the step's 16 prompts split over the 2 that train (over 3 they would not)."""
    settings = Settings(**{**PLACED, "gpus": 3})
    assert run_ranks(settings) == 2 and run_ranks(settings.model_copy(update={"generation_gpus": 0})) == 3
    GrpoMtl().check(settings)
    fitted, moved = GrpoMtl().fit_to_ranks(settings)
    assert fitted.prompts_per_step == 16 and not moved


@pytest.mark.parametrize(("rank", "side", "world", "expected", "gpus_seen"), [
    (0, 1, 3, {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, "4,6,7"),
    # One training rank: a one-rank run's environment, and its GPU alone (else Trainer's nn.DataParallel).
    (0, 1, 2, {}, "4"),
    (2, 1, 3, {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3"}, "4,6,7"),  # a generator
    (1, 1, 2, {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, "4,6,7"),  # a generator
    (1, 0, 2, {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, "4,6,7"),  # no side ranks
])
def test_a_training_rank_is_told_the_training_world_before_anything_reads_it(monkeypatch, rank, side, world,
                                                                               expected, gpus_seen):
    for name, value in {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")
    assert training_world(side) == world - side
    assert {name: os.environ[name] for name in WORLD_VARIABLES if name in os.environ} == expected
    assert os.environ["CUDA_VISIBLE_DEVICES"] == gpus_seen


# ---- a generator on a thread, a trainer's async rollout on another ---------------------------------


def fake_trainer(model, rank: int = 0):
    """What the async rollout and the remote sampler read of a GRPOTrainer."""
    return SimpleNamespace(model=model, state=SimpleNamespace(global_step=0, max_steps=10),
                           args=SimpleNamespace(bf16=False, fp16=False), _metrics={"train": defaultdict(list)},
                           accelerator=SimpleNamespace(unwrap_model=lambda m: m, process_index=rank),
                           upcoming_prompts=lambda: None)


def chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


@pytest.fixture
def launcher_store(monkeypatch):
    """A TCPStore standing in for the one torchrun's agent hosts, where MASTER_ADDR:MASTER_PORT say."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    return store


SAMPLING = {"max_new_tokens": 8, "temperature": 1.0, "seed": 3}
FIRST, SECOND = [chat("What is 2 + 3?")] * 2, [chat("How many letters are in 'apple'?")] * 2


def cpu_link(rank: int) -> Link:
    """Rank `rank`'s link in a run of one training rank and one generator."""
    return Link(SimpleNamespace(rank=rank, world_size=1, side_ranks=1, device=torch.device("cpu")))


def serving(rollout: EngineRollout, model, beats: list, served: list) -> threading.Thread:
    """The generator (rank 1) serving on a thread of its own, started: each job's beat into `beats`, the jobs it
    served into `served` at its end (a daemon: a failed assertion leaves it waiting for a job)."""
    thread = threading.Thread(target=lambda: served.append(serve(
        cpu_link(1), rollout, model, SimpleNamespace(beat=lambda *args: beats.append(args)))), daemon=True)
    thread.start()
    return thread


def sync_samples(model, tokenizer) -> list[dict]:
    """What the trainer's own engine samples at steps 0 and 1 (FIRST, then SECOND) from `model`'s weights now."""
    reference, sync = fake_trainer(copy.deepcopy(model)), EngineRollout(tokenizer, **SAMPLING)
    expected = [sync(FIRST, reference)]
    reference.state.global_step = 1
    return [*expected, sync(SECOND, reference)]


def placed_rollout(tokenizer) -> AsyncEngineRollout:
    """Training rank 0's async rollout on the generator."""
    return AsyncEngineRollout(RemoteSampler(EngineRollout(tokenizer, **SAMPLING), cpu_link(0)), max_staleness=1)


def second_step(rollout: AsyncEngineRollout, trainer, expected: list[dict]) -> None:
    """Optimizer step 1's call (FIRST's prompts next): it hands what the trainer's engine samples from the weights
    of step 0."""
    trainer.state.global_step = 1
    trainer.upcoming_prompts = lambda: FIRST
    got = rollout(SECOND, trainer)
    assert got["completion_ids"] == expected[1]["completion_ids"]
    assert all(torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
               for a, b in zip(got["logprobs"], expected[1]["logprobs"], strict=True))


def test_a_generator_samples_what_the_trainer_would_from_the_weights_the_trainer_sent(launcher_store):
    model, tokenizer = load_model("tiny-math")
    # The generator starts from other weights than the trainer's: only what the trainer sends makes them equal.
    generator_model = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in generator_model.parameters():
            parameter.add_(0.1)
    beats, served = [], []
    generator = serving(EngineRollout(tokenizer, **SAMPLING), generator_model, beats, served)
    expected = sync_samples(model, tokenizer)

    trainer, rollout = fake_trainer(model), placed_rollout(tokenizer)
    trainer.upcoming_prompts = lambda: SECOND
    assert rollout(FIRST, trainer)["completion_ids"] == expected[0]["completion_ids"]
    assert weights_digest(generator_model.named_parameters()) == weights_digest(model.named_parameters())
    with torch.no_grad():  # the optimizer's step, while step 1's completions are generated from step 0's weights
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    second_step(rollout, trainer, expected)
    assert trainer._metrics["train"][STALENESS] == [0.0, 1.0] and rollout.prefetched == 1
    assert (rollout.ahead.step, rollout.ahead.weights_step) == (2, 1)
    rollout.on_train_end(None, None, None)  # the job ahead taken, and the end sent
    generator.join(timeout=30)
    assert served == [3] and [step for _, step in beats] == [0, 1, 2]
    # Step 2's job was sampled from the stepped weights, which the generator holds exactly.
    assert weights_digest(generator_model.named_parameters()) == weights_digest(model.named_parameters())


def test_a_generator_ends_when_the_trainers_work_does_even_before_any_job(launcher_store):
    """Training rank 0's work ended (here by an error; a preemption while loading would do the same) before it
    asked for anything: the generator, waiting for its first job, ends too instead of waiting for ever."""
    cpu = torch.device("cpu")
    with pytest.raises(RuntimeError, match="the trainer's error"), \
            generators_released(SimpleNamespace(rank=0, world_size=1, side_ranks=1, device=cpu)):
        raise RuntimeError("the trainer's error")
    assert serve(Link(SimpleNamespace(rank=1, world_size=1, side_ranks=1, device=cpu)), None, None, None) == 0


def test_with_lora_only_the_adapters_travel_and_the_generator_decodes_the_trainer_s_merged_weights(launcher_store):
    """A LoRA trainer (the recipe's LoRA config, lora_B drawn so that the adapter matters): the manifest names the
    adapter tensors alone, lora_A and lora_B of every adapted module, and the buffer holds their bytes, a sliver
    of the model's; the generator, on the base model it loaded itself, samples what the trainer's own engine
    samples from the LoRA model, and decodes the weights peft's merge of the trainer's adapter gives."""
    from peft import get_peft_model

    from gpuscale.recipes.shared.training import lora_config

    GrpoMtl().check(Settings(**PLACED, lora_rank=4))  # no longer refused
    base, tokenizer = load_model("tiny-math")
    model = get_peft_model(copy.deepcopy(base), lora_config(Settings(lora_rank=4)))
    adapters = [(name, parameter) for name, parameter in model.named_parameters() if parameter.requires_grad]
    drawn = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in adapters:
            if "lora_B" in name:
                parameter.normal_(0, 0.05, generator=drawn)

    def merged_digest() -> str:
        return weights_digest(copy.deepcopy(model).merge_and_unload().named_parameters())

    decoder = EngineRollout(tokenizer, **SAMPLING)
    generator = serving(decoder, base, [], [])
    expected = sync_samples(model, tokenizer)
    trainer, rollout = fake_trainer(model), placed_rollout(tokenizer)
    trainer.upcoming_prompts = lambda: SECOND
    assert rollout(FIRST, trainer)["completion_ids"] == expected[0]["completion_ids"]
    sent = rollout.sampler._manifest
    assert sent["names"] == [name for name, _ in adapters] and len(adapters) == 2 * 7 * base.config.num_hidden_layers
    assert all(name.endswith((".lora_A.default.weight", ".lora_B.default.weight")) for name in sent["names"])
    assert rollout.sampler._buffer.nbytes == sum(parameter.nbytes for _, parameter in adapters)
    assert rollout.sampler._buffer.nbytes < sum(parameter.nbytes for parameter in base.parameters()) / 10
    assert weights_digest(decoder.engine.model.named_parameters()) == merged_digest()
    with torch.no_grad():  # the optimizer's step of the adapters, while step 1's completions are generated
        for _, parameter in adapters:
            parameter.add_(0.05 * torch.randn_like(parameter))
    second_step(rollout, trainer, expected)  # from the adapters of step 0
    rollout.on_train_end(None, None, None)  # step 2's job, from the stepped adapters, taken; the end sent
    generator.join(timeout=30)
    assert weights_digest(decoder.engine.model.named_parameters()) == merged_digest()
