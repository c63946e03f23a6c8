import sys

from flashgen.generator.cli import main

sys.exit(main())
