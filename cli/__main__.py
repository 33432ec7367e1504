import sys

from maingrad.cli.main import main

sys.exit(main())
