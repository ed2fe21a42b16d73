"""RFT's filter on hand-made samples with known answers: only what the strict checker marks correct
is kept, duplicates are dropped (by normalized text, or by equation list), at most k per question."""

from __future__ import annotations

from gpuscale.recipes.rft.filtering import equation_list, kept_answers, yield_by_domain

GOLD = "12 + 30 = 42.\n#### 42"
SAMPLES = [
    "12 + 30 = 42.\n#### 42",            # correct
    "12 + 30 = 42.\n####  42",           # the same text once spacing is normalized
    "12 + 30 = 41.\n#### 41",            # wrong answer
    "12 + 30 = 42. The answer is 42.",   # no `#### N`: a lenient checker takes the last number
    "We add them: 12+30=42\n#### 42",    # correct, other words, same equation
    "30 + 12 = 42.\n#### 42.0",          # correct, another equation, the number written 42.0
    "We add them: 12+30=42\n#### 42",    # an exact repeat
]


def test_only_strictly_correct_distinct_answers_are_kept():
    kept = kept_answers(SAMPLES, GOLD)
    assert kept == [(SAMPLES[0], "sample"), (SAMPLES[4], "sample"), (SAMPLES[5], "sample")]


def test_case_and_white_space_do_not_make_an_answer_distinct():
    kept = kept_answers(["12 + 30 = 42.\n#### 42", "12  +  30 = 42.  \n####   42", "12 + 30 = 42.\n\n#### 42"], GOLD)
    assert len(kept) == 1


def test_equation_lists_count_answers_with_the_same_equations_once():
    kept = kept_answers(SAMPLES, GOLD, dedupe="equations")
    # SAMPLES[4] uses 12+30=42 like SAMPLES[0]; SAMPLES[5] uses 30+12=42.
    assert kept == [(SAMPLES[0], "sample"), (SAMPLES[5], "sample")]


def test_at_most_keep_per_question_answers_in_sampling_order():
    assert [c for c, _ in kept_answers(SAMPLES, GOLD, keep=2)] == [SAMPLES[0], SAMPLES[4]]
    assert len(kept_answers(SAMPLES, GOLD, keep=0)) == 3  # 0: all distinct correct ones


def test_the_gold_answer_comes_first_and_its_duplicates_are_dropped():
    kept = kept_answers(SAMPLES, GOLD, keep=1, include_gold=True)
    assert kept == [(GOLD, "gold"), (SAMPLES[4], "sample")]


def test_no_correct_sample_keeps_nothing_but_the_gold_answer_if_asked():
    wrong = ["#### 41", "12 + 30 = 42"]
    assert kept_answers(wrong, GOLD) == []
    assert kept_answers(wrong, GOLD, include_gold=True) == [(GOLD, "gold")]


def test_equation_lists_read_gsm8k_annotations_and_written_equations():
    assert equation_list("She sold 48/2 = <<48/2=24>>24 clips, then <<48+24=72>>72.\n#### 72") == ("48/2=24",
                                                                                                   "48+24=72")
    assert equation_list("In order: 8, 20, 36.\n36 - 8 = 28.\n(2 * 3) + 1 = 7\n#### 28") == ("36-8=28", "(2*3)+1=7")
    assert equation_list("Counting fig: 1, 2, 3.\n#### 3") == ()


def test_yield_is_the_share_of_questions_with_a_correct_sample_per_domain():
    questions = [{"domain": "arithmetic", "correct_samples": 0}, {"domain": "arithmetic", "correct_samples": 3},
                 {"domain": "counting", "correct_samples": 1}, {"domain": "counting", "correct_samples": 2}]
    assert yield_by_domain(questions) == {"yield": 0.75, "yield_arithmetic": 0.5, "yield_counting": 1.0}
