"""Draft trees: the data type, its builders and greedy acceptance of a verified tree."""
