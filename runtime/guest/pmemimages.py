"""An image's layers as files QEMU maps into guests as virtio-pmem devices.

    image = images.resolve_image("bb:1")          # done once, by the node, at create
    layers = pmem_layers(images, image, cache)    # bottom first, then the fixup layer
    for layer in layers: layer.meta, layer.blob   # each a multiple of 2 MiB

The image is given by digest and layer list (a ResolvedImage), never by
name: only the layers' manifests are read from the catalog, by their
content digests.

Each layer is two devices: its EROFS metadata image (pmem/erofs.py) and its
blob (the layer's file data, device 1 of the image), mounted in the guest
with `mount -t erofs -o ro,dax,device=/dev/pmemB /dev/pmemA`. Two devices
rather than one concatenated file because the guest kernel (Debian 12's
6.1) does not map a multi-device image's blob flat after its metadata
(that arrived in 6.12); `device=` works on both.

The metadata image is small and built locally, once per layer and node
(CACHE/<digest>-<fingerprint>.meta.pmem, zero-padded to 2 MiB). The blob
is not copied: the device is the node daemon's `blobs/<digest>.map`
(lazyfs/blob.py), the blob page-cached and padded for mapping. QEMU maps it
shared, so a guest's DAX load of a page nobody read yet is a host page
fault on the FUSE file, which fetches just the chunks behind that page
through the node cache, and every VM (and the host's own EROFS mounts of
the layer's `.data`, for the chunks) shares what was fetched. A fetch
that fails makes that page fault fail: the VMM gets SIGBUS and exits, and
the call waiting on the guest raises BackendUnavailable (bounded by the
daemon's fetch timeout); a DAX load has no way to return an I/O error to
the guest (docs/microvm.md).

The files are mapped read-only (memory-backend-file readonly=on): a guest
that writes to its pmem device faults in the guest and cannot change the
file other VMs read.

Directory metadata overlayfs would take from the wrong layer (see
lazyfs/mounts.py) is fixed as on the host: a metadata-only top layer of the
image's fixup directories, built as one more EROFS image.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from chunkstore.digests import digest_key
from composer.compose import mount_layers, overlay_fixups
from composer.manifest import LayerManifest
from lazyfs.blob import MAP_ALIGN, map_name, map_size
from pmem.erofs import build_image
from pmem.errors import PmemError

from ..errors import BackendUnavailable
from ..images import Images
from ..spec import ResolvedImage
from .cachelock import locked, mark_used

ALIGN = MAP_ALIGN  # virtio-pmem regions are mapped in 2 MiB units
_CODE = (Path(__file__).resolve().parents[2] / "pmem" / "erofs.py",
         Path(__file__).resolve().parents[2] / "composer" / "bloblayout.py")


@dataclass(frozen=True)
class PmemLayer:
    digest: str  # the layer's, or "fixups:<image digest>"
    meta: Path
    blob: Path  # the daemon's blobs/<digest>.map; for the fixup layer a local hole

    @property
    def files(self) -> tuple[Path, Path]:
        return (self.meta, self.blob)


def fingerprint() -> str:
    """Changes when the code that lays out images does: cached files made by
    another version are never mapped."""
    h = hashlib.sha256()
    for p in _CODE:
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def _publish(dest: Path, write: Callable[[int], None]) -> None:
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
    try:
        write(fd)
        os.fchmod(fd, 0o444)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, dest)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_meta(dest: Path, meta: bytes) -> None:
    def write(fd: int) -> None:
        view = memoryview(meta)
        while view:
            view = view[os.write(fd, view):]
        os.ftruncate(fd, map_size(len(meta)))
    _publish(dest, write)


def pmem_layers(images: Images, image: ResolvedImage, cache: Path,
                progress: Callable[[str], None] | None = None) -> list[PmemLayer]:
    """The pmem files of the image, bottom layer first, the fixup layer
    last: metadata images made where missing (each told to `progress`),
    blobs the node daemon's (started if need be; nothing of the data is
    read here)."""
    catalog = images.catalog()
    name, image_digest = image.name, image.digest
    manifests, digests = mount_layers([catalog.load_layer(d) for d in image.layers],
                                       list(image.layers))
    fp = fingerprint()
    out = []
    paths = None
    fixups = [dataclasses.replace(e, opaque=False) for e in overlay_fixups(manifests)]
    wanted = [(d, digest_key(d), m) for d, m in zip(digests, manifests, strict=True)]
    fixups_name = f"fixups-{digest_key(image_digest)}"
    wanted.append((fixups_name, fixups_name, LayerManifest(fixups)))
    for i, (digest, key, manifest) in enumerate(wanted):
        stem = cache / f"{key}-{fp}"
        meta = stem.with_suffix(".meta.pmem")
        if not meta.exists():
            with locked(cache):
                if not meta.exists():
                    if progress is not None:
                        progress(f"building the EROFS metadata of layer {i + 1}/{len(wanted)} "
                                 f"of {name} ({len(manifest.entries)} entries)")
                    try:
                        built = build_image(manifest, layer=digest)
                    except PmemError as e:
                        raise BackendUnavailable(f"layer {digest} of {name} cannot be an "
                                                 f"EROFS image: {e}") from e
                    _write_meta(meta, built.meta)
        mark_used(meta)
        if digest == fixups_name:  # metadata only, not a layer of the daemon's: a hole
            blob = stem.with_suffix(".blob.pmem")
            if not blob.exists():
                with locked(cache):
                    if not blob.exists():
                        _publish(blob, lambda fd: os.ftruncate(fd, ALIGN))
            mark_used(blob)
        else:
            if paths is None:
                paths = images.ensure_daemon()
            blob = paths.blobs / map_name(digest)
        out.append(PmemLayer(digest, meta, blob))
    return out
