"""The answer checker every recipe shares, on the cases that trip checkers up."""

import pytest

from gpuscale.data.answers import extract_answer, is_correct, to_number


@pytest.mark.parametrize(
    "text, mode, expected",
    [
        # strict: GSM8K's own "#### N", the last such line, nothing after the number on it
        ("She has 3 + 4 = 7 apples.\n#### 7", "strict", "7"),
        ("#### 1,234", "strict", "1234"),
        ("#### -5", "strict", "-5"),
        ("#### $18.50.", "strict", "18.50"),
        ("#### -$3", "strict", "-3"),
        ("####42", "strict", "42"),
        ("#### 42  \r\nThat is all.", "strict", "42"),  # lines after the answer's are not its line
        ("#### 72\n\nQuestion: next one?\n#### 5", "strict", "5"),
        ("#### 12\n#### 13", "strict", "13"),
        ("#### 9 - 1 = 15.", "strict", None),
        ("#### 5 apples and 7 pears", "strict", None),
        ("#### 12\n#### 13 or so", "strict", None),  # the final line decides, not an earlier good one
        ("#### 3.", "strict", "3"),
        ("#### 3.5.1", "strict", None),
        ("#### 7 #### 8", "strict", "8"),
        ("#### ", "strict", None),
        ("The answer is 7.", "strict", None),
        ("#### seven", "strict", None),
        # flexible: the last number-like match, decorations removed
        ("So she pays $1,234.50.", "flexible", "1234.50"),
        ("It drops 12 degrees to -7.", "flexible", "-7"),
        ("3 apples and 4 pears make 7 fruits...", "flexible", "7"),  # "..." is not a number
        ("5-3", "flexible", "-3"),  # lm-eval's pattern reads the minus as a sign; kept as it does
        ("no numbers here", "flexible", None),
        ("0.5", "flexible", "0.5"),
        # boxed: the last box, nested braces balanced
        ("First \\boxed{3}, then \\boxed{4}.", "boxed", "4"),
        ("\\boxed{\\frac{1}{2}}", "boxed", "\\frac{1}{2}"),
        ("\\boxed{x = 5}", "boxed", "5"),
        ("\\boxed{\\$1,000}", "boxed", "1000"),
        ("\\boxed{12", "boxed", None),  # cut off before the box closed
        # auto: strict where there is a `####`, else boxed, else flexible
        ("#### 10\nand later \\boxed{11} and 12", "auto", "10"),
        ("#### 10 and later \\boxed{11} and 12", "auto", None),  # a malformed final line is no answer
        ("\\boxed{11} and then 12", "auto", "11"),
        ("it is 12.", "auto", "12"),
        ("", "auto", None),
    ],
)
def test_extract_answer(text, mode, expected):
    assert extract_answer(text, mode) == expected


@pytest.mark.parametrize(
    "text, value",
    [
        ("1,234.5", 1234.5), ("$-3", -3.0), ("-$3", -3.0), ("12.", 12.0), ("\\frac{3}{4}", 0.75),
        ("\\dfrac{1}{8}", 0.125), ("-3/4", -0.75), ("50%", 50.0), (7, 7.0), ("abc", None), ("", None),
        ("nan", None), ("1/0", None), (None, None),
    ],
)
def test_to_number(text, value):
    assert to_number(text) == value


@pytest.mark.parametrize(
    "completion, gold, right",
    [
        ("#### 1,234", "1234", True),
        ("#### 3.0", "3", True),
        ("#### 0.30000000000000004", "0.3", True),  # float noise is within the tolerance
        ("#### 0.31", "0.3", False),
        ("#### 15", "1.5", False),
        ("#### -7", "7", False),
        ("The total is $72.", "72", True),
        ("\\boxed{\\frac{1}{2}}", "0.5", True),
        ("Steps...\n#### 18", "Janet sells 16 - 3 - 4 = 9 eggs.\n#### 18", True),  # gold as a whole GSM8K answer
        ("#### 72\n#### 5", "5", True),  # the last answer line is the answer
        ("#### 9 - 1 = 15.", "9", False),
        ("#### 5 apples and 7 pears", "5", False),
        ("no answer", "5", False),
    ],
)
def test_is_correct(completion, gold, right):
    assert is_correct(completion, gold) is right


def test_tolerance_is_a_parameter():
    assert not is_correct("#### 100", "101")
    assert is_correct("#### 100", "101", tol=0.05)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown extraction mode"):
        extract_answer("#### 1", mode="loose")
