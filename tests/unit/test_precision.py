"""The one precision rule (gpuscale/data/precision.py): its table, and that the launcher, the ranks,
the tuner and the model loader all take their answer from it, none deciding what `auto` means on
its own."""

from __future__ import annotations

import ast
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import gpuscale
from gpuscale.data import models
from gpuscale.data.precision import AUTO_RULE, PRECISIONS, device_precision, resolved_precision, torch_dtype
from gpuscale.engines import distributed
from gpuscale.engines.batch_search import Trial
from gpuscale.recipes.shared.contract import Recipe, Tuning
from gpuscale.recipes.shared.device_trials import tune_recipe
from gpuscale.recipes.shared.tuning_key import Device
from gpuscale.runs import settings as run_settings
from gpuscale.runs.settings import RunSettings

PACKAGE_ROOT = Path(gpuscale.__file__).parent
CPU, TURING, AMPERE, HOPPER = None, (7, 5), (8, 0), (9, 0)
DEVICES = [CPU, TURING, AMPERE, HOPPER]

# The rule, written out: precision -> {capability: resolved}.
TABLE = {
    "auto": {CPU: "fp32", TURING: "fp16", AMPERE: "bf16", HOPPER: "bf16"},
    "bf16": dict.fromkeys(DEVICES, "bf16"),
    "fp16": dict.fromkeys(DEVICES, "fp16"),
    "fp32": dict.fromkeys(DEVICES, "fp32"),
}
CASES = [(precision, capability, resolved) for precision, row in TABLE.items() for capability, resolved in row.items()]


@pytest.mark.parametrize("precision, capability, expected", CASES)
def test_the_rule_s_table(precision, capability, expected):
    assert resolved_precision(precision, capability) == expected


def test_the_rule_takes_nvml_lists_and_an_empty_capability_as_the_cpu():
    assert resolved_precision("auto", [8, 6]) == "bf16"  # telemetry gives lists
    assert resolved_precision("auto", [7, 0]) == "fp16"
    assert resolved_precision("auto", ()) == "fp32"


def test_an_unknown_precision_is_refused_not_passed_through():
    with pytest.raises(ValueError, match="precision 'fp8'"):
        resolved_precision("fp8", HOPPER)


def test_the_settings_help_says_the_rule_and_the_control_plane_has_the_same_function():
    assert RunSettings.model_fields["precision"].description == AUTO_RULE
    assert run_settings.resolved_precision is resolved_precision
    assert set(PRECISIONS) == set(RunSettings.model_fields["precision"].annotation.__args__)


@pytest.fixture
def fake_card(monkeypatch):
    """Pretend that cuda:N has compute capability `card.capability` (no GPU here: only the
    capability is read, nothing is allocated)."""

    class Card:
        capability = AMPERE

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: Card.capability)
    return Card


@pytest.mark.parametrize("precision, capability, expected", CASES)
def test_the_ranks_and_the_model_loader_answer_as_the_rule(fake_card, precision, capability, expected):
    device = torch.device("cpu") if capability is None else torch.device("cuda", 0)
    fake_card.capability = capability
    want = torch_dtype(expected)
    assert device_precision(precision, device) == expected
    assert distributed.resolve_dtype(precision, device) == want
    assert models.resolve_dtype(precision, device) == want
    assert models.resolve_dtype(precision, str(device)) == want


def test_the_loader_s_long_names_and_its_refusal():
    assert models.resolve_dtype("bfloat16") == torch.bfloat16
    assert models.resolve_dtype("FLOAT16") == torch.float16
    assert models.resolve_dtype(None) is None and models.resolve_dtype(torch.float32) == torch.float32
    with pytest.raises(models.ModelError, match="unknown dtype 'fp8'; known: auto, bf16, fp16, fp32"):
        models.resolve_dtype("fp8")


class Stub(Recipe):
    """A recipe whose trial only records the dtype the tuner gave it."""

    name = "stub"
    summary = "test stub"
    settings_cls = RunSettings
    tuning = Tuning(figure="items_per_s", start=1)
    seen: list = []

    @contextmanager
    def trial_session(self, settings, ctx):
        self.seen.append(ctx.dtype)
        yield lambda size: Trial(size, throughput=float(size), step_seconds=0.01)

    def run(self, settings, ctx, reporter):
        raise NotImplementedError


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_tuner_keys_and_runs_its_trials_at_the_rule_s_precision(precision):
    """On the CPU: the trial runs at the rule's dtype, and the stored key has the name the launch
    screen looks a stored result up by (app/batch_choice: the rule on NVML's capability)."""
    recipe, cpu = Stub(), Device(None, "cpu", None)
    Stub.seen.clear()
    outcome = tune_recipe(recipe, RunSettings(precision=precision, gpus=1), cpu, max_batch=2)
    expected = resolved_precision(precision, cpu.compute_capability)
    assert outcome.key.precision == expected
    assert Stub.seen == [torch_dtype(expected)]


# ---- nothing else decides what `auto` means --------------------------------------------------------


def deciding_places(path: Path) -> list[str]:
    """Where a module reads a card's capability itself, or compares a precision/dtype to "auto"."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("get_device_capability", "is_bf16_supported"):
            found.append(f"{path.name}:{node.lineno} {node.attr}")
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            texts = [ast.unparse(operand).lower() for operand in operands]
            if any(isinstance(o, ast.Constant) and o.value == "auto" for o in operands) and \
                    any("precision" in t or "dtype" in t or t in ("name", "mixed") for t in texts):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_the_scan_sees_a_second_rule(tmp_path):
    path = tmp_path / "other.py"
    path.write_text("import torch\n"
                    "def dtype_for(settings, device):\n"
                    "    if settings.precision == 'auto':\n"
                    "        return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else None\n")
    assert len(deciding_places(path)) == 2


def test_no_module_but_the_rule_decides_what_auto_means():
    rule = PACKAGE_ROOT / "data" / "precision.py"
    assert deciding_places(rule)  # the scan does see the rule itself
    others = [place for path in sorted(PACKAGE_ROOT.rglob("*.py")) if path != rule
              for place in deciding_places(path)]
    assert others == []
