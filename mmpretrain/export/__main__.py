import sys

from mmpretrain.export import main

sys.exit(main())
