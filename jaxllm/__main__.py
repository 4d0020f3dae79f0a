"""``python -m jaxllm``: the ``jaxllm`` command (`jaxllm.cli`)."""

import sys

from jaxllm.cli import main

if __name__ == "__main__":
    sys.exit(main())
