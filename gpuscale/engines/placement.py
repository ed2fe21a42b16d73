"""Placement: k ranks generate, the others train (grpo-mtl's `generation_gpus`), the new weights sent from
the trainers to the generators every step.

The design, and why:
- The generators are the launch's last k ranks (engines/distributed.py: side ranks), not processes of their
  own: the one launch starts them, so the supervisor sees them, the launcher's fail-fast ends every rank
  when one dies and names it (a generator's SIGKILL is `rank R: killed by SIGKILL`), the hang watch hears
  their heartbeats, a stop and a preemption reach them, with nothing new in control/. TRL and accelerate
  run every collective on the default process group, so the generators stay out of it: the training ranks
  are told the smaller world before it is made, and the generators make none.
- What the two sides share is the launcher's own TCPStore (MASTER_ADDR:MASTER_PORT, which torchrun's agent
  hosts for every rank), under PREFIX. Prompts and completions travel as keys of it: a trainer puts its
  rows' token ids and the sampling seed, its generator puts back the completions' ids and the log-probs
  TRL's importance-sampling correction needs. They are small (a step's token ids), the store needs no
  shapes agreed beforehand nor a group in which every trainer takes part, and a key waits for its reader
  however late it comes (the trainers' first evaluation can take minutes). The weights are large and go
  over a process group built on the same store (ProcessGroupNCCL on GPUs, ProcessGroupGloo on CPU; made
  directly on a PrefixStore, as vLLM's stateless groups are, never registered as a default or sub-group):
  training rank 0 and the k generators, one broadcast of one flat buffer a step from rank 0 (the training
  ranks hold the same weights, DDP's doing). The group is joined at the first job, when both sides are
  there.
- What travels is what training changes (engines/merged_lora.py: `trained_parameters`): a full fine-tune's
  every weight, cast to the dtype the generators decode in; a LoRA run's adapter tensors alone (lora_A and
  lora_B of each adapted module, in their own dtype: a few MiB where the model is GBs). A LoRA run's
  generator builds the same adapter (its config is in the manifest) on the base model it loads itself,
  keeps those base weights in the adapter's layers, and after each receipt merges base + delta (peft's) into
  the plain copy its engine decodes, in place.
- A job (one a step, the trainers' AsyncEngineRollout submits it: engines/async_rollout.py) is numbered alike
  on every rank (every rank submits the same sequence). Training rank 0 writes its header first (`job/N`: the
  step it trains, the step of its weights, whether new weights follow; the first holds the manifest: names,
  shapes and dtype of what is sent, the dtype decoded in, a LoRA adapter's config), then, where the trainer
  has stepped since the last job, broadcasts the weights (the `weight_sync` phase); each trainer T writes
  `prompts/N/T`, and the generator T % k answers `completions/N/T`. Training rank 0 writes `end` when training
  ends, and again whatever way its work ends (`generators_released`: an error, a preemption before or during
  training): the generators serve every job announced before it, then leave their loop and their rank ends.
- Preemption (SLURM's signal): a generator serves inside `preemption.cooperating()`, so that the signal
  never ends it while the trainers may still wait for its completions; it ends at `end`, preempted.
- The lag: the generator decodes job N+1 while the trainers train on job N's completions, from the
  weights of the step before (staleness 1, corrected by TRL's importance sampling: engines/off_policy.py),
  or each job from the current weights (max_staleness=0).

A generator beats (heartbeat `step`) as each job is served, not while it waits: a generator waiting on a
hung trainer is as silent as it, so that the hang watch still finds the run hung.

GPUSCALE_WEIGHTS_DIGEST=1 (a test's hook: it costs a copy of the weights to the host) makes a generator
write, for each job, the step of the weights it samples from and their digest (`weights_digest` of the weights
it decodes, a LoRA run's merged, which a test computes on the trainers' checkpoints) to its log.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from gpuscale.data.step_phases import WEIGHT_SYNC
from gpuscale.engines.step_phases import phase
from gpuscale.runs.heartbeat import STEP

PREFIX = "gpuscale/placement/"
END = "end"
# A key is polled (the store's blocking wait logs a warning at each timeout, and waits for all of its keys,
# not for the first): first after a millisecond, then less often, at most every POLL_MOST_S, what a job's
# answer may come late by (under 1% of a 0.6 s step), for a round trip to the store (~0.1 ms) each time.
POLL_FIRST_S, POLL_MOST_S = 0.001, 0.005
# The weights group's collectives: both sides are there when one starts (the header says it comes), so
# only a rank gone wrong takes long, and the launcher or the hang watch ends the run first.
GROUP_TIMEOUT = timedelta(minutes=30)
DIGEST_ENV = "GPUSCALE_WEIGHTS_DIGEST"


def weights_digest(named_parameters) -> str:
    """sha256 of the parameters' names and bytes, in name order: equal only for the same weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(named_parameters, key=lambda item: item[0]):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class Link:
    """One rank's end of what the training ranks and the generators share: the launcher's store under
    PREFIX, and, on training rank 0 and the generators, the weights group. `ctx`: the rank's RankContext
    (`world_size` training ranks, `side_ranks` generators)."""

    def __init__(self, ctx):
        self.rank, self.device = ctx.rank, ctx.device
        self.trainers, self.generators = ctx.world_size, ctx.side_ranks
        launcher = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                 timeout=GROUP_TIMEOUT)
        self.store = dist.PrefixStore(PREFIX, launcher)
        self._group = None

    @property
    def member(self) -> int:
        """This rank's place in the weights group: training rank 0 first, then the generators."""
        return 0 if self.rank == 0 else self.rank - self.trainers + 1

    def group(self):
        """The weights group (made on first use: both sides reach it at the first job)."""
        if self._group is None:
            store = dist.PrefixStore("weights/", self.store)
            size = self.generators + 1
            if self.device.type == "cuda":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = GROUP_TIMEOUT
                self._group = dist.ProcessGroupNCCL(store, self.member, size, options)
            else:
                self._group = dist.ProcessGroupGloo(store, self.member, size, GROUP_TIMEOUT)
        return self._group

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Training rank 0's `tensor` into every member's (in place)."""
        self.group().broadcast(tensor, 0).wait()

    def put(self, key: str, value) -> None:
        self.store.set(key, pickle.dumps(value))

    def take(self, key: str):
        """The value at `key` once it is there, the key removed (it is read once)."""
        value = self.read(key)
        self.store.delete_key(key)
        return value

    def read(self, key: str):
        """The value at `key` once it is there."""
        return self.read_first(key)[1]

    def read_first(self, *keys: str) -> tuple[str, object]:
        """(the first of `keys` that is there, its value), once one is (polled: see POLL_FIRST_S)."""
        pause = POLL_FIRST_S
        while (found := next((key for key in keys if self.store.check([key])), None)) is None:
            time.sleep(pause)
            pause = min(2 * pause, POLL_MOST_S)
        return found, pickle.loads(self.store.get(found))


def manifest(model, dtype: torch.dtype) -> dict:
    """What the weights broadcast holds: what training changes (engines/merged_lora.py: a full fine-tune's every
    parameter, in `dtype`, the one the generators decode in; a LoRA model's adapter tensors, in their own),
    their names and shapes in order, and with LoRA the adapter's config, from which a generator builds the
    same adapter on the base model it loads and merges what it is sent."""
    from gpuscale.engines.merged_lora import adapter_config, trained_parameters

    sent = trained_parameters(model)
    lora = adapter_config(model)
    return {"names": [name for name, _ in sent], "shapes": [list(parameter.shape) for _, parameter in sent],
            "dtype": str(sent[0][1].dtype if lora else dtype).removeprefix("torch."),
            "decode_dtype": str(dtype).removeprefix("torch."), "lora": lora}


def flat_buffer(sent: dict, device: torch.device) -> torch.Tensor:
    return torch.empty(sum(torch.Size(shape).numel() for shape in sent["shapes"]),
                       dtype=getattr(torch, sent["dtype"]), device=device)


def flat_pieces(buffer: torch.Tensor, parameters) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(each parameter, its piece of the flat buffer, shaped as it), in order."""
    offset = 0
    for _, parameter in parameters:
        yield parameter, buffer[offset: offset + parameter.numel()].view_as(parameter)
        offset += parameter.numel()


# ---- the training ranks' side ---------------------------------------------------------------------------


class Pending:
    """A job's completions, taken from the store when asked for (`result`, as a Future's)."""

    def __init__(self, link: Link, key: str):
        self.link, self.key = link, key

    def result(self) -> dict[str, list]:
        return self.link.take(self.key)


class RemoteSampler:
    """The sampler of AsyncEngineRollout on a training rank when generators decode (engines/async_rollout.py:
    `start`, `taken`, `close`). `rollout`: the EngineRollout whose prompt tokenization and seeds the
    generators' completions follow (its own engine is never built); `link`: the rank's Link."""

    def __init__(self, rollout, link: Link):
        self.rollout, self.link = rollout, link
        self.jobs = 0
        self.sent_step = -1  # the optimizer step of the weights the generators hold (training rank 0)
        self._buffer = None
        self._manifest = None

    def start(self, prompts: list, step: int, trainer) -> tuple[int, Pending]:
        """Ask the generators for `prompts`' completions, which optimizer step `step` trains on: (the step
        of the weights they sample from, the pending completions). Training rank 0 sends the weights
        first where the trainer has stepped since the last job."""
        job, self.jobs = self.jobs, self.jobs + 1
        weights_step = int(trainer.state.global_step)
        if self.link.rank == 0:
            self._announce(job, step, weights_step, trainer)
        seed = self.rollout.step_seed(trainer, step)
        ids = [self.rollout.prompt_ids(prompt) for prompt in prompts]
        self.link.put(f"prompts/{job}/{self.link.rank}", {"ids": ids, "seed": seed})
        return weights_step, Pending(self.link, f"completions/{job}/{self.link.rank}")

    def _announce(self, job: int, step: int, weights_step: int, trainer) -> None:
        """Job `job`'s header, then the weights where they changed since the generators' copy."""
        from gpuscale.engines.rollout import decode_dtype

        model = trainer.accelerator.unwrap_model(trainer.model)
        header = {"step": step, "weights_step": weights_step, "sync": weights_step != self.sent_step}
        if self._manifest is None:
            self._manifest = header["manifest"] = manifest(model, decode_dtype(model, trainer.args))
        self.link.put(f"job/{job}", header)
        if header["sync"]:
            with phase(WEIGHT_SYNC):
                self._send(model)
            self.sent_step = weights_step

    def _send(self, model) -> None:
        from gpuscale.engines.merged_lora import trained_parameters

        if self._buffer is None:
            self._buffer = flat_buffer(self._manifest, next(model.parameters()).device)
            print(f"placement: {len(self._manifest['names'])} tensors ({self._buffer.nbytes / 2**20:.1f} MiB of "
                  f"{self._manifest['dtype']}{', the LoRA adapters' if self._manifest['lora'] else ''}) go to the "
                  "generators after each optimizer step", flush=True)
        with torch.no_grad():
            for parameter, piece in flat_pieces(self._buffer, trained_parameters(model)):
                piece.copy_(parameter)
        self.link.broadcast(self._buffer)

    def taken(self) -> None:
        """Nothing to do once a job's completions are taken (the local sampler's streams meet there)."""

    def close(self) -> None:
        """Training is over: rank 0 tells the generators, whose loop then ends."""
        if self.link.rank == 0:
            self.link.put(END, True)


@contextmanager
def generators_released(ctx) -> Iterator[None]:
    """On training rank 0 of a run with generators: however the work inside ends (its end, an error, a
    preemption before training or during it), `end` is written, so that no generator waits for a job
    that will never come (a training rank that dies ends the launch anyway; one preempted exits 0)."""
    try:
        yield
    finally:
        if ctx.side_ranks and ctx.rank == 0:
            Link(ctx).put(END, True)


# ---- the generators' side ------------------------------------------------------------------------------


def serve(link: Link, rollout, model, reporter) -> int:
    """A generator's work: for each job until the trainers' end, the weights received where they changed,
    then the completions of the trainers it serves (T % k == its index), decoded by `rollout` (an
    EngineRollout) on `model` (the base model), which takes the trainers' weights (`WeightsReceiver`);
    returns the jobs served."""
    index = link.rank - link.trainers
    served = range(index, link.trainers, link.generators)
    receiver = None
    job = 0
    while (header := next_job(link, job)) is not None:
        if receiver is None:
            receiver = WeightsReceiver(link, model, header["manifest"])
            rollout.use_model(receiver.model)
        if header["sync"]:
            receiver.receive()
        if os.environ.get(DIGEST_ENV):
            print(f"job for step {header['step']}: weights of step {header['weights_step']}, digest "
                  f"{weights_digest(receiver.model.named_parameters())}", flush=True)
        for trainer in served:
            request = link.take(f"prompts/{job}/{trainer}")
            link.put(f"completions/{job}/{trainer}", rollout.generate_ids(request["ids"], request["seed"]))
        reporter.beat(STEP, header["step"])
        job += 1
    return job


def next_job(link: Link, job: int) -> dict | None:
    """Job `job`'s header, or None once the trainers wrote `end` before it (their last write: a header
    written just before it is looked for once more)."""
    found, header = link.read_first(f"job/{job}", END)
    if found != END:
        return header
    return link.read(f"job/{job}") if link.store.check([f"job/{job}"]) else None


class WeightsReceiver:
    """A generator's model in the dtype the trainers decode in, the buffer their weights arrive in, and with LoRA
    the same adapter as theirs on it (`trained`): only the adapters arrive, and `model`, what the engine decodes,
    is a plain copy with them merged (engines/merged_lora.py), whose adapted weights each receipt merges again
    from the base weights kept in the adapter's layers."""

    def __init__(self, link: Link, model, sent: dict):
        from gpuscale.engines.merged_lora import trained_parameters, with_adapter
        from gpuscale.engines.rollout import half_precision_copy

        model = model.to(getattr(torch, sent["decode_dtype"])).requires_grad_(False)
        self.trained = model if sent["lora"] is None else with_adapter(model, sent["lora"])
        mine = [(name, list(parameter.shape)) for name, parameter in trained_parameters(self.trained)]
        theirs = list(zip(sent["names"], sent["shapes"], strict=True))
        if [tuple(item) for item in mine] != [tuple(item) for item in theirs]:
            different = next((a, b) for a, b in zip(mine, theirs, strict=False) if tuple(a) != tuple(b))
            raise RuntimeError(f"generation: the trainers send other weights than this generator's model holds "
                               f"(first difference: {different[1]} sent, {different[0]} here)")
        self.link = link
        self.model = model if sent["lora"] is None else half_precision_copy(self.trained, model.dtype)
        self.buffer = flat_buffer(sent, next(model.parameters()).device)

    def receive(self) -> None:
        """The trainers' weights into the model, in place (the engine's CUDA graphs stay valid)."""
        from gpuscale.engines.merged_lora import trained_parameters
        from gpuscale.engines.rollout import copy_weights

        self.link.broadcast(self.buffer)
        with torch.no_grad():
            for parameter, piece in flat_pieces(self.buffer, trained_parameters(self.trained)):
                parameter.copy_(piece)
        if self.model is not self.trained:
            copy_weights(self.trained, self.model, trained_only=True)
