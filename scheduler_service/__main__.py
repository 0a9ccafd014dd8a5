import sys

from scheduler_service.cli import main

sys.exit(main())
