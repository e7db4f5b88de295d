/* lazyfs-blobd: the node's layer blobs (<digest>.data) served natively.

   A FUSE low-level server (libfuse3, multi-threaded) whose only files are
   the layers' blobs: the data devices of their kernel EROFS mounts. A read
   maps its range through the layer's extent table (written once per layer
   by the Python daemon, lazyfs/nativeblobs.py: blob offset -> chunk, and
   where the chunk lives) and gets each chunk from

     the node cache   CACHE/dom-<domain>/<xx>/<id>: pread, xxh3 check;
     the local store  PACKS/<pack>.pack: pread of the record, header check,
                      zstd, xxh3 check;
     the daemon       anything else (a cluster store, a chunk GC moved, a
                      corrupt copy): a request on the daemon's socket; the
                      daemon fetches it through the node cache (its
                      coalescing, retries and timeouts) and answers with a
                      descriptor of the bytes (a memfd: nothing evicts it
                      before it is read), checked here like the others.

   Bytes are served only after their xxh3-128 matched the chunk id: a
   mismatch is an event to the daemon and, if the daemon cannot get good
   bytes either, EIO. Every read served is reported to the daemon on the
   same socket (layer, range, reader pid, hits, misses) before the reply,
   so traces, the read ledger and the statistics stay the daemon's. When
   the daemon's socket closes, this server unmounts and exits: readers get
   errors, never bytes nobody accounted for.

   The daemon holds the FUSE connection (it mounts with fd=N and passes N
   here), so a server that dies does not take the mount along: readers
   wait, and the next server the daemon starts takes the connection over
   (`resume`): it accepts the connection as already initialised, asks the
   kernel to send again every request the dead one had taken
   (FUSE_NOTIFY_RESEND, Linux 6.9), and finds a layer by its inode, which
   is the layer id the daemon gave it (inode = layer id + 2), from its table.
   When the daemon dies, its descriptor closes with it, this server exits
   (parent-death signal) and the connection ends: readers get errors.

   TABLES/generation (8 bytes, mapped shared): the daemon bumps it to make
   this server forget its hot set (`lazyfs` drop_cache: a cold node).

   usage: lazyfs-blobd MOUNTPOINT TABLES SOCKET [HOT_MIB] [TIMEOUT_S] [FUSE_FD [resume]]
          lazyfs-blobd --check TABLE      (parse a table: exit 0 if valid)

   The extent table (little-endian), version 1:
     header  magic "LZEXT\0\0\1" u32 version u32 layer_id u64 blob_size
             u32 n_chunks u32 n_segs u16 cache_len u16 packs_len u32 flags
             then cache_len bytes (the domain's cache directory) and
             packs_len bytes (the store's packs directory, or none), padded
             to 8
     chunks  n_chunks x 48: id[16] u32 plain_len u32 stored_len
             u64 pack u64 offset (of the stored bytes; 0: not in a local
             pack) u8 codec (0 raw, 1 zstd) u8[3] u32 entry
     segs    n_segs x 24: u64 blob_off u32 len u32 chunk u32 chunk_off u32 0
             sorted, not overlapping, inside the blob; gaps read as zeros */

#define FUSE_USE_VERSION 312
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <linux/fuse.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>
#include <zstd.h>

#define MAGIC "LZEXT\0\0\1"
#define VERSION 1
#define HEADER_SIZE 40
#define CHUNK_SIZE 48
#define SEG_SIZE 24
#define MAX_CHUNK (64u << 20)
#define MAX_LAYERS 65536
#define MAX_NAME 200
#define RECORD_HEADER 32
#define IOV_CAP 1000  /* pieces of one reply (writev takes 1024) */
#define MAX_READ (1u << 20)

/* messages to the daemon (64 bytes each, SOCK_SEQPACKET) */
enum { MSG_REPORT = 'R', MSG_FETCH = 'F', MSG_TABLE = 'T', MSG_EVENT = 'E', MSG_SPILL = 'S' };
enum { EV_CACHE_CORRUPT = 1, EV_PACK_CORRUPT = 2, EV_FAILED = 3, EV_TIMEOUT = 4 };

struct chunk {
    uint8_t id[16];
    uint32_t plain_len, stored_len;
    uint64_t pack, offset;
    uint8_t codec;
    uint32_t entry;
};

struct seg {
    uint64_t off;
    uint32_t len, chunk, chunk_off;
};

struct layer {
    char digest[MAX_NAME + 1];
    uint32_t layer_id;
    uint64_t size;
    uint32_t n_chunks, n_segs;
    struct chunk *chunks;
    struct seg *segs;
    char *cache_dir, *packs_dir;
};

/* -- little-endian readers ---------------------------------------------- */

static uint16_t le16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t le64(const uint8_t *p) { return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32; }
static uint32_t be32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

static void free_layer(struct layer *l) {
    if (!l) return;
    free(l->chunks);
    free(l->segs);
    free(l->cache_dir);
    free(l->packs_dir);
    free(l);
}

static int safe_dir(const char *s, size_t n) {
    if (n == 0 || n > 4000 || s[0] != '/') return 0;
    for (size_t i = 0; i < n; i++)
        if (s[i] == 0) return 0;
    return 1;
}

/* Parse and check a table held in buf; NULL (and why, in err) if it is
   not a valid one. Everything a read will index is checked here. */
