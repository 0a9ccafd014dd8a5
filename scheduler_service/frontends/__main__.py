"""`python -m scheduler_service.frontends FD LEVEL`: a frontend process, started by the engine
core (frontends/hub.py) with its end of the socketpair as FD and the core's log level."""

import asyncio
import sys

from scheduler_service import logs
from scheduler_service.frontends.process import run

if __name__ == "__main__":
    logs.configure(sys.argv[2] if len(sys.argv) > 2 else "info")
    sys.exit(asyncio.run(run(int(sys.argv[1]))))
