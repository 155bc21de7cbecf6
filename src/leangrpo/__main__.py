import sys

from leangrpo.cli import main

sys.exit(main())
