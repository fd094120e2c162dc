"""``python -m elastor_mcore.cli``: the ``elastor`` command without the console script."""

import sys

from elastor_mcore.cli import main

sys.exit(main())
