"""``python -m hzpsim.cli``: the ``hzpsim`` command."""

from hzpsim.cli import main

raise SystemExit(main())
