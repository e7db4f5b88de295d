"""The test suite (a package, so that `tests.helpers` imports the same way
from tests and from benchmarks run as `python -m benchmarks.…` at the repo root)."""
