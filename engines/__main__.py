"""`python -m engines ...`: the engine layer's command line (engines.tools.main), kept under this short name
because build children are started as `python -m engines build-worker`."""

import sys

from engines.tools.main import main

if __name__ == "__main__":
    sys.exit(main())
