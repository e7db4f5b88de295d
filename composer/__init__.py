"""The image model (to be built by the conversion issue): layer manifests over
the chunk store, OCI import, environment specs (base / workspace / toolkits /
writable), whiteout and opaque-directory rules, `pack_diff`, the image catalog.

Nothing here yet; see ARCHITECTURE.md.
"""
