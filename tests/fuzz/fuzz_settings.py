"""What every fuzz test here shares: how many examples (PLANSERVE_FUZZ_EXAMPLES, 150 by default),
drawn the same way each run, and how long a call may take before it counts as a hang."""
from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

CALL_TIMEOUT_S = 30  # a call still open after this is a hang
FUZZ = settings(max_examples=int(os.environ.get("PLANSERVE_FUZZ_EXAMPLES", "150")),
                deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
