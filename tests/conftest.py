import sys
from pathlib import Path

# tests/readme_examples.py is importable from the tests
sys.path.insert(0, str(Path(__file__).resolve().parent))

try:  # one hypothesis profile for the whole suite: CI is a loaded 2-core machine
    from hypothesis import HealthCheck, settings
except ImportError:  # pragma: no cover - hypothesis is in the test extra
    pass
else:
    # No per-example deadline and no too_slow health check: both measure wall-clock time, which a
    # busy machine stretches at random. derandomize: the same examples on every run. A test's own
    # @settings overrides only the fields it names.
    settings.register_profile("zeroplan-ci", deadline=None, derandomize=True, database=None,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("zeroplan-ci")
