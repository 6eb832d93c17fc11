"""``python -m kvtier``: the same as the ``kvtier`` command."""

import sys

from kvtier.cli import main

if __name__ == "__main__":
    sys.exit(main())