static struct layer *parse_table(const uint8_t *buf, size_t n, char *err, size_t errlen) {
#define BAD(...) do { snprintf(err, errlen, __VA_ARGS__); free_layer(l); return NULL; } while (0)
    struct layer *l = calloc(1, sizeof *l);
    if (!l) { snprintf(err, errlen, "out of memory"); return NULL; }
    if (n < HEADER_SIZE) BAD("%zu bytes: shorter than a header", n);
    if (memcmp(buf, MAGIC, 8) != 0) BAD("not an extent table (magic)");
    if (le32(buf + 8) != VERSION) BAD("version %u, this server reads %u", le32(buf + 8), VERSION);
    l->layer_id = le32(buf + 12);
    l->size = le64(buf + 16);
    l->n_chunks = le32(buf + 24);
    l->n_segs = le32(buf + 28);
    size_t cache_len = le16(buf + 32), packs_len = le16(buf + 34);
    if (l->size > (1ull << 44)) BAD("blob size %llu is impossible", (unsigned long long)l->size);
    size_t strings = (cache_len + packs_len + 7) & ~(size_t)7;
    size_t need = HEADER_SIZE + strings;
    if (need > n) BAD("strings run past the end");
    if ((n - need) / CHUNK_SIZE < l->n_chunks) BAD("%u chunks run past the end", l->n_chunks);
    need += (size_t)l->n_chunks * CHUNK_SIZE;
    if ((n - need) / SEG_SIZE < l->n_segs) BAD("%u segments run past the end", l->n_segs);
    need += (size_t)l->n_segs * SEG_SIZE;
    if (need != n) BAD("%zu bytes after the segments", n - need);
    const char *s = (const char *)buf + HEADER_SIZE;
    if (!safe_dir(s, cache_len)) BAD("cache directory is not an absolute path");
    if (packs_len && !safe_dir(s + cache_len, packs_len)) BAD("packs directory is not an absolute path");
    l->cache_dir = strndup(s, cache_len);
    l->packs_dir = packs_len ? strndup(s + cache_len, packs_len) : NULL;
    l->chunks = calloc(l->n_chunks ? l->n_chunks : 1, sizeof *l->chunks);
    l->segs = calloc(l->n_segs ? l->n_segs : 1, sizeof *l->segs);
    if (!l->cache_dir || (packs_len && !l->packs_dir) || !l->chunks || !l->segs) BAD("out of memory");
    const uint8_t *p = buf + HEADER_SIZE + strings;
    for (uint32_t i = 0; i < l->n_chunks; i++, p += CHUNK_SIZE) {
        struct chunk *c = &l->chunks[i];
        memcpy(c->id, p, 16);
        c->plain_len = le32(p + 16);
        c->stored_len = le32(p + 20);
        c->pack = le64(p + 24);
        c->offset = le64(p + 32);
        c->codec = p[40];
        c->entry = le32(p + 44);
        if (c->plain_len == 0 || c->plain_len > MAX_CHUNK) BAD("chunk %u: length %u", i, c->plain_len);
        if (c->codec > 1) BAD("chunk %u: codec %u", i, c->codec);
        if (c->offset && (c->offset < RECORD_HEADER + 16 || c->offset > (1ull << 48) ||
                          c->stored_len > MAX_CHUNK + (1u << 20) || !l->packs_dir))
            BAD("chunk %u: impossible pack location", i);
    }
    uint64_t end = 0;
    for (uint32_t i = 0; i < l->n_segs; i++, p += SEG_SIZE) {
        struct seg *g = &l->segs[i];
        g->off = le64(p);
        g->len = le32(p + 8);
        g->chunk = le32(p + 12);
        g->chunk_off = le32(p + 16);
        if (g->len == 0 || g->off < end || g->off > l->size || l->size - g->off < g->len)
            BAD("segment %u: range out of order or outside the blob", i);
        if (g->chunk >= l->n_chunks) BAD("segment %u: chunk %u of %u", i, g->chunk, l->n_chunks);
        if (g->chunk_off > l->chunks[g->chunk].plain_len ||
            l->chunks[g->chunk].plain_len - g->chunk_off < g->len)
            BAD("segment %u: outside its chunk", i);
        end = g->off + g->len;
    }
    return l;
#undef BAD
}

static struct layer *load_table(const char *path, char *err, size_t errlen) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) { snprintf(err, errlen, "%s: %s", path, strerror(errno)); return NULL; }
    struct stat st;
    if (fstat(fd, &st) < 0 || st.st_size <= 0 || st.st_size > (1ll << 34)) {
        snprintf(err, errlen, "%s: not a table file", path);
        close(fd);
        return NULL;
    }
    void *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (m == MAP_FAILED) { snprintf(err, errlen, "%s: %s", path, strerror(errno)); return NULL; }
    struct layer *l = parse_table(m, (size_t)st.st_size, err, errlen);
    munmap(m, (size_t)st.st_size);
    return l;
}

/* -- the server's state ------------------------------------------------- */

static const char *tables_dir, *sock_path, *mountpoint;
static struct fuse_session *session;
static int fetch_timeout_s = 30;
static pthread_rwlock_t layers_lock = PTHREAD_RWLOCK_INITIALIZER;
static struct layer *layers[MAX_LAYERS];  /* by layer id; inode = id + 2 */
static uint32_t n_layers;
static const uint8_t zeros[MAX_READ];  /* what gaps read as */

/* the hot set: decoded chunks shared by all threads, single flight */
struct slot {
    struct layer *layer;
    uint32_t chunk;
    uint8_t *data;
    uint32_t len;
    int refs, loading, error;
    int packed;       /* decoded from a local pack (the node cache has no copy) */
    uint64_t served;  /* bytes of it served so far (atomic) */
    uint64_t tick;
    struct slot *next;
};
#define BUCKETS 4096
static pthread_mutex_t hot_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hot_cv = PTHREAD_COND_INITIALIZER;
static struct slot *buckets[BUCKETS];
static uint64_t hot_bytes, hot_limit = 64u << 20, hot_tick;
/* evicted slots to hand to the daemon for the node cache (see spill) */
static struct slot *spills;
static volatile uint64_t *generation;  /* TABLES/generation, mapped shared */
static uint64_t seen_generation;

/* packs' descriptors, opened once */
#define PACK_FDS 256
static pthread_mutex_t packs_mu = PTHREAD_MUTEX_INITIALIZER;
static struct { uint64_t pack; int fd; const char *dir; } pack_fds[PACK_FDS];
static int n_pack_fds;

static __thread int conn_fd = -1;  /* this thread's connection to the daemon */
static __thread ZSTD_DCtx *dctx;

static int fuse_fd = -1;  /* the connection the daemon holds and passed (fd mode) */
static volatile int daemon_gone;

/* The daemon's death reaches us as SIGHUP (PR_SET_PDEATHSIG), a signal of
   its own: getppid() cannot tell, since the kernel first hands us to another
   of the dying daemon's threads, and SIGTERM is the daemon asking us to stop. */
static volatile sig_atomic_t parent_died;

static void on_parent_death(int sig) {
    (void)sig;
    parent_died = 1;
    if (session) fuse_session_exit(session);
}

static void die_on_daemon_gone(void) {
    /* the daemon is what accounts for reads: without it, serve nothing */
    fprintf(stderr, "lazyfs-blobd: the daemon's socket closed; unmounting\n");
    daemon_gone = 1;
    if (session) fuse_session_exit(session);
    kill(getpid(), SIGTERM);
}

