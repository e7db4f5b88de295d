"""How the CLI reports failures: one line on stderr and an exit code, no
traceback unless --debug.

Every error the project raises on purpose derives from
chunkstore.errors.LazyfsError; the `lazyfs` group (tools/cli.py) turns any
of them into a QuietError, itself one, so the whole tree prints as one line:

    LazyfsError
     ├── ChunkStoreError, ComposerError, PmemError, NodeError, SandboxError
     └── QuietError          the CLI's own errors, and the others as printed

Exit codes:
    0  success
    1  an operation failed (chunkstore or other domain error)
    2  usage error (click's own)
    3  verification found bad data
    4  the store is read-only, full, or not a store
"""

from __future__ import annotations

import click

from chunkstore.errors import LazyfsError

EXIT_FAILED = 1
EXIT_CORRUPT = 3
EXIT_STORE = 4


class QuietError(LazyfsError, click.ClickException):
    """An error the user can act on; printed as one line."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]  # click declares it on the class

    def show(self, file: object = None) -> None:
        click.echo(f"lazyfs: error: {self.format_message()}", err=True)
