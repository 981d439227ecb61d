import sys

from draftctl.cli import main

sys.exit(main())