static int connect_daemon(void) {
    if (conn_fd >= 0) return conn_fd;
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", sock_path);
    struct timeval tv = {.tv_sec = fetch_timeout_s + 5};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0) {
        close(fd);
        die_on_daemon_gone();
        return -1;
    }
    conn_fd = fd;
    return fd;
}

#define MSG_SIZE 64  /* every message but a table request (8 + the digest) */

static int send_len(const uint8_t *msg, size_t len) {
    int fd = connect_daemon();
    if (fd < 0) return -1;
    if (send(fd, msg, len, MSG_NOSIGNAL) != (ssize_t)len) {
        close(fd);
        conn_fd = -1;
        die_on_daemon_gone();
        return -1;
    }
    return 0;
}

static int send_msg(const uint8_t msg[MSG_SIZE]) { return send_len(msg, MSG_SIZE); }

/* A request the daemon answers: 0, or an errno (EIO when it cannot say).
   With fd, the descriptor the answer carries (-1: none). */
static int ask(const uint8_t *msg, size_t len, int *fd) {
    if (fd) *fd = -1;
    if (send_len(msg, len) < 0) return EIO;
    uint8_t reply[16];
    union { struct cmsghdr h; char buf[CMSG_SPACE(sizeof(int))]; } ctl;
    struct iovec v = {reply, sizeof reply};
    struct msghdr mh = {.msg_iov = &v, .msg_iovlen = 1, .msg_control = ctl.buf,
                        .msg_controllen = sizeof ctl.buf};
    ssize_t r = recvmsg(conn_fd, &mh, MSG_CMSG_CLOEXEC);
    int got_fd = -1;
    for (struct cmsghdr *c = r > 0 ? CMSG_FIRSTHDR(&mh) : NULL; c; c = CMSG_NXTHDR(&mh, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS &&
            c->cmsg_len == CMSG_LEN(sizeof(int))) {
            if (got_fd >= 0) close(got_fd);
            memcpy(&got_fd, CMSG_DATA(c), sizeof(int));
        }
    if (r != (ssize_t)sizeof reply || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
        if (got_fd >= 0) close(got_fd);
        close(conn_fd);
        conn_fd = -1;
        if (r == 0) die_on_daemon_gone();
        return EIO;
    }
    int status = (int)le32(reply);
    status = status > 0 && status < 4096 ? status : status == 0 ? 0 : EIO;
    if (fd && !status) *fd = got_fd;
    else if (got_fd >= 0) close(got_fd);
    return status;
}

static void put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static void put32(uint8_t *p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> 8 * i); }
static void put64(uint8_t *p, uint64_t v) { for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> 8 * i); }

static void event(struct layer *l, uint32_t chunk, uint32_t kind) {
    uint8_t m[64] = {MSG_EVENT};
    put32(m + 4, l->layer_id);
    put32(m + 8, chunk);
    put32(m + 12, kind);
    send_msg(m);
}

/* The daemon's copy of a chunk: 0 and a descriptor of its plain bytes, or an errno. */
static int ask_fetch(struct layer *l, uint32_t chunk, int *fd) {
    uint8_t m[64] = {MSG_FETCH};
    put32(m + 4, l->layer_id);
    put32(m + 8, chunk);
    int status = ask(m, sizeof m, fd);
    if (!status && *fd < 0) status = EIO;
    return status;
}

/* -- getting a chunk's plain bytes -------------------------------------- */

static int checked(const struct chunk *c, const uint8_t *data) {
    XXH128_hash_t h = XXH3_128bits(data, c->plain_len);
    XXH128_canonical_t canon;
    XXH128_canonicalFromHash(&canon, h);
    return memcmp(canon.digest, c->id, 16) == 0;
}

static int pread_all(int fd, uint8_t *buf, size_t len, off_t off) {
    size_t done = 0;
    while (done < len) {
        ssize_t r = pread(fd, buf + done, len - done, off + (off_t)done);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        done += (size_t)r;
    }
    return 0;
}

/* A chunk's plain bytes from a file (closed here): 1 good, 0 not there
   (not a regular file of its length), -1 there but wrong. */
static int from_fd(const struct chunk *c, int fd, uint8_t *buf) {
    struct stat st;
    int ok = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (uint64_t)st.st_size == c->plain_len &&
             pread_all(fd, buf, c->plain_len, 0) == 0;
    close(fd);
    if (!ok) return 0;  /* (being evicted or written: the daemon knows) */
    return checked(c, buf) ? 1 : -1;
}

/* 1: good bytes in buf; 0: not cached; -1: cached but wrong */
static int from_cache(const struct layer *l, const struct chunk *c, uint8_t *buf) {
    char path[4200], hex[33];
    for (int i = 0; i < 16; i++) snprintf(hex + 2 * i, 3, "%02x", c->id[i]);
    snprintf(path, sizeof path, "%s/%.2s/%s", l->cache_dir, hex, hex);
    /* (non-blocking: a FIFO planted there opens, and fails the S_ISREG check) */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) return 0;
    return from_fd(c, fd, buf);
}

/* A descriptor of the pack (a duplicate of the one kept open: the caller
   closes it), or -1. */
static int pack_fd(const char *dir, uint64_t pack) {
    int fd = -1;
    pthread_mutex_lock(&packs_mu);
    for (int i = 0; i < n_pack_fds && fd < 0; i++)
        if (pack_fds[i].pack == pack && pack_fds[i].dir == dir) fd = dup(pack_fds[i].fd);
    if (fd < 0) {
        char path[4200];
        snprintf(path, sizeof path, "%s/%016llx.pack", dir, (unsigned long long)pack);
        /* (non-blocking: a pack that is not a regular file, such as a FIFO,
           is not there; the daemon's fetch, with its timeout, decides) */
        int kept = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
        struct stat st;
        if (kept >= 0 && (fstat(kept, &st) != 0 || !S_ISREG(st.st_mode))) {
            close(kept);
            kept = -1;
        }
        if (kept >= 0) {
            if (n_pack_fds == PACK_FDS) {  /* the oldest goes */
                close(pack_fds[0].fd);
                memmove(pack_fds, pack_fds + 1, sizeof pack_fds[0] * (PACK_FDS - 1));
                n_pack_fds--;
            }
            pack_fds[n_pack_fds].pack = pack;
            pack_fds[n_pack_fds].fd = kept;
            pack_fds[n_pack_fds].dir = dir;
            n_pack_fds++;
            fd = dup(kept);
        }
    }
    pthread_mutex_unlock(&packs_mu);
    return fd;
}

