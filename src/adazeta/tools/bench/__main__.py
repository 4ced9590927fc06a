"""``python -m adazeta.tools.bench``: the speed benchmark (the package's docstring says what it measures)."""

from adazeta.tools.bench.cli import main

if __name__ == "__main__":
    main()
