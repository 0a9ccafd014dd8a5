"""Conformance kit: check that a server speaks planserve's protocols.

  planserve conformance --engine HOST:PORT   the engine contract (EngineService, engine.proto)
  planserve conformance --api HOST:PORT      the public API (GenerationService, generate.proto)

Each suite is an ordered list of small named checks (engine_suite.CHECKS, api_suite.CHECKS); the
report has one PASS/FAIL/SKIP line per check with the reason, and the command exits 1 when any
check failed. `run_suite` is the same from Python (the tests use it).
"""

from __future__ import annotations

from tools.conformance.command import add_parser, run_command, run_suite

__all__ = ["add_parser", "run_command", "run_suite"]
