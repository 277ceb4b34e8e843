import sys

from pipeline.stages.cli import main

if __name__ == "__main__":
    sys.exit(main())
