"""EROFS images computed from layer manifests (to be built by the EROFS
issue): metadata images kept on local disk with data ranges mapped onto the
layer's chunks, for kernel mounts on the host and virtio-pmem + DAX in guests.

Nothing here yet; see ARCHITECTURE.md.
"""
