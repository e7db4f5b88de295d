"""Pushing an image from a local store and catalog into the cluster store.

Order is what makes a push safe to read and to collect at any moment: for
each layer its packs, then its location table (`Cluster.push_layer`), then
the image record, then the tag, each one atomic object put; a node never
sees a tag naming a partial image. Idempotent: layers the cluster has are
skipped (touched, so a concurrent gc keeps them), chunks it has are not
uploaded again.

Not here: how chunks are packed, deduped and located (`chunkstore.cluster`),
the cluster's tags and image records (`composer.remote`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from chunkstore import ChunkId, ChunkStore, TrustDomain
from chunkstore.cluster import Cluster

from .catalog import Catalog, parse_ref
from .remote import ClusterCatalog

log = logging.getLogger(__name__)


@dataclass
class PushReport:
    image: str
    layers_pushed: int = 0
    layers_skipped: int = 0
    chunks_uploaded: int = 0
    chunks_deduped: int = 0
    bytes_uploaded: int = 0
    packs: int = 0
    seconds: float = 0.0


def push(cluster: Cluster, store: ChunkStore, catalog: Catalog, name: str, *,
         progress: Callable[[int], None] | None = None) -> PushReport:
    """Upload image `name` (a tag or a digest) from `store` + `catalog`; a
    tag is set in the cluster too, a digest is pushed untagged."""
    t0 = time.perf_counter()
    digest, image = catalog.resolve(name)
    report = PushReport(digest)
    known = cluster.known_locations()
    for layer in image.layers:
        if cluster.reuse_layer(layer):
            report.layers_skipped += 1
            continue
        rec = catalog.layer_info(layer)
        manifest_ids = [ChunkId.from_hex(h) for h in rec["chunks"]]
        done = cluster.push_layer(
            store, layer, TrustDomain(rec["domain"]), manifest_ids,
            # in the layer's file order: chunks read one after the other (a
            # file's, a directory's, a trace's) sit side by side in the packs
            # and come back in few ranged GETs
            catalog.load_layer(layer).chunk_ids_in_order(), known, progress=progress)
        report.layers_pushed += 1
        report.chunks_uploaded += done.chunks_uploaded
        report.chunks_deduped += done.chunks_deduped
        report.bytes_uploaded += done.bytes_uploaded
        report.packs += done.packs
    remote = ClusterCatalog(cluster)
    # (an image recorded before its digest left out the source is keyed
    # by its view's digest in the cluster)
    digest = report.image = remote.put_image(image)
    ref = parse_ref(name)
    if ref.tag is not None:
        remote.set_tag(ref.tag, digest)
    report.seconds = time.perf_counter() - t0
    log.info("pushed %s (%s): %d layers, %d skipped", name, digest,
             report.layers_pushed, report.layers_skipped)
    return report
