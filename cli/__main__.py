"""``python -m draftsmith.cli SUBCOMMAND ...``: the ``draftsmith`` command (:func:`draftsmith.cli.main`)."""

import sys

from . import main

sys.exit(main())
