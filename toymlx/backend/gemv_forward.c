/* toymlx_sgemm: a cblas_sgemm in front of OpenBLAS's (libmlx.so's cblas_sgemm slot is pointed
 * at it) that sends one-row products to cblas_sgemv
 * (toymlx/gemv_forward.py builds and loads it; the reasons are there).
 *
 * C = alpha op(A) op(B) + beta C, row-major, M == 1:
 *   C's one row = alpha op(B)^T a + beta c, a = op(A)'s one row
 * Everything else goes to OpenBLAS's cblas_sgemm unchanged: column-major calls, and one-column
 * products (N == 1: the row sums of toymlx.fastmath's norms), where single-threaded sgemv, as
 * the CPU-stream step runs it, was no faster than sgemm on short rows. With beta == 0 gemm never reads C (MLX hands it uninitialised memory), while
 * sgemv scales y by beta first, and 0 * NaN is NaN: C is zeroed here before. */
#include <dlfcn.h>
#include <string.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);

static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;
static unsigned long forwarded;

/* Point the forwarder at the BLAS in `path` (already loaded), whose functions are named
 * `sgemm` and `sgemv` there (cblas_sgemm, or scipy_cblas_sgemm for pip's OpenBLAS); 0 on
 * success. */
int toymlx_gemv_forward_init(const char *path, const char *sgemm, const char *sgemv) {
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) return 1;
    real_sgemm = (sgemm_fn)dlsym(lib, sgemm);
    real_sgemv = (sgemv_fn)dlsym(lib, sgemv);
    return real_sgemm && real_sgemv ? 0 : 2;
}

/* How many products went to sgemv (for the tests). */
unsigned long toymlx_gemv_forward_count(void) {
    return __atomic_load_n(&forwarded, __ATOMIC_RELAXED);
}

void toymlx_sgemm(int order, int trans_a, int trans_b, int M, int N, int K, float alpha,
                 const float *A, int lda, const float *B, int ldb, float beta, float *C,
                 int ldc) {
    if (order == ROW_MAJOR && M == 1 && N > 1 && K > 0) {
        __atomic_fetch_add(&forwarded, 1, __ATOMIC_RELAXED);
        /* a: A's row (NO_TRANS: 1 x K, contiguous) or column (TRANS: K x 1, stride lda);
         * op(B)^T is B itself (TRANS: N x K) or B transposed (NO_TRANS: K x N). */
        if (beta == 0.0f) memset(C, 0, (size_t)N * sizeof(float));
        int inc_a = trans_a == NO_TRANS ? 1 : lda;
        if (trans_b == TRANS)
            real_sgemv(ROW_MAJOR, NO_TRANS, N, K, alpha, B, ldb, A, inc_a, beta, C, 1);
        else
            real_sgemv(ROW_MAJOR, TRANS, K, N, alpha, B, ldb, A, inc_a, beta, C, 1);
        return;
    }
    real_sgemm(order, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