/* 1: good bytes in buf; 0: not there (no pack, or another record where
   the table says: the store's GC moved it; the daemon looks it up again);
   -1: there but wrong */
static int from_pack(const struct layer *l, const struct chunk *c, uint8_t *buf) {
    if (!c->offset || !l->packs_dir) return 0;
    int fd = pack_fd(l->packs_dir, c->pack);
    if (fd < 0) return 0;
    size_t n = RECORD_HEADER + (size_t)c->stored_len;
    uint8_t *raw = malloc(n);
    int r = 0;
    if (raw && pread_all(fd, raw, n, (off_t)(c->offset - RECORD_HEADER)) == 0 &&
        memcmp(raw, "LZCK", 4) == 0 && memcmp(raw + 4, c->id, 16) == 0 && raw[20] == c->codec &&
        be32(raw + 24) == c->plain_len && be32(raw + 28) == c->stored_len) {
        const uint8_t *stored = raw + RECORD_HEADER;
        r = -1;
        if (c->codec == 0) {
            if (c->stored_len == c->plain_len) { memcpy(buf, stored, c->plain_len); r = 1; }
        } else {
            if (!dctx) dctx = ZSTD_createDCtx();
            size_t got = dctx ? ZSTD_decompressDCtx(dctx, buf, c->plain_len, stored, c->stored_len) : 0;
            if (dctx && !ZSTD_isError(got) && got == c->plain_len) r = 1;
        }
        if (r == 1 && !checked(c, buf)) r = -1;
    }
    free(raw);
    close(fd);
    return r;
}

enum { GOT_HOT, GOT_CACHE, GOT_PACK, GOT_FETCHED };

/* The chunk's plain bytes into buf (plain_len bytes): 0 and where from, or an errno. */
static int load_chunk(struct layer *l, uint32_t ci, uint8_t *buf, int *from) {
    const struct chunk *c = &l->chunks[ci];
    int r = from_cache(l, c, buf);
    if (r == 1) { *from = GOT_CACHE; return 0; }
    if (r < 0) event(l, ci, EV_CACHE_CORRUPT);
    else {
        r = from_pack(l, c, buf);
        if (r == 1) { *from = GOT_PACK; return 0; }
        if (r < 0) event(l, ci, EV_PACK_CORRUPT);
    }
    /* the daemon fetches it through the node cache (or says why not) */
    int fd = -1, status = ask_fetch(l, ci, &fd);
    if (status) return status;
    r = from_fd(c, fd, buf);
    if (r == 1) { *from = GOT_FETCHED; return 0; }
    event(l, ci, EV_FAILED);
    return EIO;
}

static struct slot **bucket_of(struct layer *l, uint32_t ci) {
    uintptr_t h = ((uintptr_t)l >> 4) * 31 + ci * 2654435761u;
    return &buckets[h % BUCKETS];
}

static void drop_hot_locked(void) {
    for (int b = 0; b < BUCKETS; b++)
        for (struct slot **s = &buckets[b]; *s;) {
            struct slot *v = *s;
            if (v->refs || v->loading) { s = &v->next; continue; }
            *s = v->next;
            hot_bytes -= v->len;
            free(v->data);
            free(v);
        }
}

static void evict_locked(void) {
    while (hot_bytes > hot_limit) {
        struct slot **victim = NULL;
        uint64_t oldest = UINT64_MAX;
        for (int b = 0; b < BUCKETS; b++)
            for (struct slot **s = &buckets[b]; *s; s = &(*s)->next)
                if (!(*s)->refs && !(*s)->loading && (*s)->tick < oldest) {
                    oldest = (*s)->tick;
                    victim = s;
                }
        if (!victim) return;
        struct slot *v = *victim;
        *victim = v->next;
        hot_bytes -= v->len;
        if (v->packed && __atomic_load_n(&v->served, __ATOMIC_RELAXED) < v->len) {
            v->next = spills;
            spills = v;
        } else {
            free(v->data);
            free(v);
        }
    }
}

/* A chunk decoded from a pack that leaves the hot set before all of it was
   served (a file read in parts: a binary's pages faulted in over time) is
   handed to the daemon, which keeps it in the node cache (its bound, its
   eviction): its other parts are likely read later and would otherwise come
   from the store a second time. Chunks read whole are not (their pages are
   in the page cache). As the Python path's FetchEngine._spill_partial. */
static void spill(void) {
    pthread_mutex_lock(&hot_mu);
    struct slot *list = spills;
    spills = NULL;
    pthread_mutex_unlock(&hot_mu);
    while (list) {
        struct slot *v = list;
        list = v->next;
        int fd = memfd_create("lazyfs-spill", MFD_CLOEXEC);
        size_t done = 0;
        while (fd >= 0 && done < v->len) {
            ssize_t w = write(fd, v->data + done, v->len - done);
            if (w <= 0) break;
            done += (size_t)w;
        }
        if (fd >= 0 && done == v->len && connect_daemon() >= 0) {
            uint8_t m[MSG_SIZE] = {MSG_SPILL};
            put32(m + 4, v->layer->layer_id);
            put32(m + 8, v->chunk);
            union { struct cmsghdr h; char buf[CMSG_SPACE(sizeof(int))]; } ctl;
            memset(&ctl, 0, sizeof ctl);
            struct iovec iv = {m, sizeof m};
            struct msghdr mh = {.msg_iov = &iv, .msg_iovlen = 1, .msg_control = ctl.buf,
                                .msg_controllen = sizeof ctl.buf};
            struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
            c->cmsg_level = SOL_SOCKET;
            c->cmsg_type = SCM_RIGHTS;
            c->cmsg_len = CMSG_LEN(sizeof(int));
            memcpy(CMSG_DATA(c), &fd, sizeof(int));
            sendmsg(conn_fd, &mh, MSG_NOSIGNAL);  /* (best effort: a cache fill) */
        }
        if (fd >= 0) close(fd);
        free(v->data);
        free(v);
    }
}

/* A referenced slot holding chunk ci of l (release with put_slot), or NULL
   and *err. *from says where it came from. */
