/* toymlx_malloc, toymlx_free: libmlx.so's malloc and free (their slots are pointed here by
 * toymlx/backend/aligned_buffers.py, which says why), so that an MLX array's data starts on a
 * 64-byte boundary.
 *
 * MLX's CPU allocator asks malloc for 8 bytes more than a buffer, keeps the size in those 8
 * and hands out the rest: glibc's 16-byte aligned block + 8. Here a block of at least SMALL
 * bytes is placed so that the pointer returned sits 8 bytes before a 64-byte boundary; the
 * block glibc gave is kept in the 8 bytes before that pointer's 8, for free. glibc's own
 * pointers are 16-byte aligned, never 56 past a 64-byte boundary, so free tells the two apart
 * by the address alone. */
#include <stdint.h>
#include <stdlib.h>

enum { SMALL = 4096, ALIGN = 64, OURS = ALIGN - 8 };

void *toymlx_malloc(size_t n) {
    if (n < SMALL) return malloc(n);
    if (n > SIZE_MAX - ALIGN) return NULL;
    void *block;
    if (posix_memalign(&block, ALIGN, n + ALIGN) != 0) return NULL;
    char *p = (char *)block + OURS;
    ((void **)p)[-2] = block;
    return p;
}

void toymlx_free(void *p) {
    if (((uintptr_t)p & (ALIGN - 1)) == OURS) free(((void **)p)[-2]);
    else free(p);
}
