"""`python -m scheduler_service.frontends FD`: a frontend process, started by the engine core
(frontends/hub.py) with its end of the socketpair as FD."""

import asyncio
import sys

from scheduler_service import logs
from scheduler_service.frontends.process import run

if __name__ == "__main__":
    logs.configure("info")
    sys.exit(asyncio.run(run(int(sys.argv[1]))))
