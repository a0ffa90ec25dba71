"""One exception type for bad input: the CLI prints its message as one line and exits 2; and
the warning a cost model gives when it is queried outside its measured range."""
import contextlib
import math
import numbers
import warnings


class SimtreeError(ValueError):
    """Bad input that the user can fix (malformed table, invalid tree, unknown config...).

    The message is one line that names the problem; the CLI shows it without a traceback.
    """


SEED_MAX = 2 ** 63 - 1   # numpy's generators take seeds in [0, 2**63)


def _out_of_range(value, low: int, high: int | None) -> bool:
    return value < low or (high is not None and value > high)


def _bad(value, what: str, low: int, high: int | None) -> SimtreeError:
    bound = f">= {low}" if high is None else f"in [{low}, {high}]"
    return SimtreeError(f"{what} must be an integer {bound}, got {value!r}")


def check_int(value, what: str, low: int = 1, high: int | None = None) -> int:
    """``value`` as an int in [low, high] (no upper bound where ``high`` is None; a Python or
    numpy integer, not a bool or a float); a one-line SimtreeError naming ``what`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or _out_of_range(value, low, high):
        raise _bad(value, what, low, high)
    return int(value)


def check_whole(value, what: str, low: int, high: int | None = None) -> int:
    """``value`` (an integer, or a float with an integral value as JSON gives it) as an int in
    [low, high] (no upper bound where ``high`` is None); a one-line SimtreeError naming ``what``
    otherwise (NaN and inf included)."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value != int(value) or _out_of_range(value, low, high)):
        raise _bad(value, what, low, high)
    return int(value)


def check_real(value, what: str, low: int, kind: str = "number") -> float:
    """``value`` (a real number, not a bool) as a float, finite and >= ``low``; a one-line
    SimtreeError ``<what> must be a finite <kind> >= <low>, got <value>`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < low:
        shown = value.item() if type(value).__module__ == "numpy" else value   # 1.5, not np.float64(1.5)
        raise SimtreeError(f"{what} must be a finite {kind} >= {low}, got {shown!r}")
    return float(value)


class TreeError(SimtreeError):
    """An invalid draft tree (parent array, tokens, scores)."""


class NotBuiltError(SimtreeError):
    """A command or feature that this version of simtree does not provide yet."""


class ExtrapolationWarning(RuntimeWarning):
    """A cost model queried outside its measured range (it extrapolates, non-decreasing): once
    per model and axis.  The planner silences it and reports the ranges in its notes instead."""


@contextlib.contextmanager
def captured_warnings():
    """The warnings raised inside (every one, not once per code location), as a list: what the
    CLI commands print as notes, and what a live run sorts into notes and warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
