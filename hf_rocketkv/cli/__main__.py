"""``python -m hf_rocketkv.cli ...`` runs the ``hf-rocketkv`` command."""

import sys

from .main import main

sys.exit(main())
