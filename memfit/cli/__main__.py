"""`python -m memfit.cli`: the `memfit` console command, as the tests and benches start it."""

from memfit.cli import main

main()
