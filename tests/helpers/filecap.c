/* filecap: a file capability set and read from inside a sandbox, as setcap
 * and getcap do it (tests/test_sandbox_userns.py copies a static build in).
 *
 *   filecap set PATH    security.capability := CAP_DAC_READ_SEARCH, permitted
 *                       and effective, written as revision 2: the kernel
 *                       records it for the root of the writer's user namespace
 *                       (revision 3 with that root's host id)
 *   filecap get PATH    "rev R permitted P rootid U" as the reader's namespace
 *                       sees it (rootid only for revision 3), or "error E"
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/xattr.h>

#define CAP_DAC_READ_SEARCH 2

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: filecap set|get PATH\n"); return 2; }
    uint32_t v[6] = {0};
    if (!strcmp(argv[1], "set")) {
        v[0] = 0x02000000u | 1u;              /* VFS_CAP_REVISION_2 | VFS_CAP_FLAGS_EFFECTIVE */
        v[1] = 1u << CAP_DAC_READ_SEARCH;     /* permitted, low word */
        if (setxattr(argv[2], "security.capability", v, 20, 0) != 0) {
            printf("error %d\n", errno);
            return 1;
        }
        printf("set\n");
        return 0;
    }
    ssize_t n = getxattr(argv[2], "security.capability", v, sizeof v);
    if (n < 0) { printf("error %d\n", errno); return 0; }
    printf("rev %u permitted %#x", v[0] >> 24, v[1]);
    if (n == 24) printf(" rootid %u", v[5]);
    printf("\n");
    return 0;
}
