"""check_int / check_whole: one-line SimtreeErrors naming the argument, bounds inclusive."""
import numpy as np
import pytest

from simtree.errors import SimtreeError, check_int, check_whole


@pytest.mark.parametrize("bad, got", [(True, "True"), (2.5, "2.5"), (2.0, "2.0"), (float("nan"), "nan"),
                                      ("3", "'3'"), (None, "None"), (0, "0"), (9, "9")])
def test_check_int_refuses_non_integers_and_values_out_of_range(bad, got):
    with pytest.raises(SimtreeError) as err:
        check_int(bad, "--things", 1, 8)
    assert str(err.value) == f"--things must be an integer in [1, 8], got {got}"


def test_check_int_bounds_are_inclusive_and_high_is_optional():
    assert check_int(1, "x", 1, 8) == 1 and check_int(8, "x", 1, 8) == 8
    assert type(check_int(np.int64(5), "x", 0, 5)) is int
    assert check_int(10 ** 12, "x") == 10 ** 12
    with pytest.raises(SimtreeError, match=r"^x must be an integer >= 0, got -1$"):
        check_int(-1, "x", 0)


@pytest.mark.parametrize("bad, got", [(True, "True"), (2.5, "2.5"), (float("nan"), "nan"), (float("inf"), "inf"),
                                      (0, "0"), (9.0, "9.0")])
def test_check_whole_refuses_fractions_and_values_out_of_range(bad, got):
    with pytest.raises(SimtreeError) as err:
        check_whole(bad, "length", 1, 8)
    assert str(err.value) == f"length must be an integer in [1, 8], got {got}"


def test_check_whole_takes_integral_floats():
    assert check_whole(8.0, "length", 1, 8) == 8 and type(check_whole(np.float64(3.0), "length", 1)) is int
