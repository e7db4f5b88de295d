"""The CLI's settings are the machine's: lazyfs.settings (the config file's
format, the environment variables and the one precedence are documented
there). The `lazyfs` group loads them with its global options on top."""

from __future__ import annotations

from lazyfs.settings import Settings, config_file_path, default_store_path

__all__ = ["Settings", "config_file_path", "default_store_path"]