static struct slot *get_slot(struct layer *l, uint32_t ci, int *err, int *from) {
    pthread_mutex_lock(&hot_mu);
    if (generation && *generation != seen_generation) {  /* the daemon dropped its caches */
        seen_generation = *generation;
        drop_hot_locked();
    }
    struct slot **b = bucket_of(l, ci), *s;
    for (s = *b; s; s = s->next)
        if (s->layer == l && s->chunk == ci) break;
    if (s) {
        s->refs++;
        while (s->loading) pthread_cond_wait(&hot_cv, &hot_mu);
        if (s->error) {  /* (unlinked already: the last one out frees it) */
            *err = s->error;
            if (--s->refs == 0) free(s);
            pthread_mutex_unlock(&hot_mu);
            return NULL;
        }
        s->tick = ++hot_tick;
        pthread_mutex_unlock(&hot_mu);
        *from = GOT_HOT;
        return s;
    }
    s = calloc(1, sizeof *s);
    uint8_t *data = s ? malloc(l->chunks[ci].plain_len) : NULL;
    if (!data) {
        free(s);
        pthread_mutex_unlock(&hot_mu);
        *err = ENOMEM;
        return NULL;
    }
    s->layer = l;
    s->chunk = ci;
    s->data = data;
    s->len = l->chunks[ci].plain_len;
    s->refs = 1;
    s->loading = 1;
    s->next = *b;
    *b = s;
    pthread_mutex_unlock(&hot_mu);
    int e = load_chunk(l, ci, data, from);
    pthread_mutex_lock(&hot_mu);
    s->loading = 0;
    if (e) {
        /* unlink it: the next reader tries again */
        s->error = e;
        for (struct slot **p = bucket_of(l, ci); *p; p = &(*p)->next)
            if (*p == s) { *p = s->next; break; }
        pthread_cond_broadcast(&hot_cv);
        free(s->data);
        s->data = NULL;
        if (--s->refs == 0) free(s);  /* (else waiters see the error; the last frees it) */
        pthread_mutex_unlock(&hot_mu);
        *err = e;
        return NULL;
    }
    s->tick = ++hot_tick;
    s->packed = *from == GOT_PACK;
    hot_bytes += s->len;
    pthread_cond_broadcast(&hot_cv);
    evict_locked();
    int spilled = spills != NULL;
    pthread_mutex_unlock(&hot_mu);
    if (spilled) spill();
    return s;
}

static void put_slot(struct slot *s) {
    pthread_mutex_lock(&hot_mu);
    s->refs--;
    if (hot_bytes > hot_limit) evict_locked();
    int spilled = spills != NULL;
    pthread_mutex_unlock(&hot_mu);
    if (spilled) spill();
}

/* -- layers by name ----------------------------------------------------- */

static int valid_digest(const char *name, size_t n) {
    if (n == 0 || n > MAX_NAME) return 0;
    for (size_t i = 0; i < n; i++) {
        char ch = name[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == ':' || ch == '-'))
            return 0;
    }
    return 1;
}

static uint32_t find_layer(const char *digest) {
    for (uint32_t i = 0; i < n_layers; i++)
        if (layers[i] && strcmp(layers[i]->digest, digest) == 0) return i + 1;
    return 0;
}

/* Put a loaded table in its layer id's place; the index + 1, or 0 (its id
   out of range, or another layer there: *err). Takes l (freed if unused). */
static uint32_t place_layer(struct layer *l, int *err) {
    uint32_t id = l->layer_id, i = 0;
    if (id >= MAX_LAYERS) { free_layer(l); *err = ENFILE; return 0; }
    pthread_rwlock_wrlock(&layers_lock);
    if (!layers[id]) {
        layers[id] = l;
        l = NULL;
        if (id + 1 > n_layers) n_layers = id + 1;
        i = id + 1;
    } else if (strcmp(layers[id]->digest, l->digest) == 0) {
        i = id + 1;  /* (another thread loaded it meanwhile) */
    }
    pthread_rwlock_unlock(&layers_lock);
    free_layer(l);
    if (!i) *err = EIO;  /* another layer under that id: not a table of the daemon's */
    return i;
}

/* The layer's index + 1 (loading its table, asking the daemon to write it
   first), or 0 and *err. */
static uint32_t layer_named(const char *digest, int *err) {
    pthread_rwlock_rdlock(&layers_lock);
    uint32_t i = find_layer(digest);
    pthread_rwlock_unlock(&layers_lock);
    if (i) return i;
    char path[4400], why[300];
    snprintf(path, sizeof path, "%s/%s.ext", tables_dir, digest);
    if (access(path, F_OK) != 0) {
        uint8_t m[8 + MAX_NAME] = {MSG_TABLE};
        size_t n = strlen(digest);  /* (<= MAX_NAME: valid_digest) */
        m[4] = (uint8_t)n;
        memcpy(m + 8, digest, n);
        int status = ask(m, 8 + n, NULL);
        if (status) { *err = status; return 0; }
    }
    struct layer *l = load_table(path, why, sizeof why);
    if (!l) {
        fprintf(stderr, "lazyfs-blobd: %s: %s\n", digest, why);
        *err = errno == ENOENT ? ENOENT : EIO;
        return 0;
    }
    snprintf(l->digest, sizeof l->digest, "%s", digest);
    return place_layer(l, err);
}

/* A layer the kernel names by an inode this server never gave out: one a
   dead server looked up (resume). Its table is the one with that layer id. */
static struct layer *layer_by_table(uint32_t id) {
    static pthread_mutex_t scan_mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&scan_mu);
    struct layer *found = NULL;
    DIR *d = opendir(tables_dir);
    struct dirent *de;
    while (d && !found && (de = readdir(d)) != NULL) {
        size_t n = strlen(de->d_name);
        if (n <= 4 || strcmp(de->d_name + n - 4, ".ext") != 0 || n - 4 > MAX_NAME ||
            !valid_digest(de->d_name, n - 4))
            continue;
        char path[4400], why[300];
        snprintf(path, sizeof path, "%s/%s", tables_dir, de->d_name);
        struct layer *l = load_table(path, why, sizeof why);
        if (!l) continue;
        if (l->layer_id != id) { free_layer(l); continue; }
        memcpy(l->digest, de->d_name, n - 4);
        l->digest[n - 4] = 0;
        int err = 0;
        uint32_t i = place_layer(l, &err);
        if (i) {
            pthread_rwlock_rdlock(&layers_lock);
            found = layers[i - 1];
            pthread_rwlock_unlock(&layers_lock);
        }
        break;
    }
    if (d) closedir(d);
    pthread_mutex_unlock(&scan_mu);
    return found;
}

