"""``python -m unimae.cli``: the same as the ``unimae`` command (used by torchrun / accelerate launch)."""

import sys

from unimae.cli import main

if __name__ == "__main__":
    sys.exit(main())
