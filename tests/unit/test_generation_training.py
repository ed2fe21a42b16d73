"""The generation engine inside a training loop: the model keeps its train/eval mode; decode equals
teacher forcing after optimizer steps, with LoRA adapters (added before or after the engine was
built), and with a hook or a wrapper on a linear layer added after; per-row low-rank terms equal
explicitly perturbed weights; k samples per prompt share one prefill.

Each test runs on CPU with the default settings and with the static-shape step (what CUDA graphs
replay), and on CUDA, where available, with the CUDA defaults (CUDA graphs and torch.compile):
python -m pytest -m gpu tests/unit/test_generation_training.py
"""

import copy
import shutil
import warnings
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_generation import PAD, PROMPTS, _on_cpu, _sharpen, teacher_forced
from torch.utils._python_dispatch import TorchDispatchMode

from gpuscale.data.models import build_random_model
from gpuscale.engines.generation import GenerationEngine, RowScale, RowTerm, Sampling
from gpuscale.engines.generation.compiled import _CompiledOrEager

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SAMPLING = Sampling(0.9, top_k=40)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_cpp_compiler = pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                                        reason="torch.compile on CPU needs a C++ compiler")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# (id, device, engine keyword arguments, marks)
SETTINGS = [("cpu", "cpu", {}, []), ("cpu-static", "cpu", {"static_shapes": True}, []),
            ("cuda-graphs-compiled", "cuda", {}, [pytest.mark.gpu, needs_cuda])]


def settings_params(id_suffix="", **engine_kwargs):
    return [pytest.param((device, {**kwargs, **engine_kwargs}), id=name + id_suffix, marks=marks)
            for name, device, kwargs, marks in SETTINGS]


@pytest.fixture(params=settings_params())
def setting(request):
    """(device, engine keyword arguments)."""
    return request.param


def fresh_model(device):
    """random-tiny (Llama), sharpened so that greedy choices are not near-ties, in TRAIN mode."""
    return _sharpen(build_random_model("random-tiny", seed=0), 5).to(device).train()


def make_engine(model, setting, **kwargs):
    device, settings = setting
    engine = GenerationEngine(model, pad_token_id=PAD, **settings, **kwargs)
    if device == "cuda":
        assert engine.cuda_graphs and engine.compile
    return engine


def seeded(device, seed):
    return torch.Generator(device=device).manual_seed(seed)


def tolerance(setting):
    return 1e-4 if setting[0] == "cpu" else 1e-3


def teacher_forced_logprobs(model, generation, rows=None):
    """Per-token log-probs of `generation` (only `rows`, if given) from one forward of `model` in eval
    mode; the model's modes are restored afterwards."""
    generation = _on_cpu(generation)
    if rows is not None:
        generation = SimpleNamespace(**{name: value[rows] for name, value in vars(generation).items()})
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        return teacher_forced(model, generation)[1]
    finally:
        for m, training in modes:
            m.training = training


def assert_decode_equals_teacher_forcing(model, generation, setting):
    expected = teacher_forced_logprobs(model, generation)
    mask = generation.mask.cpu()
    assert bool(mask.any())
    torch.testing.assert_close(generation.base_logprobs.cpu()[mask], expected[mask], atol=tolerance(setting), rtol=0)


def max_difference(generation, expected):
    mask = generation.mask.cpu()
    return float((generation.base_logprobs.cpu() - expected)[mask].abs().max())


def modes(model):
    return {name: m.training for name, m in model.named_modules()}


# ---- train/eval mode -------------------------------------------------------------------------------


def test_the_model_keeps_its_train_and_eval_modes(setting):
    model = fresh_model(setting[0])
    model.model.layers[1].eval()  # a mixed state: each module must get its own mode back
    before = modes(model)
    assert model.training and not model.model.layers[1].training
    engine = make_engine(model, setting)
    assert modes(model) == before
    out = engine.generate(PROMPTS, 8, SAMPLING, seeded(setting[0], 0))
    assert modes(model) == before
    proposal = engine.resample(out, [1, 0, 2, 3], 10, SAMPLING, seeded(setting[0], 1))
    engine.accept(out, proposal, [True, False, True, False])
    assert modes(model) == before


