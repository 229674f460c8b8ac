import csv
import math

import pytest

from marble_trl.evaluation.scores import composite_zscores, markdown_table, mean_sem, write_csv


def test_mean_sem_hand_computed():
    mean, sem, n = mean_sem([1.0, 2.0, None, 3.0, 6.0])
    assert n == 4 and mean == pytest.approx(3.0)
    # sample std of (1, 2, 3, 6) = sqrt(14 / 3)
    assert sem == pytest.approx(math.sqrt(14 / 3) / 2)
    assert mean_sem([None])[2] == 0 and math.isnan(mean_sem([])[0])
    assert math.isnan(mean_sem([5.0])[1])


def test_composite_matches_hand_computation():
    table = {
        "base": {"ocr": 0.5, "pick": 20.0, "const": 1.0},
        "sum": {"ocr": 0.7, "pick": 21.0, "const": 1.0},
        "marble": {"ocr": 0.9, "pick": 21.5, "const": 1.0},
    }
    # ocr: mean 0.7, population std sqrt(0.08/3); pick: mean 62.5/3, std of (20, 21, 21.5)
    s_ocr = math.sqrt(((0.2) ** 2 * 2) / 3)
    m_pick = 62.5 / 3
    s_pick = math.sqrt(((20 - m_pick) ** 2 + (21 - m_pick) ** 2 + (21.5 - m_pick) ** 2) / 3)
    expected = {
        name: ((row["ocr"] - 0.7) / s_ocr + (row["pick"] - m_pick) / s_pick + 0.0) / 3 for name, row in table.items()
    }
    got = composite_zscores(table)
    for name in table:
        assert got[name] == pytest.approx(expected[name])
    assert sum(got.values()) == pytest.approx(0.0, abs=1e-12)
    assert got["marble"] > got["sum"] > got["base"]


def test_composite_lower_is_better_and_errors():
    table = {"a": {"loss": 1.0}, "b": {"loss": 2.0}}
    got = composite_zscores(table, lower_is_better=["loss"])
    assert got["a"] == pytest.approx(1.0) and got["b"] == pytest.approx(-1.0)
    with pytest.raises(KeyError, match="'b'.*'x'"):
        composite_zscores({"a": {"x": 1.0}, "b": {"y": 1.0}}, columns=["x"])
    with pytest.raises(ValueError, match="non-finite.*'loss'"):
        composite_zscores({"a": {"loss": float("nan")}, "b": {"loss": 1.0}})


def test_tables(tmp_path):
    rows = [{"model": "a", "x": 1.23456}, {"model": "b", "x": float("nan")}]
    md = markdown_table(rows, ["model", "x"], digits=2)
    assert md.splitlines()[2] == "| a | 1.23 |" and "| b | nan |" in md
    write_csv(tmp_path / "t.csv", rows, ["model", "x"])
    with open(tmp_path / "t.csv") as f:
        assert list(csv.DictReader(f))[0] == {"model": "a", "x": "1.23456"}
