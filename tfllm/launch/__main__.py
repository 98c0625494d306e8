"""`python -m tfllm.launch [--prog NAME] OPTIONS -- COMMAND`: see `tfllm.launch.main`."""

import sys

from tfllm.launch.main import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    prog = "tfllm launch"
    if argv[:1] == ["--prog"] and len(argv) > 1:  # the name the wrapper script goes by
        prog, argv = argv[1], argv[2:]
    sys.exit(main(argv, prog))
