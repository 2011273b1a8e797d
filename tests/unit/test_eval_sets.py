"""Own eval sets: scoring an answer, the means and standard errors, the side-by-side table, the one-line errors."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from memfit.errors import ConfigError
from memfit.evaluation.judge import side_by_side
from memfit.evaluation.sets import SetResult, extracted, load_set, score_answer

pytestmark = pytest.mark.unit


def test_an_answer_is_scored_after_the_extractor():
    assert extracted("The answer is 42.", r"(-?\d+)") == "42" and extracted("no number", r"(-?\d+)") == ""
    assert extracted("  Paris \n", None) == "Paris"
    got = score_answer("The answer is 42.", "42", ["exact_match", "contains", "rouge_l"], r"(-?\d+)")
    assert got == {"exact_match": 1.0, "contains": 1.0, "rouge_l": 1.0}
    raw = score_answer("the big red fox", "red fox", ["exact_match", "contains", "rouge_l"], None)
    assert raw["exact_match"] == 0.0 and raw["contains"] == 1.0
    assert raw["rouge_l"] == pytest.approx(2 * (2 / 4) * 1.0 / (2 / 4 + 1.0))  # LCS 2: P 2/4, R 2/2
    assert score_answer("PARIS", "paris", ["exact_match"], None) == {"exact_match": 1.0}  # case-insensitive


def test_means_and_standard_errors_per_metric():
    rows = [{"prompt": "p", "reference": "r", "answer": "a", "score/contains": v} for v in (1.0, 0.0, 1.0, 1.0)]
    m = SetResult("qa", rows).metrics()
    assert m["eval/qa/contains"] == 0.75
    assert m["eval/qa/contains_stderr"] == pytest.approx(math.sqrt(0.25 / 4))  # sample variance 0.25, n 4


def test_the_side_by_side_table_pairs_examples():
    champ = SetResult("qa", [{"prompt": "p1", "reference": "r1", "answer": "old", "score/contains": 0.0}])
    chall = SetResult("qa", [{"prompt": "p1", "reference": "r1", "answer": "new r1", "score/contains": 1.0}])
    assert side_by_side(chall, champ) == {"prompt": ["p1"], "reference": ["r1"], "champion": ["old"],
                                          "challenger": ["new r1"], "champion_contains": [0.0],
                                          "challenger_contains": [1.0]}


def test_bad_set_files_are_one_line_naming_file_and_record(tmp_path):
    bad = tmp_path / "set.jsonl"
    cases = [('{"prompt": "x"}\n', "line 1 has no reference"),
             ('{"reference": "y"}\n', "line 1 has neither prompt"),
             ('{"prompt": "x", "reference": "y"}\nnot json\n', "line 2 is not JSON"),
             ("\n", "holds no records")]
    for text, needle in cases:
        bad.write_text(text)
        with pytest.raises(ConfigError, match=needle) as err:
            load_set(SimpleNamespace(name="mine", path=str(bad)))
        assert str(err.value).startswith("eval.sets['mine']: ") and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="does not exist"):
        load_set(SimpleNamespace(name="mine", path=str(tmp_path / "nope.jsonl")))
