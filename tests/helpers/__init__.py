"""Helpers shared by the tests and the benchmarks: real servers on loopback
(registry, dockerd, SeaweedFS, the lazyfs daemon), test images and their
reference trees, runtime fixtures and subprocess workers. No test lives here."""
