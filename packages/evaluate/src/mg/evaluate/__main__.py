import sys

from mg.evaluate.cli import main

sys.exit(main())