static struct layer *layer_of(fuse_ino_t ino) {
    struct layer *l = NULL;
    pthread_rwlock_rdlock(&layers_lock);
    if (ino >= 2 && ino - 2 < n_layers) l = layers[ino - 2];
    pthread_rwlock_unlock(&layers_lock);
    if (!l && ino >= 2 && ino - 2 < MAX_LAYERS) l = layer_by_table((uint32_t)(ino - 2));
    return l;  /* (layers are never freed while serving) */
}

/* -- FUSE operations ---------------------------------------------------- */

static const double FOREVER = 86400.0;

static void fill_attr(struct stat *st, fuse_ino_t ino, uint64_t size) {
    memset(st, 0, sizeof *st);
    st->st_ino = ino;
    if (ino == FUSE_ROOT_ID) {
        st->st_mode = S_IFDIR | 0555;
        st->st_nlink = 2;
    } else {
        st->st_mode = S_IFREG | 0444;
        st->st_nlink = 1;
        st->st_size = (off_t)size;
        st->st_blocks = (blkcnt_t)(size / 512);
    }
    st->st_blksize = 4096;
}

static void op_init(void *userdata, struct fuse_conn_info *conn) {
    (void)userdata;
    conn->want &= ~FUSE_CAP_SPLICE_READ;
    if (conn->capable & FUSE_CAP_ASYNC_READ) conn->want |= FUSE_CAP_ASYNC_READ;
    conn->max_readahead = 0;
    conn->max_read = MAX_READ;  /* (as the mount's max_read) */
    /* serving now: the daemon may mount layers over this */
    uint8_t ready[MSG_SIZE] = {MSG_EVENT};
    send_msg(ready);  /* (kind 0: mounted) */
}

static void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name) {
    size_t n = strlen(name);
    if (parent != FUSE_ROOT_ID || n <= 5 || strcmp(name + n - 5, ".data") != 0 ||
        !valid_digest(name, n - 5)) {
        fuse_reply_err(req, ENOENT);
        return;
    }
    char digest[MAX_NAME + 1];
    memcpy(digest, name, n - 5);
    digest[n - 5] = 0;
    int err = ENOENT;
    uint32_t i = layer_named(digest, &err);
    if (!i) { fuse_reply_err(req, err); return; }
    struct fuse_entry_param e = {.ino = i + 1, .attr_timeout = FOREVER, .entry_timeout = FOREVER};
    fill_attr(&e.attr, e.ino, layer_of(e.ino)->size);
    fuse_reply_entry(req, &e);
}

static void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    (void)fi;
    struct stat st;
    struct layer *l = layer_of(ino);
    if (ino != FUSE_ROOT_ID && !l) { fuse_reply_err(req, ENOENT); return; }
    fill_attr(&st, ino, l ? l->size : 0);
    fuse_reply_attr(req, &st, FOREVER);
}

static void op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    if (!layer_of(ino)) { fuse_reply_err(req, ino == FUSE_ROOT_ID ? EISDIR : ENOENT); return; }
    if ((fi->flags & O_ACCMODE) != O_RDONLY) { fuse_reply_err(req, EROFS); return; }
    fi->direct_io = 1;  /* the EROFS mount over it caches pages itself */
    fi->keep_cache = 0;
    fuse_reply_open(req, fi);
}

static void op_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    if (ino != FUSE_ROOT_ID) { fuse_reply_err(req, ENOTDIR); return; }
    fuse_reply_open(req, fi);
}

static void op_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                       struct fuse_file_info *fi) {
    (void)fi;
    if (ino != FUSE_ROOT_ID) { fuse_reply_err(req, ENOTDIR); return; }
    char *buf = calloc(1, size);
    if (!buf) { fuse_reply_err(req, ENOMEM); return; }
    size_t used = 0;
    pthread_rwlock_rdlock(&layers_lock);
    for (uint32_t i = (uint32_t)off; i < n_layers; i++) {
        if (!layers[i]) continue;
        char name[MAX_NAME + 8];
        snprintf(name, sizeof name, "%s.data", layers[i]->digest);
        struct stat st;
        fill_attr(&st, i + 2, layers[i]->size);
        size_t n = fuse_add_direntry(req, buf + used, size - used, name, &st, (off_t)i + 1);
        if (n > size - used) break;
        used += n;
    }
    pthread_rwlock_unlock(&layers_lock);
    fuse_reply_buf(req, buf, used);
    free(buf);
}

static uint64_t now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000 + (uint64_t)t.tv_nsec / 1000;
}

/* -- reads in flight ------------------------------------------------------
   A read still unanswered after the fetch timeout (a hung disk under the
   store or the cache, a daemon that does not answer) gets EIO from the
   watchdog, as the Python path's timeout gives; the worker, when it ends,
   finds its request answered and drops what it had. The watchdog also
   ends the server when its session was asked to exit and the loop did not
   (workers stuck in a hung read cannot see it). */
#define INFLIGHT 256
static pthread_mutex_t inflight_mu = PTHREAD_MUTEX_INITIALIZER;
static struct { fuse_req_t req; uint64_t start; struct layer *layer; int used, answered; }
    inflight[INFLIGHT];

/* A slot for req (-1: none free: then it is not watched). */
static int watch_read(fuse_req_t req, struct layer *l, uint64_t start) {
    pthread_mutex_lock(&inflight_mu);
    int k = -1;
    for (int i = 0; i < INFLIGHT && k < 0; i++)
        if (!inflight[i].used) k = i;
    if (k >= 0) {
        inflight[k].req = req;
        inflight[k].start = start;
        inflight[k].layer = l;
        inflight[k].used = 1;
        inflight[k].answered = 0;
    }
    pthread_mutex_unlock(&inflight_mu);
    return k;
}

/* 1: the caller answers the request; 0: the watchdog did already. */
static int unwatch_read(int k) {
    if (k < 0) return 1;
    pthread_mutex_lock(&inflight_mu);
    int mine = !inflight[k].answered;
    inflight[k].used = 0;
    pthread_mutex_unlock(&inflight_mu);
    return mine;
}

