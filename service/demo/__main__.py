"""``python -m service.demo``: the same as ``pasto demo``."""

from . import main

raise SystemExit(main())
