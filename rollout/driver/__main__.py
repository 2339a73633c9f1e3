"""`python -m rollout.driver --config DRIVER.yaml`: the rollout driver as a process (rollout/driver/driver.py)."""

import sys

from rollout.driver.driver import main

sys.exit(main())
