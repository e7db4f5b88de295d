"""EROFS images computed from layer manifests: a metadata image kept on
local disk (`erofs.py`) and the layer's data as a flat blob whose ranges map
onto the layer's existing chunks (`layout.py`), for kernel mounts on the
host (the blob served by the lazyfs daemon) and, next, virtio-pmem + DAX in
guests. See docs/erofs.md.
"""
