"""The benchmarks (`trainer bench`, BENCHMARKS.md): run from a clone of the repository, not part of
the installed package. bench/results holds the runs behind the figures the docs show."""
