"""check_int / check_whole / check_real: one-line SimtreeErrors naming the argument, bounds inclusive."""
import numpy as np
import pytest

from simtree.errors import SimtreeError, check_int, check_real, check_whole


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


@pytest.mark.parametrize("bad, got", [(True, "True"), (float("nan"), "nan"), (float("inf"), "inf"), ("3", "'3'"),
                                      (None, "None"), (-0.5, "-0.5"), (np.float64(-2.0), "-2.0")])
def test_check_real_refuses_non_finite_non_numbers_and_values_below_low(bad, got):
    with pytest.raises(SimtreeError) as err:
        check_real(bad, "--max-seconds", 0, "number of seconds")
    assert str(err.value) == f"--max-seconds must be a finite number of seconds >= 0, got {got}"


def test_check_real_low_is_inclusive_and_gives_a_float():
    assert check_real(0, "x", 0) == 0.0 and type(check_real(np.int64(3), "x", 1)) is float
    assert check_real(1.25, "x", 1) == 1.25
    with pytest.raises(SimtreeError, match=r"^x must be a finite number >= 1, got 0.5$"):
        check_real(0.5, "x", 1)
