"""Benchmarks: the article's loop reproduced, this trainer beside it, and the machine's ceilings."""
