/* toymlx_malloc, toymlx_free: libmlx.so's malloc and free (their slots are pointed here by
 * toymlx/backend/aligned_buffers.py, which says why), so that an MLX array's data starts on a
 * 64-byte boundary.
 *
 * MLX's CPU allocator asks malloc for 8 bytes more than a buffer, keeps the size in those 8
 * and hands out the rest: glibc's 16-byte aligned block + 8. Here a block of at least SMALL
 * bytes is placed so that the pointer returned sits 8 bytes before a 64-byte boundary; the
 * block glibc gave is kept in the 8 bytes before that pointer's 8, for free. glibc's own
 * pointers are 16-byte aligned, never 56 past a 64-byte boundary, so free tells the two apart
 * by the address alone.
 *
 * The block is a plain malloc of SLACK bytes more, not posix_memalign: memalign splits a
 * small chunk off each block's front, and those chunks kept freed neighbours from merging, so
 * a training step's heap grew by 4 MiB every few steps (new pages, faulted in) instead of
 * reusing the first step's. */
#include <stdint.h>
#include <stdlib.h>

enum {
    SMALL = 4096,
    ALIGN = 64,
    OURS = ALIGN - 8,  /* the returned pointer's place past a 64-byte boundary */
    KEEP = 2 * sizeof(void *),  /* room before it for the block's own address */
    SLACK = OURS + KEEP,  /* the furthest the pointer lies into a 16-byte aligned block */
};

void *toymlx_malloc(size_t n) {
    if (n < SMALL) return malloc(n);
    if (n > SIZE_MAX - SLACK) return NULL;
    char *block = malloc(n + SLACK);
    if (block == NULL) return NULL;
    uintptr_t at = (uintptr_t)block + KEEP;  /* the first place with room for the address */
    char *p = block + KEEP + ((OURS - at % ALIGN) + ALIGN) % ALIGN;
    ((void **)p)[-2] = block;
    return p;
}

void toymlx_free(void *p) {
    if (((uintptr_t)p & (ALIGN - 1)) == OURS) free(((void **)p)[-2]);
    else free(p);
}
