"""python -m benchmarks.replay_split"""

import sys

from benchmarks.replay_split.cli import main

sys.exit(main())
