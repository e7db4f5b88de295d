"""EROFS images computed from layer manifests: a metadata image kept on
local disk (`erofs.py`) and the layer's data as a flat blob whose ranges map
onto the layer's existing chunks (`composer/bloblayout.py`, shared with the
lazyfs daemon that serves the blob), for kernel mounts on the host and
virtio-pmem + DAX in microVM guests (runtime/guest/pmemimages.py). See
docs/erofs.md.
"""
