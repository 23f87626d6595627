"""``python -m hzpsim.validation [options]``: the same as ``hzpsim validate published``."""

from __future__ import annotations

import argparse
import sys

from hzpsim import validation

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m hzpsim.validation",
                                     description=(validation.__doc__ or "").split("\n")[0])
    validation.add_arguments(parser)
    sys.exit(validation.run_from_args(parser.parse_args()))
