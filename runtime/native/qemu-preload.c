/*
 * qemu-preload.so: LD_PRELOADed into the QEMU of sandbox VMs (runtime/backends/
 * qemuproc.py), built by runtime/native.py.
 *
 * QEMU madvises every RAM block MADV_HUGEPAGE, also the shared file mappings
 * that back virtio-pmem devices: the image layers' blobs, which the node's
 * lazyfs daemon serves on demand (blobs/<digest>.map). On a VM_HUGEPAGE file
 * mapping the kernel reads around each page fault in two PMD units (4 MiB,
 * aligned) whatever the file's readahead is set to; without it, by the FUSE
 * mount's readahead (1 MiB). Either way a guest touching one page of a file
 * made the node fetch its neighbours too (measured, Debian `dpkg -l`: 31.6 MB
 * fetched with MADV_HUGEPAGE, 13.4 MB without, 3.5 MB with MADV_RANDOM, where
 * a container fetches 3.7 MB). So for shared mappings MADV_HUGEPAGE becomes
 * MADV_RANDOM: a fault reads just its page, and the daemon fetches just the
 * chunk behind it (later faults in that chunk hit the daemon's hot set or the
 * node cache). Guest RAM (private) keeps MADV_HUGEPAGE.
 *
 * LAZYFS_PMEM_READAROUND=kernel (in QEMU's environment) only drops
 * MADV_HUGEPAGE, leaving the kernel's read-around: fewer, larger requests to
 * the daemon for guests that read whole images, at the price of fetching
 * neighbours.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

static int shared_mapping(void *addr) {
    FILE *f = fopen("/proc/self/maps", "re");
    if (!f) return 0;
    char line[4096];
    int shared = 0;
    uintptr_t a = (uintptr_t)addr;
    while (fgets(line, sizeof line, f)) {
        unsigned long start, end;
        char perms[5];
        if (sscanf(line, "%lx-%lx %4s", &start, &end, perms) == 3 && a >= start && a < end) {
            shared = perms[3] == 's';
            break;
        }
    }
    fclose(f);
    return shared;
}

int madvise(void *addr, size_t len, int advice) {
    static int (*real)(void *, size_t, int);
    if (!real) real = (int (*)(void *, size_t, int))dlsym(RTLD_NEXT, "madvise");
    if (advice == MADV_HUGEPAGE && shared_mapping(addr)) {
        const char *mode = getenv("LAZYFS_PMEM_READAROUND");
        return mode && strcmp(mode, "kernel") == 0 ? 0 : real(addr, len, MADV_RANDOM);
    }
    return real(addr, len, advice);
}
