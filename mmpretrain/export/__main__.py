import sys

from mmpretrain.export.cli import main

sys.exit(main())