static void *watchdog(void *arg) {
    (void)arg;
    uint64_t exit_seen = 0;
    for (;;) {
        struct timespec pause = {0, 200 * 1000 * 1000};
        nanosleep(&pause, NULL);
        uint64_t now = now_us(), limit = (uint64_t)fetch_timeout_s * 1000000;
        struct layer *late[INFLIGHT];
        int n_late = 0;
        pthread_mutex_lock(&inflight_mu);
        for (int i = 0; i < INFLIGHT; i++)
            if (inflight[i].used && !inflight[i].answered && now - inflight[i].start > limit) {
                inflight[i].answered = 1;
                fuse_reply_err(inflight[i].req, EIO);
                late[n_late++] = inflight[i].layer;
            }
        pthread_mutex_unlock(&inflight_mu);
        for (int i = 0; i < n_late; i++) {
            uint8_t m[64] = {MSG_EVENT};
            put32(m + 4, late[i]->layer_id);
            put32(m + 8, UINT32_MAX);
            put32(m + 12, EV_TIMEOUT);
            send_msg(m);
        }
        if (session && fuse_session_exited(session)) {
            if (!exit_seen) exit_seen = now;
            else if (now - exit_seen > 2000000) {
                fprintf(stderr, "lazyfs-blobd: reads still hung at exit; detaching the mount\n");
                umount2(mountpoint, MNT_DETACH);
                _exit(1);
            }
        }
    }
    return NULL;
}

/* The first segment of l ending past pos. */
static uint32_t seg_after(const struct layer *l, uint64_t pos) {
    uint32_t lo = 0, hi = l->n_segs;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (l->segs[mid].off + l->segs[mid].len <= pos) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                    struct fuse_file_info *fi) {
    (void)fi;
    struct layer *l = layer_of(ino);
    if (!l) { fuse_reply_err(req, ENOENT); return; }
    uint64_t t0 = now_us();
    if (size > MAX_READ) { fuse_reply_err(req, EINVAL); return; }  /* (max_read says not) */
    if (off < 0 || (uint64_t)off >= l->size || size == 0) { fuse_reply_buf(req, NULL, 0); return; }
    uint64_t start = (uint64_t)off, end = start + size;
    if (end > l->size) end = l->size;
    uint32_t pid = (uint32_t)fuse_req_ctx(req)->pid;  /* (req is not ours once the watchdog answered) */
    int watched = watch_read(req, l, t0);
    uint32_t first = seg_after(l, start), last = seg_after(l, end);
    /* (segments first..last-1 may intersect the range, last may too) */
    uint32_t n_segs = last - first + (last < l->n_segs);
    /* Each piece of the reply is a chunk's bytes (held in the hot set
       until sent) or zeros; a read of more pieces than one writev takes
       (a hostile image's tiny extents) is copied into one buffer instead.
       Never a short read: a direct_io reader takes it as the end. */
    int bounce = n_segs * 2 + 2 > IOV_CAP;
    uint8_t *buf = bounce ? calloc(1, end - start) : NULL;
    if (bounce && !buf) {
        if (unwatch_read(watched)) fuse_reply_err(req, ENOMEM);
        return;
    }
    struct iovec iov[IOV_CAP];
    struct slot *held[IOV_CAP / 2];
    int n_iov = 0, n_held = 0, err = 0;
    uint16_t got[4] = {0, 0, 0, 0};
    uint64_t pack_bytes = 0, fetched_bytes = 0, pos = start;
    for (uint32_t i = first; i < l->n_segs && !err; i++) {
        const struct seg *g = &l->segs[i];
        if (g->off >= end) break;
        if (g->off > pos) {  /* a gap: zeros */
            if (!bounce) iov[n_iov++] = (struct iovec){(void *)zeros, g->off - pos};
            pos = g->off;
        }
        int from = GOT_HOT;
        struct slot *s = get_slot(l, g->chunk, &err, &from);
        if (!s) break;
        got[from]++;
        if (from == GOT_PACK) pack_bytes += s->len;
        else if (from == GOT_FETCHED) fetched_bytes += s->len;
        uint64_t a = pos - g->off, b = g->len;
        if (g->off + b > end) b = end - g->off;
        __atomic_add_fetch(&s->served, b - a, __ATOMIC_RELAXED);
        if (bounce) {
            memcpy(buf + (pos - start), s->data + g->chunk_off + a, b - a);
            put_slot(s);
        } else {
            held[n_held++] = s;
            iov[n_iov++] = (struct iovec){s->data + g->chunk_off + a, b - a};
        }
        pos = g->off + b;
    }
    if (!err && pos < end && !bounce)  /* zeros to the end of the range */
        iov[n_iov++] = (struct iovec){(void *)zeros, end - pos};
    /* the request is this worker's to answer, unless the watchdog did */
    int mine = unwatch_read(watched);
    if (mine && !err) {
        /* accounted before it is served: a read the daemon never heard of
           is never answered with bytes */
        uint8_t m[MSG_SIZE] = {MSG_REPORT};
        put32(m + 4, l->layer_id);
        put64(m + 8, start);
        put32(m + 16, (uint32_t)(end - start));
        put32(m + 20, pid);
        put16(m + 24, got[GOT_HOT]);
        put16(m + 26, got[GOT_CACHE]);
        put16(m + 28, got[GOT_PACK]);
        put16(m + 30, got[GOT_FETCHED]);
        put64(m + 32, pack_bytes);
        put64(m + 40, fetched_bytes);
        put64(m + 48, now_us() - t0);
        if (send_msg(m) < 0) err = EIO;
    }
    if (mine) {  /* (else: answered EIO already, too late, and not reported) */
        if (err) fuse_reply_err(req, err);
        else if (bounce) fuse_reply_buf(req, (const char *)buf, end - start);
        else fuse_reply_iov(req, iov, n_iov);
    }
    for (int k = 0; k < n_held; k++) put_slot(held[k]);
    free(buf);
}

static const struct fuse_lowlevel_ops ops = {
    .init = op_init,
    .lookup = op_lookup,
    .getattr = op_getattr,
    .open = op_open,
    .opendir = op_opendir,
    .readdir = op_readdir,
    .read = op_read,
};

/* Take over a connection a dead server served (see the top): libfuse is
   told the connection is initialised by an INIT of our own making (its
   reply goes to the kernel, which knows no such request and drops it), then
   the kernel sends again what the dead server had read but not answered. */
