"""``python -m grpo_fast ...`` is ``grpo-fast ...`` (and ``torchrun -m grpo_fast ...``)."""

import sys

from grpo_fast.cli import main

if __name__ == "__main__":
    sys.exit(main())
