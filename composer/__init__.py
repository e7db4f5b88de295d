"""The image model over the chunk store: what an image and a layer are, how
they are made, named, stored and shipped.

    manifest.py     layer manifests (a layer's POSIX tree, file data as chunks)
    builder.py      the layer rules (names, whiteouts, opaque dirs, hardlinks, holes)
    tarlayer.py     a tar stream -> a layer, in one streaming pass
    sources.py      image sources (tar, dir, git, docker-archive, oci, registry, docker)
    registry.py     OCI registry pulls; dockerengine.py, streams.py: their plumbing
    convert.py      source -> layers + image record + tag in the local catalog
    catalog.py      the local catalog (LMDB): tags, image records, layer records
    refs.py         image references: tags (`:latest` default) and digests
    remote.py       the catalog in the cluster store: image records, tags, gc
    push.py         local store + catalog -> cluster store
    compose.py      stacking layers (whiteouts, opaque dirs, overlay fixups)
    export.py       a composed tree on disk; bloblayout.py: a layer as one blob
    envspec.py      environment specs (base / workspace / toolkits / writable)

Not here: chunk ids, packs, the index and the cluster's packs and location
tables (`chunkstore`); serving layers (`lazyfs`); EROFS images (`pmem`).
"""
