"""``python -m hybrid_ep_triton``: the ``hybrid-ep`` command line."""

from .tools.cli import main

raise SystemExit(main())
