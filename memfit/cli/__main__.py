"""`python -m memfit.cli`: the `memfit` console command, as the tests and benches start it."""

from memfit.cli import main

if __name__ == "__main__":  # only as `python -m`: importing this module starts nothing
    main()
