import sys

from prime_kernels_core.cli import main

sys.exit(main())
