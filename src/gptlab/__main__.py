import sys

from gptlab.cli import main

sys.exit(main())
