"""`python -m splash.cli ...`: the same as the `splash` command."""

import sys

from splash.cli.main import main

sys.exit(main())
