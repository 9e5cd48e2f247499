"""The embedded default: SwiftKV end to end on the Python standard library's source, nothing downloaded.

    python demo.py [--quick] [--out artifacts/demo]

The logic lives in swiftkv_jax.demo.
"""

import sys

from swiftkv_jax.demo import main

if __name__ == "__main__":
    sys.exit(main())
