import sys

from mmpretrain.eval.cli import main

sys.exit(main())
