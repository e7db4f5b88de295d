"""What runs inside a sandbox VM and how the host reaches it.

    kernel.py     Debian's cloud kernel, fetched with apt and unpacked into a
                  cache (the guest needs no bootloader and no disk); module
                  dependency order read from the modules themselves
    initramfs.py  the guest's first and only boot image: busybox, the kernel
                  modules for virtio-pmem, EROFS, overlayfs and virtio-serial,
                  an init script that mounts the image layers, and the agent
    protocol.py   the length-prefixed frames spoken with the guest agent
                  (runtime/native/guest-agent.c) and the host's client
    pmemimages.py the layers' EROFS images as files QEMU can map as
                  virtio-pmem devices
    disk.py       a full VM's writable disk (an empty ext4 per sandbox, the
                  overlayfs upper over its pmem layers) and its image's init
    cachelock.py  the lock around those node-wide caches

Used by the VM backends (runtime/backends/qemubase.py and its two
subclasses, microvm.py and vm.py), which share the kernel, the agent and its
protocol and differ in the initramfs flavour and how the image is attached.
Images reach this package resolved (runtime.spec.ResolvedImage: a digest
and its layers), never as a name.
"""
