"""python -m hpctrain COMMAND ...: the `hpctrain` command without its script (command.py).

    python -m hpctrain train --steps 200
    python -m hpctrain --help
"""
import sys

from .command import main

if __name__ == "__main__":
    sys.exit(main())
