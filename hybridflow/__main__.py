"""``python -m hybridflow ...`` runs the ``hybridflow`` command line."""

import sys

from hybridflow.cli import main

sys.exit(main())
