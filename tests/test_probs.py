"""simtree.probs.check_prob_rows: the one check of probability tables (rows sum <= 1)."""
import numpy as np
import pytest

from simtree.errors import SimtreeError
from simtree.probs import check_prob_rows


@pytest.mark.parametrize("array, axis, message", [
    ([[0.5, np.nan], [0.1, 0.2]], -1, "t: entry [0, 1] is nan (must be finite)"),
    ([[0.5, 0.1], [np.inf, 0.2]], -1, "t: entry [1, 0] is inf (must be finite)"),
    ([[0.5, 0.1], [0.2, -0.25]], -1, "t: entry [1, 1] is -0.25 (must be >= 0)"),
    ([[0.5, 0.1], [0.7, 0.6]], -1, "t: row 1 sums to 1.3 (must sum to <= 1)"),
    ([[0.5, 0.1], [0.7, 0.6]], 0, "t: row 0 sums to 1.2 (must sum to <= 1)"),
    ([[[0.1, 0.2]], [[0.9, 0.2]]], 2, "t: row [1, 0] sums to 1.1 (must sum to <= 1)"),
    ([0.6, 0.5], -1, "t: sums to 1.1 (must sum to <= 1)"),
    ([-1.0], -1, "t: entry 0 is -1 (must be >= 0)"),
])
def test_check_prob_rows_names_the_offending_entry_or_row(array, axis, message):
    with pytest.raises(SimtreeError) as info:
        check_prob_rows(array, "t", axis=axis)
    assert str(info.value) == message
    assert "\n" not in str(info.value)


def test_check_prob_rows_accepts_valid_tables_and_returns_float64():
    table = [[0.5, 0.5], [0.0, 0.0], [0.3, 0.7 + 5e-7]]  # last row within the 1e-6 tolerance
    out = check_prob_rows(table, "t")
    assert out.dtype == np.float64 and np.array_equal(out, np.asarray(table))
    assert check_prob_rows(np.ones((3, 1)), "t", axis=1).shape == (3, 1)


def test_check_prob_rows_rejects_non_numbers_in_one_line():
    with pytest.raises(SimtreeError, match=r"^t: not an array of numbers$"):
        check_prob_rows([["a", 0.1]], "t")