def test_dropout_is_off_during_engine_calls(setting):
    """Attention dropout 0.5 in a model left in train mode: decoding still equals the eval-mode
    forward (with dropout on it would be far off)."""
    model = fresh_model(setting[0])
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    engine = make_engine(model, setting)
    out = engine.generate(PROMPTS, 12, SAMPLING, seeded(setting[0], 0))
    assert_decode_equals_teacher_forcing(model, out, setting)
    assert model.training


# ---- (a) optimizer steps -------------------------------------------------------------------------


def train_steps(model, steps=3, lr=3e-2, fused=False):
    """A few real AdamW steps of next-token loss on random tokens (in place, as a training loop does).
    `fused`: the fused AdamW kernel, transformers' Trainer's default, which updates the weights
    without bumping their version counters."""
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=fused)
    ids = torch.randint(1, 500, (4, 16), generator=torch.Generator().manual_seed(9)).to(device)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("fused_optimizer", [False, True], ids=["adamw", "adamw-fused"])
def test_decode_equals_teacher_forcing_after_optimizer_steps(setting, fused_optimizer):
    device = setting[0]
    model = fresh_model(device)
    engine = make_engine(model, setting)
    before = engine.generate(PROMPTS, 16, SAMPLING, seeded(device, 0))
    assert_decode_equals_teacher_forcing(model, before, setting)
    train_steps(model, fused=fused_optimizer)
    after = engine.generate(PROMPTS, 16, SAMPLING, seeded(device, 0))
    assert_decode_equals_teacher_forcing(model, after, setting)
    # The step moved the model: the same engine would be off if it decoded the old weights.
    assert max_difference(before, teacher_forced_logprobs(model, before)) > 0.05
    resampled = engine.resample(after, [2, 0, 5, 1], 16, SAMPLING, seeded(device, 1))
    assert_decode_equals_teacher_forcing(model, resampled, setting)


# ---- (b) LoRA adapters ---------------------------------------------------------------------------


def add_lora(model):
    """LoRA on every linear of the layers, dropout on (active in train mode), B random so it matters."""
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, target_modules=LINEARS)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return peft_model.train()


def assert_adapter_matters(peft_model, generation):
    with peft_model.disable_adapter():
        without = teacher_forced_logprobs(peft_model, generation)
    assert max_difference(generation, without) > 0.05


def test_lora_adapter_added_after_the_engine_was_built(setting):
    device = setting[0]
    model = fresh_model(device)
    engine = make_engine(model, setting)
    engine.generate(PROMPTS, 8, SAMPLING, seeded(device, 0))  # steps compiled / captured without LoRA
    peft_model = add_lora(model)
    out = engine.generate(PROMPTS, 16, SAMPLING, seeded(device, 1))
    assert not engine._use_fused  # q/k/v and gate/up are LoRA layers now: the model's own modules run
    assert_decode_equals_teacher_forcing(peft_model, out, setting)
    assert_adapter_matters(peft_model, out)
    assert peft_model.training
    # Training the adapter between calls is followed too.
    train_steps(peft_model)
    again = engine.generate(PROMPTS, 16, SAMPLING, seeded(device, 1))
    assert_decode_equals_teacher_forcing(peft_model, again, setting)


def test_lora_adapter_added_before_the_engine_was_built(setting):
    device = setting[0]
    peft_model = add_lora(fresh_model(device))
    engine = make_engine(peft_model, setting)
    out = engine.generate(PROMPTS, 16, SAMPLING, seeded(device, 0))
    assert_decode_equals_teacher_forcing(peft_model, out, setting)
    assert_adapter_matters(peft_model, out)
    train_steps(peft_model)
    again = engine.generate(PROMPTS, 16, SAMPLING, seeded(device, 0))
    assert_decode_equals_teacher_forcing(peft_model, again, setting)
    assert peft_model.training


# ---- (c) hooks and wrappers ----------------------------------------------------------------------


