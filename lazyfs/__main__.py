"""`python -m lazyfs --root ROOT (--store PATH | --cluster URL) --cache DIR …`:
run a node's lazyfs daemon in the foreground. lazyfs.node starts it this way
(DaemonSpec.argv); operators use `lazyfs daemon`, which runs the same code."""

from __future__ import annotations

import sys

from lazyfs.daemon import main

sys.exit(main())
