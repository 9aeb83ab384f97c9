import sys

from mmpretrain.train.cli import main

sys.exit(main())