class ScaledLinear(torch.nn.Module):
    """A wrapper standing in for a linear layer: inner(x) * 1.5 + 0.05."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * 1.5 + 0.05


def test_forward_hooks_added_after_the_engine_was_built(setting):
    device = setting[0]
    model = fresh_model(device)
    engine = make_engine(model, setting)
    plain = engine.generate(PROMPTS, 16, SAMPLING, seeded(device, 0))
    assert engine._use_fused == (engine._fused is not None)
    layer = model.model.layers[0]
    handles = [
        layer.mlp.gate_proj.register_forward_hook(lambda module, args, out: out * 1.5 + 0.1),
        layer.self_attn.v_proj.register_forward_pre_hook(lambda module, args: (args[0] * 2.0,)),
    ]
    hooked = engine.generate(PROMPTS, 16, SAMPLING, seeded(device, 0))
    assert not engine._use_fused
    assert_decode_equals_teacher_forcing(model, hooked, setting)
    for handle in handles:
        handle.remove()
    assert max_difference(hooked, teacher_forced_logprobs(model, hooked)) > 0.05  # the hooks mattered
    # Hooks gone: the fast path again, and the plain results.
    back = engine.generate(PROMPTS, 16, SAMPLING, seeded(device, 0))
    assert engine._use_fused == (engine._fused is not None)
    assert torch.equal(back.tokens, plain.tokens)
    assert_decode_equals_teacher_forcing(model, back, setting)


def test_wrapped_linear_layers_added_after_the_engine_was_built(setting):
    device = setting[0]
    model = fresh_model(device)
    engine = make_engine(model, setting)
    engine.generate(PROMPTS, 8, SAMPLING, seeded(device, 0))
    model.model.layers[1].self_attn.k_proj = ScaledLinear(model.model.layers[1].self_attn.k_proj)
    model.model.layers[0].mlp.up_proj = ScaledLinear(model.model.layers[0].mlp.up_proj)
    model.model.layers[0].mlp.down_proj = ScaledLinear(model.model.layers[0].mlp.down_proj)
    out = engine.generate(PROMPTS, 16, SAMPLING, seeded(device, 1))
    assert not engine._use_fused
    assert_decode_equals_teacher_forcing(model, out, setting)
    # A wrapper outside the fused projections (o_proj) keeps the fused path, and is followed too.
    model2 = fresh_model(device)
    engine2 = make_engine(model2, setting)
    engine2.generate(PROMPTS, 8, SAMPLING, seeded(device, 0))
    model2.model.layers[0].self_attn.o_proj = ScaledLinear(model2.model.layers[0].self_attn.o_proj)
    out2 = engine2.generate(PROMPTS, 16, SAMPLING, seeded(device, 1))
    assert engine2._use_fused == (engine2._fused is not None)
    assert_decode_equals_teacher_forcing(model2, out2, setting)


# ---- (d) per-row terms ---------------------------------------------------------------------------


@pytest.fixture(params=settings_params() + settings_params("-terms-in-projections", fuse_row_terms=True))
def term_setting(request):
    """`setting`'s, each with both ways of adding the terms in the decode steps (hooks, or in the
    projections: the engine's fuse_row_terms)."""
    return request.param


def make_row_terms(model, groups, rank=2, scale=0.7, seed=0):
    """{module name: RowTerm} for every linear of every layer, random down/up."""
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    terms = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LINEARS:
            down = torch.randn(groups, module.in_features, rank, generator=generator) * 0.3
            up = torch.randn(groups, module.out_features, rank, generator=generator) * 0.3
            terms[name] = RowTerm(down.to(device), up.to(device), scale)
    return terms


