"""``python -m train STAGE``: see `train.cli`."""

import sys

from train.cli import main

sys.exit(main())
