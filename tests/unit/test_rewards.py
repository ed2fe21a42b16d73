"""Rewards: correctness and format of one completion, routed by domain, called as TRL calls them."""

import math

import pytest

from gpuscale.data.rewards import (
    DomainReward,
    RewardRouter,
    completion_text,
    correctness,
    format_score,
    parse_reward_weights,
)

GOLD = "3 + 4 = 7.\n#### 7"


@pytest.mark.parametrize("completion, expected", [
    ("3 + 4 = 7.\n#### 7", 1.0),
    ("#### 7.0", 1.0),            # compared as numbers
    ("#### 8", 0.0),
    ("The answer is 7.", 0.0),    # strict: no `#### N`, no credit
    ("#### 7\n#### 9", 0.0),      # the last `#### N` line is the answer
    ("#### 7 apples", 0.0),       # words after the number: no answer
    ("#### 9 - 2 = 7", 0.0),
    ("", 0.0),
])
def test_correctness_is_strict_by_default(completion, expected):
    assert correctness(completion, GOLD) == expected


def test_correctness_other_modes_and_gold_forms():
    assert correctness("The answer is 7.", GOLD, mode="flexible") == 1.0
    assert correctness("so \\boxed{7}", GOLD, mode="boxed") == 1.0
    assert correctness("#### 1,500", "1500") == 1.0  # a bare gold value, commas in the completion
    assert correctness("#### 1,500", "#### 1,500") == 1.0


@pytest.mark.parametrize("completion, expected", [
    ("3 + 4 = 7.\n#### 7", 1.0),
    ("3 + 4 = 7.\n#### 7\n", 1.0),
    ("#### -12", 1.0),
    ("#### 1,500", 1.0),
    ("#### 7 apples", 0.0),        # words on the answer line: no answer at all
    ("#### 7\nI hope this helps", 0.5),  # text after the answer
    ("#### 7\n#### 7", 0.5),       # two answers
    ("3 + 4 = 7", 0.0),
    ("####", 0.0),
])
def test_format_rewards_a_clean_final_line(completion, expected):
    assert format_score(completion) == expected


def test_completion_text_reads_strings_and_chat_messages():
    assert completion_text("#### 7") == "#### 7"
    assert completion_text([{"role": "assistant", "content": "#### 7"}]) == "#### 7"
    content = [{"type": "text", "text": "4 + 3"}, {"type": "text", "text": "\n#### 7"}]
    parts = [{"role": "user", "content": "q"}, {"role": "assistant", "content": content}]
    assert completion_text(parts) == "4 + 3\n#### 7"


# TRL passes every column as a list, plus keywords these functions ignore.
TRL_EXTRAS = {"trainer_state": None, "log_extra": print, "log_metric": print}
COMPLETIONS = ["#### 7", "#### 7\nI hope this helps", "#### 2", "no answer"]
COLUMNS = {"answer": ["#### 7", "#### 7", "#### 3", "#### 1"], "domain": ["math", "logic", "math", "logic"]}


def test_a_domain_reward_scores_only_its_domain():
    reward = DomainReward("correctness", "math")
    assert reward.__name__ == "correctness_math"
    values = reward(["p"] * 4, COMPLETIONS, completion_ids=[[1]] * 4, **COLUMNS, **TRL_EXTRAS)
    assert values == [1.0, None, 0.0, None]
    chat = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    assert DomainReward("format", "logic")(["p"] * 4, chat, **COLUMNS) == [None, 0.5, None, 0.0]


def test_the_router_weighs_each_domains_rewards():
    router = RewardRouter({"format": 0.5}, per_domain={"logic": {"correctness": 2.0, "format": 0.0}})
    assert router.weights_for("math") == {"correctness": 1.0, "format": 0.5}
    assert router.weights_for("logic") == {"correctness": 2.0, "format": 0.0}
    rows = [{"completion": c, "answer": a, "domain": d} for c, a, d in zip(COMPLETIONS, *COLUMNS.values())]
    scored = router.score_rows(rows)
    assert [row["reward"] for row in scored] == [1.5, 2.0, 0.5, 0.0]
    assert [row["format"] for row in scored] == [1.0, 0.5, 1.0, 0.0]  # reported even at weight 0
    assert router(["p"] * 4, COMPLETIONS, **COLUMNS, **TRL_EXTRAS) == [1.5, 2.0, 0.5, 0.0]


def test_reward_funcs_and_weights_line_up():
    router = RewardRouter({"format": 0.25}, per_domain={"logic": {"format": 1.0}})
    funcs = router.reward_funcs(["math", "logic"])
    assert [f.__name__ for f in funcs] == ["correctness_math", "format_math", "correctness_logic", "format_logic"]
    assert router.reward_weights(["math", "logic"]) == [1.0, 0.25, 1.0, 1.0]


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="unknown reward 'style'; known rewards: correctness, format"):
        RewardRouter({"style": 1.0})
    with pytest.raises(ValueError, match="unknown answer mode"):
        RewardRouter(mode="loose")


def test_parse_reward_weights():
    weights, per_domain = parse_reward_weights("correctness=1, format=0.1,counting.format=0.5,gsm8k.v2.correctness=2")
    assert weights == {"correctness": 1.0, "format": 0.1}
    assert per_domain == {"counting": {"format": 0.5}, "gsm8k.v2": {"correctness": 2.0}}
    for bad, reason in (("format", "expected reward=weight"), ("format=much", "not a number"),
                        ("style=1", "unknown reward"), (".format=1", "expected reward=weight")):
        with pytest.raises(ValueError, match=reason):
            parse_reward_weights(bad)


def test_trl_grpo_trainer_calls_them_as_expected(tmp_path):
    """A real GRPOTrainer on the embedded model: TRL names each function by domain, turns None into
    NaN, and its weighted sum over a row equals the router's total for that row."""
    torch = pytest.importorskip("torch")
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from gpuscale.data.models import load_model

    model, tokenizer = load_model("tiny-math")
    router = RewardRouter({"format": 0.5})
    domains = ["math", "logic"]
    rows = [{"prompt": f"q{i}", "answer": a, "domain": d} for i, (a, d) in enumerate(zip(*COLUMNS.values()))]
    config = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[],
                            per_device_train_batch_size=4, num_generations=2, max_completion_length=4,
                            activation_checkpointing=False, reward_weights=router.reward_weights(domains))
    trainer = trl.GRPOTrainer(model=model, processing_class=tokenizer, args=config,
                              reward_funcs=router.reward_funcs(domains), train_dataset=Dataset.from_list(rows))
    assert trainer.reward_func_names == ["correctness_math", "format_math", "correctness_logic", "format_logic"]
    per_func = trainer._calculate_rewards(rows, [r["prompt"] for r in rows], COMPLETIONS, [[1]] * 4)
    assert per_func.shape == (4, 4)
    assert torch.isnan(per_func[0, 2:]).all() and torch.isnan(per_func[1, :2]).all()
    totals = (per_func * trainer.reward_weights.unsqueeze(0)).nansum(dim=1).tolist()
    expected = [row["reward"] for row in router.score_rows(
        {"completion": c, **r} for c, r in zip(COMPLETIONS, rows))]
    assert all(math.isclose(a, b) for a, b in zip(totals, expected)) and expected == [1.5, 1.25, 0.5, 0.0]