def perturbed_copy(model, terms, group):
    """A copy of the model whose linear layers are W + scale * up[g] @ down[g]^T."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for name, term in terms.items():
            delta = term.scale * term.up[group] @ term.down[group].transpose(0, 1)
            twin.get_submodule(name).weight.add_(delta.to(twin.get_submodule(name).weight.dtype))
    return twin


def assert_groups_match_perturbed_copies(model, terms, generation, groups, setting, atol=None):
    rows_per_group = generation.batch_size // groups
    for group in range(groups):
        rows = slice(group * rows_per_group, (group + 1) * rows_per_group)
        expected = teacher_forced_logprobs(perturbed_copy(model, terms, group), generation, rows)
        mask = generation.mask[rows].cpu()
        torch.testing.assert_close(generation.base_logprobs[rows].cpu()[mask], expected[mask],
                                   atol=atol if atol is not None else tolerance(setting), rtol=0)


@pytest.mark.parametrize("groups, samples_per_prompt", [(2, 1), (4, 2), (8, 2)],
                         ids=["2-groups", "4-groups-shared-prefill", "8-groups-own-prefill"])
@pytest.mark.parametrize("rank", [1, 2])
def test_row_terms_equal_explicitly_perturbed_weights(term_setting, groups, samples_per_prompt, rank):
    device = term_setting[0]
    model = fresh_model(device)
    engine = make_engine(model, term_setting)
    terms = make_row_terms(model, groups, rank=rank)
    handles = [engine.add_row_term(name, term) for name, term in terms.items()]
    out = engine.generate(PROMPTS, 14, SAMPLING, seeded(device, 0), samples_per_prompt=samples_per_prompt)
    assert engine._use_fused == (engine._fused is not None)  # terms keep the fused projections
    if term_setting[1].get("fuse_row_terms"):  # o_proj's and down_proj's terms too, not by their hooks
        assert all(o_proj and down_proj for o_proj, down_proj in engine._fused.output_terms)
    assert_groups_match_perturbed_copies(model, terms, out, groups, term_setting)
    assert max_difference(out, teacher_forced_logprobs(model, out)) > 0.05  # the terms mattered
    resampled = engine.resample(out, out.lengths // 2, 16, SAMPLING, seeded(device, 1))
    assert_groups_match_perturbed_copies(model, terms, resampled, groups, term_setting)
    # Outside engine calls the model is unperturbed.
    assert torch.equal(teacher_forced_logprobs(model, out), teacher_forced_logprobs(fresh_model(device), out))
    for handle in handles:
        handle.remove()
    plain = engine.generate(PROMPTS, 14, SAMPLING, seeded(device, 0), samples_per_prompt=samples_per_prompt)
    assert_decode_equals_teacher_forcing(model, plain, term_setting)


def test_row_terms_refilled_in_place_change_the_next_call(term_setting):
    device = term_setting[0]
    model = fresh_model(device)
    engine = make_engine(model, term_setting)
    terms = make_row_terms(model, groups=2, seed=0)
    for name, term in terms.items():
        engine.add_row_term(name, term)
    first = engine.generate(PROMPTS, 14, SAMPLING, seeded(device, 0))
    graphs = dict(engine._graphs)
    # EGGROLL's next population: new numbers in the same buffers, and a new scale.
    refill = make_row_terms(model, groups=2, seed=1)
    for name, term in terms.items():
        term.down.copy_(refill[name].down)
        term.up.copy_(refill[name].up)
        term.scale.fill_(1.1)
    refill = {name: RowTerm(t.down, t.up, 1.1) for name, t in refill.items()}
    second = engine.generate(PROMPTS, 14, SAMPLING, seeded(device, 0))
    assert engine._graphs == graphs  # the same captured graphs replayed the new numbers (CUDA)
    assert_groups_match_perturbed_copies(model, refill, second, 2, term_setting)
    assert not torch.allclose(first.base_logprobs, second.base_logprobs)
    engine.remove_row_terms()
    plain = engine.generate(PROMPTS, 14, SAMPLING, seeded(device, 0))
    assert_decode_equals_teacher_forcing(model, plain, term_setting)


def test_row_scales_equal_explicitly_scaled_norm_gains(term_setting):
    """A RowScale on every norm: group g's rows decode as a copy whose gains are g * factors[g]
    (EGGROLL's perturbed norms), in prefill and decode, next to low-rank terms on the linears."""
    device = term_setting[0]
    model = fresh_model(device)
    engine = make_engine(model, term_setting)
    terms = make_row_terms(model, groups=2)
    for name, term in terms.items():
        engine.add_row_term(name, term)
    generator = torch.Generator().manual_seed(5)
    norms = {name: module for name, module in model.named_modules() if name.endswith("norm")}
    scales = {name: RowScale((1 + 0.3 * torch.randn(2, module.weight.shape[0], generator=generator)).to(device))
              for name, module in norms.items()}
    for name, scale in scales.items():
        engine.add_row_term(name, scale)
    out = engine.generate(PROMPTS, 14, SAMPLING, seeded(device, 0))
    rows_per_group = out.batch_size // 2
    for group in range(2):
        twin = perturbed_copy(model, terms, group)
        with torch.no_grad():
            for name, scale in scales.items():
                twin.get_submodule(name).weight.mul_(scale.factors[group].to(twin.dtype))
        rows = slice(group * rows_per_group, (group + 1) * rows_per_group)
        mask = out.mask[rows].cpu()
        torch.testing.assert_close(out.base_logprobs[rows].cpu()[mask], teacher_forced_logprobs(twin, out, rows)[mask],
                                   atol=tolerance(term_setting), rtol=0)
    assert len(scales) == 2 * len(model.model.layers) + 1
    with pytest.raises(ValueError, match="no gain vector"):
        engine.add_row_term(model.model.layers[0].mlp.gate_proj, RowScale(torch.ones(2, 64, device=device)))


def test_terms_in_the_projections_leave_an_o_proj_hooked_by_another_to_its_hooks():
    """With the terms in the projections, an o_proj that something else hooks still runs as a module at
    every decode step (that hook runs; its terms by their hooks), the other layer's o_proj as its
    matmul and terms: the same tokens and log-probs as with every term by hooks."""
    model = fresh_model("cpu")
    decode_calls = []
    model.model.layers[0].self_attn.o_proj.register_forward_hook(
        lambda module, args, output: decode_calls.append(args[0].shape[1] == 1))
    outs = []
    for fuse in (False, True):
        engine = GenerationEngine(model, pad_token_id=PAD, fuse_row_terms=fuse)
        for name, term in make_row_terms(model, groups=2).items():
            engine.add_row_term(name, term)
        decode_calls.clear()
        outs.append(engine.generate(PROMPTS, 8, SAMPLING, seeded("cpu", 0)))
        engine.remove_row_terms()
    assert engine._use_fused and engine._fused.output_terms[0][0] == [] and engine._fused.output_terms[1][0]
    assert decode_calls.count(True) == 8  # every decode step of the last call ran layer 0's o_proj
    assert torch.equal(outs[0].tokens, outs[1].tokens)
    torch.testing.assert_close(outs[0].base_logprobs, outs[1].base_logprobs, atol=1e-6, rtol=0)


class InPlaceTermAdds(TorchDispatchMode):
    """Counts the in-place adds of the hooks' terms (`RowTerm.add_into`: addcmul_ at rank 1, baddbmm_
    above; nothing else in an engine call adds in place that way) among the aten ops run under it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.addcmul_.default, torch.ops.aten.baddbmm_.default)
        return func(*args, **(kwargs or {}))


def prefilled_kv(engine, columns: int) -> torch.Tensor:
    """Slot 0's keys and values in its first `columns` columns, every layer: [layers, 2, B, heads, C, D]."""
    return torch.stack([torch.stack([layer.keys[:, :, :columns], layer.values[:, :, :columns]])
                        for layer in engine._slots[0].layers]).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rank", [1, 2])
def test_terms_in_the_projections_prefill_as_the_hooks_and_the_perturbed_twins(dtype, rank):
    """fuse_row_terms' prefill (the fused wiring over every prompt token, each term inside its
    projection) writes the KV that the hooks' prefill writes and, group by group, that a twin whose
    weights are W + scale * up[g] @ down[g]^T writes without terms; the first token (greedy) gets the
    same choice and log-prob from each. And no term is added in place by a hook, prefill included.
    Each group answers the same prompts, so that a twin's prefill is laid out as the group's rows."""
    model = fresh_model("cpu").eval().to(dtype)
    terms = make_row_terms(model, groups=2, rank=rank)
    for term in terms.values():
        term.down, term.up = term.down.to(dtype), term.up.to(dtype)
    rows, columns, greedy = PROMPTS + PROMPTS, max(map(len, PROMPTS)) - 1, Sampling(temperature=0.0)
    kv, first_tokens, in_place_adds = {}, {}, {}
    for fuse in (False, True):
        engine = GenerationEngine(model, pad_token_id=PAD, fuse_row_terms=fuse)
        for name, term in terms.items():
            engine.add_row_term(name, term)
        with InPlaceTermAdds() as adds:
            first_tokens[fuse] = engine.generate(rows, 1, greedy)
        assert (engine._prefill_step is not None) == fuse
        kv[fuse], in_place_adds[fuse] = prefilled_kv(engine, columns), adds.count
        engine.remove_row_terms()
    assert in_place_adds[False] > 0 and in_place_adds[True] == 0
    twins_kv = []
    for group in range(2):
        twin_engine = GenerationEngine(perturbed_copy(model, terms, group), pad_token_id=PAD)
        twin_engine.generate(PROMPTS, 1, greedy)
        twins_kv.append(prefilled_kv(twin_engine, columns))
    twins_kv = torch.cat(twins_kv, dim=2)  # group 0's rows, then group 1's: the batch's order
    # fp32: the same sums in other orders. bf16: the twin rounds W + its term to bf16 once, the engine
    # rounds each product: within a few roundings of the largest value, through both layers.
    atol = 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps * float(twins_kv.abs().max())
    torch.testing.assert_close(kv[True], kv[False], atol=atol, rtol=0)
    torch.testing.assert_close(kv[True], twins_kv, atol=atol, rtol=0)
    plain_engine = GenerationEngine(model, pad_token_id=PAD)
    plain_engine.generate(rows, 1, greedy)
    assert float((kv[True] - prefilled_kv(plain_engine, columns)).abs().max()) > 0.05  # the terms matter
    assert torch.equal(first_tokens[True].tokens, first_tokens[False].tokens)
    logprob_atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(first_tokens[True].base_logprobs, first_tokens[False].base_logprobs,
                               atol=logprob_atol, rtol=0)
    # The twins' teacher forcing rounds its logits to bf16 (an ulp is 0.03 between 4 and 8).
    assert_groups_match_perturbed_copies(model, terms, first_tokens[True], 2, ("cpu", {}),
                                         atol=1e-4 if dtype == torch.float32 else 5e-2)


@needs_cpp_compiler
def test_compiled_prefill_with_terms_in_the_projections_compiles_once_for_every_prompt_width():
    """fuse_row_terms with compile, on CPU: the compiled prefill (its width a dynamic size) serves
    prompts of another width without compiling again (nor does anything else recompile), and both
    calls decode the greedy tokens of the terms and the norms' row scales by hooks, run eagerly. No
    kernel finds a token's member by dividing by a multiple of the width (on a GPU such 64-bit divisions
    by a runtime value ran the prefill's kernels 3-4.5x slower: RowTerm._fp32_term_of_rows). One layer:
    Inductor's time grows with the layers it compiles."""
    import re

    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    model = fresh_model("cpu").eval()
    del model.model.layers[1:]
    model.config.num_hidden_layers = 1
    terms = make_row_terms(model, groups=2, rank=1)
    generator = torch.Generator().manual_seed(1)
    for name in ("model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm"):
        terms[name] = RowScale(1 + 0.3 * torch.randn(2, model.config.hidden_size, generator=generator))
    longer = [prompt + [7, 8, 9] for prompt in PROMPTS]  # 3 more prefill columns, the same KV capacity
    greedy, outs = Sampling(temperature=0.0), {}
    for compiled in (False, True):
        engine = GenerationEngine(model, pad_token_id=PAD, static_shapes=True, compile=compiled,
                                  fuse_row_terms=compiled)
        for name, term in terms.items():
            engine.add_row_term(name, term)
        with warnings.catch_warnings(), inductor_config.patch(force_disable_caches=True):
            warnings.simplefilter("error", RuntimeWarning)  # a failed compilation falls back with one
            first, code = run_and_get_code(engine.generate, PROMPTS, 6, greedy)
            outs[compiled] = [first]
            graphs = counters["stats"]["unique_graphs"]
            outs[compiled].append(engine.generate(longer, 6, greedy))
        if compiled:
            assert isinstance(engine._prefill_step, _CompiledOrEager) and engine._prefill_step.error is None
            assert counters["stats"]["unique_graphs"] == graphs
            # Inductor's C++ divisors (`div_floor_integer(a, b)`, `a % b`): none holds a symbolic size (ks0...).
            divisors = re.findall(r"(?:div_floor_integer\(static_cast<int64_t>\((?:[^()]|\([^()]*\))*\), |% )"
                                  r"static_cast<int64_t>\(([^()]*)\)", "\n".join(code))
            assert divisors and not [d for d in divisors if re.search(r"\bk?s\d+\b", d)], divisors
        engine.remove_row_terms()
    for eager, compiled in zip(*outs.values()):
        assert torch.equal(eager.tokens, compiled.tokens)
        torch.testing.assert_close(eager.base_logprobs, compiled.base_logprobs, atol=1e-5, rtol=0)


@needs_cpp_compiler
def test_compiled_prefill_compiled_again_for_another_batch_is_dynamic_in_the_width_alone():
    """The compiled prefill (fuse_row_terms), compiled again for a batch of another size, takes the
    inputs it took at the first: the batch is a fixed size in both, the width the one symbolic size.
    Dynamo's automatic dynamic shapes would make every size that changed since the last compilation
    symbolic (here the batch; after the row-terms tests, each term's groups too): with some forty such
    sizes, the compiled RowScale test's prefill spent over 10 minutes in shape reasoning on CPU, where
    it compiles in under a minute static (on an H200 it now passes in about 24 s: bench/RESULTS.md).
    No new tokens: only the prefill compiles. One layer: Inductor's
    time grows with the layers it compiles."""
    from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics

    torch._dynamo.reset()  # no earlier test's compilation of the prefill: this test's sizes alone
    clear_compilation_metrics()
    model = fresh_model("cpu").eval()
    del model.model.layers[1:]
    model.config.num_hidden_layers = 1
    engine = GenerationEngine(model, pad_token_id=PAD, static_shapes=True, compile=True, fuse_row_terms=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed compilation falls back with one
        for rows in (PROMPTS, PROMPTS + PROMPTS):
            engine.generate(rows, 0)
    # One compilation per batch, each with the same inputs: no size of the batch's among them.
    inputs = [metrics.graph_input_count for metrics in get_compilation_metrics() if metrics.co_name == "prefill"]
    assert len(inputs) == 2 and inputs[1] == inputs[0], f"the prefill's compilations took {inputs} inputs"


@pytest.mark.gpu
@needs_cuda
def test_compiled_terms_in_the_projections_add_no_matmul_to_the_decode_step_or_the_prefill():
    """On CUDA, compiled: with the terms in the projections the decode step and the prefill call the
    matmuls they call without terms, where the hooks' terms call batched matmuls of their own
    (Inductor keeps a bmm a cuBLAS call on CUDA; on CPU it turns small ones into loops, so this is a
    GPU test). Without terms, fuse_row_terms compiles the prefill too: its matmuls are counted on
    both sides."""
    import re

    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    model = fresh_model("cuda").eval()

    def matmul_calls(terms: bool, **engine_kwargs) -> int:
        torch._dynamo.reset()
        engine = GenerationEngine(model, pad_token_id=PAD, **engine_kwargs)
        for name, term in make_row_terms(model, groups=2, rank=1).items() if terms else ():
            engine.add_row_term(name, term)
        with inductor_config.patch(force_disable_caches=True):  # a cache hit would compile no code to read
            _, code = run_and_get_code(engine.generate, PROMPTS, 4, SAMPLING, seeded("cuda", 0))
        engine.remove_row_terms()
        return len(re.findall(r"extern_kernels\.(?:mm|addmm|bmm|baddbmm)\b", "\n".join(code)))

    plain = matmul_calls(terms=False, fuse_row_terms=True)
    assert plain > matmul_calls(terms=False) > 0  # the prefill's matmuls beside the decode step's
    assert matmul_calls(terms=True, fuse_row_terms=True) == plain
    assert matmul_calls(terms=True) > matmul_calls(terms=False)


def test_row_terms_are_validated():
    model = fresh_model("cpu")
    engine = GenerationEngine(model, pad_token_id=PAD)
    linear = model.model.layers[0].mlp.gate_proj
    with pytest.raises(ValueError, match="does not fit"):
        engine.add_row_term(linear, RowTerm(torch.zeros(2, 5, 1), torch.zeros(2, linear.out_features, 1)))
    with pytest.raises(ValueError, match="not a linear layer"):
        engine.add_row_term("model.layers.0.mlp", RowTerm(torch.zeros(2, 64, 1), torch.zeros(2, 64, 1)))
    with pytest.raises(ValueError, match="need down"):
        RowTerm(torch.zeros(2, 64), torch.zeros(2, 128, 1))
    engine.add_row_term(linear, RowTerm(torch.zeros(3, 64, 1), torch.zeros(3, 128, 1)))
    with pytest.raises(ValueError, match="3 groups"):
        engine.generate(PROMPTS, 4)  # 4 rows do not split into 3 groups


# ---- (e) samples per prompt ----------------------------------------------------------------------


def prefill_batches(model):
    """A list that fills with the batch size of every multi-token (prefill) forward."""
    seen = []
    model.model.embed_tokens.register_forward_hook(
        lambda module, args, out: seen.append(args[0].shape[0]) if args[0].shape[1] > 1 else None)
    return seen


@pytest.mark.parametrize("sampling", [Sampling(temperature=0), SAMPLING], ids=["greedy", "sampled"])
def test_samples_per_prompt_share_one_prefill(setting, sampling):
    device, k = setting[0], 3
    model = fresh_model(device)
    engine = make_engine(model, setting)
    prefills = prefill_batches(model)
    shared = engine.generate(PROMPTS, 12, sampling, seeded(device, 0), samples_per_prompt=k)
    assert prefills == [len(PROMPTS)]  # one prefill row per prompt
    repeated_prompts = [p for p in PROMPTS for _ in range(k)]
    assert shared.tokens.shape == (len(PROMPTS) * k, 12)
    for row, prompt in enumerate(repeated_prompts):
        assert shared.prompt_ids[row, : shared.prompt_lengths[row]].tolist() == prompt
    assert_decode_equals_teacher_forcing(model, shared, setting)
    if not sampling.greedy:
        assert len({tuple(seq) for seq in shared.sequences()[:k]}) > 1  # k different samples of prompt 0
    # Resample and accept work row by row on them.
    proposal = engine.resample(shared, shared.lengths // 3, 14, sampling, seeded(device, 1))
    merged = engine.accept(shared, proposal, torch.arange(len(repeated_prompts)) % 2 == 0)
    assert_decode_equals_teacher_forcing(model, proposal, setting)
    assert_decode_equals_teacher_forcing(model, merged, setting)

    prefills.clear()
    repeated = engine.generate(repeated_prompts, 12, sampling, seeded(device, 0))
    assert prefills == [len(PROMPTS) * k]
    # Same noise draws (one [rows, vocab] per step either way): the same rows.
    assert torch.equal(shared.tokens, repeated.tokens)
    torch.testing.assert_close(shared.base_logprobs, repeated.base_logprobs, atol=tolerance(setting), rtol=0)


def test_noise_period_gives_row_groups_the_same_random_numbers():
    """Common random numbers: with noise_period = P, rows i and i + P sample with the same numbers,
    so the same prompt in two groups gets the same answer when nothing else differs; without it
    they are independent draws."""
    model = fresh_model("cpu")
    engine = GenerationEngine(model, [], pad_token_id=0)
    rows = PROMPTS + PROMPTS
    shared = engine.generate(rows, 12, SAMPLING, seeded("cpu", 3), noise_period=len(PROMPTS)).sequences()
    assert shared[: len(PROMPTS)] == shared[len(PROMPTS):]
    independent = engine.generate(rows, 12, SAMPLING, seeded("cpu", 3)).sequences()
    assert independent[: len(PROMPTS)] != independent[len(PROMPTS):]
    with pytest.raises(ValueError, match="noise_period"):
        engine.generate(rows, 4, SAMPLING, seeded("cpu", 3), noise_period=len(PROMPTS) + 1)
