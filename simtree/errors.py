"""One exception type for bad input: the CLI prints its message as one line and exits 2."""


class SimtreeError(ValueError):
    """Bad input that the user can fix (malformed table, invalid tree, unknown config...).

    The message is one line that names the problem; the CLI shows it without a traceback.
    """


class TreeError(SimtreeError):
    """An invalid draft tree (parent array, tokens, scores)."""


class NotBuiltError(SimtreeError):
    """A command or feature that this version of simtree does not provide yet."""
