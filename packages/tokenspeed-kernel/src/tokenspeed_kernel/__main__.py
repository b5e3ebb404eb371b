"""``python -m tokenspeed_kernel`` = the ``tokenspeed-kernel`` command."""

import sys

from tokenspeed_kernel.cli import main

sys.exit(main())
