import sys

from fivecut.cli import main

sys.exit(main())