enum { NOTIFY_RESEND = 7 };  /* FUSE_NOTIFY_RESEND (Linux 6.9; not in older headers) */

static int resume_session(void) {
    struct {
        struct fuse_in_header h;
        struct fuse_init_in i;
    } in;
    memset(&in, 0, sizeof in);
    in.h.len = sizeof in;
    in.h.opcode = FUSE_INIT;
    in.h.unique = UINT64_C(1) << 62;  /* (no request of the kernel's has it) */
    in.i.major = FUSE_KERNEL_VERSION;
    in.i.minor = FUSE_KERNEL_MINOR_VERSION;
    /* (as the kernel's first INIT offered: libfuse sizes its read buffer by
       them, and the kernel, which keeps the first INIT's terms, wants it
       as large as max_write) */
    in.i.flags = FUSE_ASYNC_READ | FUSE_BIG_WRITES | FUSE_MAX_PAGES;
    struct fuse_buf b = {.size = sizeof in, .mem = &in};
    fuse_session_process_buf(session, &b);
    struct fuse_out_header oh = {.len = sizeof oh, .error = NOTIFY_RESEND, .unique = 0};
    if (write(fuse_fd, &oh, sizeof oh) != (ssize_t)sizeof oh) {
        fprintf(stderr, "lazyfs-blobd: the kernel would not resend the dead server's "
                        "requests: %s\n", strerror(errno));
        return -1;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "--check") == 0) {
        char why[300];
        struct layer *l = load_table(argv[2], why, sizeof why);
        if (!l) { fprintf(stderr, "lazyfs-blobd: %s\n", why); return 1; }
        printf("layer %u: %llu bytes, %u chunks, %u segments\n", l->layer_id,
               (unsigned long long)l->size, l->n_chunks, l->n_segs);
        free_layer(l);
        return 0;
    }
    int resume = 0;
    if (argc > 6) {
        char *end;
        long fd = strtol(argv[6], &end, 10);
        if (*end || fd < 0 || fd > 1 << 20 || fcntl((int)fd, F_GETFD) < 0) {
            fprintf(stderr, "lazyfs-blobd: FUSE_FD %s: not an open descriptor\n", argv[6]);
            return 2;
        }
        fuse_fd = (int)fd;
    }
    if (argc > 7) resume = strcmp(argv[7], "resume") == 0 ? 1 : -1;
    if (argc < 4 || argc > 8 || resume < 0) {
        fprintf(stderr, "usage: lazyfs-blobd MOUNTPOINT TABLES SOCKET [HOT_MIB] [TIMEOUT_S] "
                        "[FUSE_FD [resume]]\n"
                        "       lazyfs-blobd --check TABLE\n");
        return 2;
    }
    mountpoint = argv[1];
    tables_dir = argv[2];
    sock_path = argv[3];
    if (argc > 4) hot_limit = (uint64_t)strtoul(argv[4], NULL, 10) << 20;
    if (argc > 5) fetch_timeout_s = atoi(argv[5]);
    if (fetch_timeout_s < 1) fetch_timeout_s = 1;
    /* (installed first: libfuse's handlers leave a handler that is not the default) */
    struct sigaction hup = {.sa_handler = on_parent_death};
    sigemptyset(&hup.sa_mask);
    sigaction(SIGHUP, &hup, NULL);
    prctl(PR_SET_PDEATHSIG, SIGHUP);  /* the daemon that started us is what accounts */
    pid_t parent = getppid();
    if (parent == 1) return 1;
    char gpath[4200];
    snprintf(gpath, sizeof gpath, "%s/generation", tables_dir);
    int gfd = open(gpath, O_RDWR | O_CLOEXEC);
    struct stat gst;
    if (gfd >= 0 && fstat(gfd, &gst) == 0 && gst.st_size >= 8) {
        void *g = mmap(NULL, 8, PROT_READ, MAP_SHARED, gfd, 0);
        if (g != MAP_FAILED) generation = g;
    }
    if (gfd >= 0) close(gfd);
    if (!generation) {
        fprintf(stderr, "lazyfs-blobd: %s: cannot be mapped\n", gpath);
        return 1;
    }
    seen_generation = *generation;
    /* the first connection proves the daemon listens before anything mounts */
    if (connect_daemon() < 0) {
        fprintf(stderr, "lazyfs-blobd: cannot reach the daemon at %s\n", sock_path);
        return 1;
    }
    char *fargs[] = {argv[0], "-o", "ro,allow_other,fsname=lazyfs-blobs,subtype=lazyfs-blobs,"
                                    "default_permissions,max_read=1048576", NULL};
    struct fuse_args args = FUSE_ARGS_INIT(3, fargs);
    session = fuse_session_new(&args, &ops, sizeof ops, NULL);
    if (!session) return 1;
    char fd_path[32];  /* libfuse takes "/dev/fd/N" as a mounted connection */
    snprintf(fd_path, sizeof fd_path, "/dev/fd/%d", fuse_fd);
    if (fuse_set_signal_handlers(session) != 0 ||
        fuse_session_mount(session, fuse_fd >= 0 ? fd_path : argv[1]) != 0 ||
        (resume && resume_session() != 0)) {
        fuse_session_destroy(session);
        return 1;
    }
    if (parent_died || getppid() != parent) fuse_session_exit(session);  /* (it died meanwhile) */
    pthread_t dog;
    if (pthread_create(&dog, NULL, watchdog, NULL) != 0) {
        fuse_session_unmount(session);
        fuse_session_destroy(session);
        return 1;
    }
    pthread_detach(dog);
    struct fuse_loop_config *cfg = fuse_loop_cfg_create();
    fuse_loop_cfg_set_max_threads(cfg, 32);
    fuse_loop_cfg_set_idle_threads(cfg, 8);
    int r = fuse_session_loop_mt(session, cfg);
    fuse_loop_cfg_destroy(cfg);
    fuse_session_unmount(session);  /* (in fd mode the daemon's mount: not ours to undo...) */
    if (fuse_fd >= 0 && (daemon_gone || parent_died || getppid() != parent))
        umount2(mountpoint, MNT_DETACH);  /* (...unless it died) */
    fuse_remove_signal_handlers(session);
    fuse_session_destroy(session);
    return r < 0 ? 1 : 0;
}
