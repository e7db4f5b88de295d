"""The `lazyfs` command line. Subcommands live in their own modules; the
logic they call lives in the packages below (chunkstore, composer, …)."""
