// The whole training step in one persistent kernel, for models small enough that the per-kernel step is a chain
// of latency-bound launches (docs/perf.md: ~4 us per node at hidden <= 1024, each GEMM filling 1-14 SMs).
//
// One CTA per SM stays resident for n_steps steps. A step is a fixed sequence of phases separated by grid-wide
// barriers (grid_sync.cuh); inside a phase every task is independent:
//   forward, layer 0      32x32 output tiles of relu(x W0 + b0); x gathered from the uint8 images into shared
//                         memory (tiles in column 0 also store it for the backward pass)
//   forward, layer i      32x32 tiles of relu(h W_i + b_i)
//   head (last layer)     per 32 rows: logits, softmax cross-entropy, d(logits)
//   below the head        32x32 tiles of dx = (d(logits) W^T) * relu'(h), K = 16  [warp tasks]
//                         the head's dW + SGD, its bias, the loss metrics         [warp tasks]
//   backward, layer i     32x32 tiles of dx_i = (dy W_i^T) * relu'(x)            [CTA tasks]
//                         32x32 tiles of dW_i = x^T dy with the SGD update fused   [warp tasks]
//                         32-column blocks of the bias gradient + update          [warp tasks]
// So hidden layers L give 2L + 2 phases per step, each ending in a barrier (the last step's last one excepted).
//
// A CTA task is one 32x32 block whose K chunks (32 wide) the 8 warps share (warp w: chunks w, w + 8, ...); the
// partial blocks are summed in warp order through shared memory. A warp task is a 32x32 block computed by one
// warp (K = the batch). Every sum has a fixed order, so results are bitwise reproducible.
//
// Weight update hazard: a backward phase reads W16 (for dx) while other warps update it. So the fp16 working
// copy is double-buffered: step s reads copy s & 1 and writes copy (s + 1) & 1. The master weights (master.cuh)
// are (copy s & 1, lo) before step s and (copy (s + 1) & 1, lo) after it; lo is read and written by its own dW
// task only.
#include "common.cuh"
#include "mma.cuh"
#include "ldmatrix.cuh"
#include "cp_async.cuh"
#include "grid_sync.cuh"
#include "step_math.cuh"
#include "master.cuh"

#define FS_WARPS 8
#define FS_THREADS (FS_WARPS * 32)
#define FS_T 32                      // tile edge: 32x32 output blocks, K in chunks of 32
#define FS_LD (FS_T + 8)             // shared row stride in halves: 80 bytes, conflict-free ldmatrix
#define FS_TILE (FS_T * FS_LD)       // halves per staged 32x32 tile
#define FS_INPUTS 784
#define FS_PANEL_LD 808              // gathered input rows: 25 whole chunks (800) + 8 halves of padding
#define FS_MAX_LAYERS 65
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 870 || __CUDA_ARCH__ == 890)
#define FS_STAGES 2  // these parts give a block 99 KB of shared memory
#else
#define FS_STAGES 4
#endif
#define FS_WARP_HALVES (FS_STAGES * 2 * FS_TILE)  // a warp's pipeline: STAGES x (A tile + B tile)
#define FS_STAGING_BYTES (FS_WARPS * FS_WARP_HALVES * 2)
#define FS_PANEL_BYTES (FS_T * FS_PANEL_LD * 2)
#define FS_LAYER0_BYTES (FS_PANEL_BYTES + FS_WARPS * FS_STAGES * FS_TILE * 2)
#define FS_SMEM_BYTES (FS_STAGING_BYTES > FS_LAYER0_BYTES ? FS_STAGING_BYTES : FS_LAYER0_BYTES)
#define FS_RED_BYTES (FS_WARPS * FS_T * FS_T * 4)  // the split-K partials, aliasing the staging buffers

enum Layout { ROW = 0, COL = 1 };

// kernels/fused.py writes this table into the arena (every field 8 bytes, in this order).
struct FsLayer {
    short* wlo;       // the master's low half [in_p, out_p] (master.cuh)
    half_t* w16[2];   // fp16 working copies, double-buffered: the master's high half
    float* b;         // bias [out_p]
    float* mw;        // momentum (nullptr without)
    float* mb;
    half_t* x;        // input activation [batch, in_p] (layer 0: written here, from the gather)
    half_t* y;        // output activation [batch, out_p] (unused for the last layer)
    half_t* dy;       // gradient at the output [batch, out_p] (the last layer: d(logits))
    half_t* dx;       // gradient at the input [batch, in_p] (nullptr for layer 0)
    i64 in_p, out_p;  // padded widths (multiples of 8; the last out_p is 16)
};

struct FsParams {
    const u8* images;  // [rows, 784]
    const u8* labels;
    const int* perm;   // this epoch's sample order
    i64* step;         // the step counter: read at start, advanced by n_steps at the end
    double* loss_sum;
    int* correct;
    float* row_loss;   // [batch]: per-row loss and hit, summed by one warp in the next phase
    int* row_hit;
    u64* barrier;      // grid barrier counter (a multiple of the grid size between launches)
    i64 batch, steps_per_epoch, layers, schedule, total_steps, warmup_steps, classes;
    u64* profile;      // with -DFS_PROFILE: block 0 stamps %globaltimer here after every phase (else unused)
    double lr0, lr_min, mu, dlogit_scale;  // lr0 and lr_min already divided by the loss scale
    FsLayer layer[FS_MAX_LAYERS];
};

struct FsStep {
    i64 base;  // first index into perm of this step's batch
    int rd;    // W16 copy this step reads; it writes rd ^ 1
    float lr;
};

RG_DEVICE bool positive_f16(u32 h) { return (h & 0x8000u) == 0 && (h & 0x7FFFu) != 0; }

// Copy the 32x32 block at (r0, c0) of a row-major [R, C] fp16 matrix (leading dimension ld) into shared s[32][FS_LD],
// zero-filling outside; C and ld are multiples of 8, so each 16-byte piece is wholly in or out. One warp: 4 each.
RG_DEVICE void warp_load_tile(half_t* s, const half_t* g, i64 ld, int r0, int c0, i64 R, i64 C, int lane) {
#pragma unroll
    for (int it = 0; it < 4; ++it) {
        const int i = it * 32 + lane, r = i / 4, c = (i % 4) * 8;
        const bool valid = r0 + r < R && c0 + c < C;
        cp_async_16(s + r * FS_LD + c, valid ? g + (r0 + r) * ld + c0 + c : g, valid);
    }
}

// acc[i][j] is the m16n8 tile (16 i, 8 j) of a warp's 32x32 block; fragment layouts in mma.cuh.
typedef float Acc[2][4][4];

RG_DEVICE void zero_acc(Acc& acc) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
}

// acc += A (32 x 32 chunk) @ B (32 x 32 chunk). A sits in shared memory as stored in global memory (ROW: [m][k],
// row stride lda; COL: [k][m]); B likewise (ROW: [k][n], COL: [n][k]) with stride FS_LD.
template <int LA, int LB>
RG_DEVICE void warp_mma_chunk(Acc& acc, const half_t* a, int lda, const half_t* b, int lane) {
    const int r8 = lane % 8, q1 = (lane / 8) % 2, q2 = lane / 16;
#pragma unroll
    for (int kk = 0; kk < FS_T; kk += 16) {
        u32 fa[2][4], fb[4][2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            if (LA == ROW) ldmatrix_x4(fa[i], shared_address(a + (16 * i + r8 + 8 * q1) * lda + kk + 8 * q2));
            else           ldmatrix_x4_trans(fa[i], shared_address(a + (kk + r8 + 8 * q2) * lda + 16 * i + 8 * q1));
        }
#pragma unroll
        for (int j = 0; j < 4; j += 2) {
            u32 r[4];
            if (LB == COL) ldmatrix_x4(r, shared_address(b + (8 * j + r8 + 8 * q2) * FS_LD + kk + 8 * q1));
            else           ldmatrix_x4_trans(r, shared_address(b + (kk + r8 + 8 * q1) * FS_LD + 8 * j + 8 * q2));
            fb[j][0] = r[0]; fb[j][1] = r[1]; fb[j + 1][0] = r[2]; fb[j + 1][1] = r[3];
        }
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) mma_m16n8k16_f32(acc[i][j], fa[i], fb[j]);
    }
}

// One warp accumulates chunks first, first + stride, ... (< chunks) through its own STAGES-deep cp.async
// pipeline. A stage holds the chunk's A tile then its B tile (A_STAGED), or only the B tile when A already sits in
// shared memory (the gathered input panel). load(buf, kc) issues chunk kc's copies into stage buffer buf;
// a_of(buf, kc, lda) says where chunk kc's A tile is and its row stride.
template <int LA, int LB, bool A_STAGED, class Load, class AOf>
RG_DEVICE void warp_accumulate(Acc& acc, half_t* pipe, int first, int stride, int chunks, Load load, AOf a_of,
                               int lane) {
    constexpr int STAGE = A_STAGED ? 2 * FS_TILE : FS_TILE;
    const int n = first < chunks ? (chunks - first + stride - 1) / stride : 0;
#pragma unroll
    for (int s = 0; s < FS_STAGES - 1; ++s) {
        if (s < n) load(pipe + s * STAGE, first + s * stride);
        cp_async_commit();
    }
    for (int i = 0; i < n; ++i) {
        cp_async_wait<FS_STAGES - 2>();
        __syncwarp();  // chunk i landed for every lane; every lane is done with chunk i - 1's buffer
        const int next = i + FS_STAGES - 1;
        if (next < n) load(pipe + (next % FS_STAGES) * STAGE, first + next * stride);
        cp_async_commit();
        half_t* buf = pipe + (i % FS_STAGES) * STAGE;
        int lda = FS_LD;
        const half_t* a = a_of(buf, first + i * stride, lda);
        warp_mma_chunk<LA, LB>(acc, a, lda, A_STAGED ? buf + FS_TILE : buf, lane);
    }
    cp_async_wait<0>();
    __syncwarp();
}

// Element v (0..31) of a lane's accumulators is the output at this (row, col) of the 32x32 block.
RG_DEVICE int acc_row(int v, int lane) { return 16 * (v >> 4) + lane / 4 + 8 * ((v >> 1) & 1); }
RG_DEVICE int acc_col(int v, int lane) { return 8 * ((v >> 2) & 3) + 2 * (lane % 4) + (v & 1); }
RG_DEVICE float& acc_at(Acc& acc, int v) { return acc[v >> 4][(v >> 2) & 3][v & 3]; }

// The CTA's 8 warps split the chunks of one 32x32 block, then sum their partials in warp order into out[32][33].
template <int LA, int LB, bool A_STAGED, class Load, class AOf>
RG_DEVICE void cta_block(float* out, half_t* pipes, int chunks, Load load, AOf a_of, u8* smem) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    Acc acc;
    zero_acc(acc);
    warp_accumulate<LA, LB, A_STAGED>(acc, pipes + warp * FS_STAGES * (A_STAGED ? 2 : 1) * FS_TILE, warp, FS_WARPS,
                                      chunks, load, a_of, lane);
    __syncthreads();  // every warp is done with its pipeline (and the panel): the partials reuse that memory
    float* red = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int v = 0; v < 32; ++v) red[warp * 1024 + v * 32 + lane] = acc_at(acc, v);
    __syncthreads();
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const int e = threadIdx.x + q * FS_THREADS, v = e / 32, l = e % 32;
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < FS_WARPS; ++w) sum += red[w * 1024 + e];
        out[acc_row(v, l) * 33 + acc_col(v, l)] = sum;
    }
    __syncthreads();
}

// Tasks of a phase: CTA tasks on CTAs 0, 1, ...; warp tasks spread from the last CTA down, one warp per CTA first.
RG_DEVICE int warp_worker() {
    return (threadIdx.x / 32) * gridDim.x + (gridDim.x - 1 - blockIdx.x);
}

RG_DEVICE int cdiv(i64 a, int b) { return (int)((a + b - 1) / b); }

// ---- phases ---------------------------------------------------------------------------------------------------

// Forward through layer i (not the last): y = relu(x W + b), 32x32 blocks. Layer 0 gathers its input rows.
RG_DEVICE void phase_forward(const FsParams& P, int i, const FsStep& st, u8* smem) {
    const FsLayer& Ly = P.layer[i];
    const int B = (int)P.batch, tid = threadIdx.x, lane = tid % 32;
    const int mt = cdiv(B, FS_T), nt = cdiv(Ly.out_p, FS_T), kchunks = cdiv(Ly.in_p, FS_T);
    const half_t* W = Ly.w16[st.rd];
    float* out = reinterpret_cast<float*>(smem + FS_RED_BYTES);
    for (int t = blockIdx.x; t < mt * nt; t += gridDim.x) {
        const int m0 = (t / nt) * FS_T, n0 = (t % nt) * FS_T;
        const int c = 2 * (tid % 16), col = n0 + c;  // the epilogue's columns, bias loaded before the K loop
        const float2 bias = col < Ly.out_p ? load_cg_f2(Ly.b + col) : make_float2(0.f, 0.f);
        if (i == 0) {
            // Gather rows m0.. of the batch (bytes -> fp16 / 255) into the panel; zero past the row and the batch.
            half_t* panel = reinterpret_cast<half_t*>(smem);
            constexpr int PIECES = FS_INPUTS / 16;  // 49 16-byte pieces per image row
            uint4 raw[(FS_T * PIECES + FS_THREADS - 1) / FS_THREADS];
#pragma unroll
            for (int it = 0; it < (FS_T * PIECES + FS_THREADS - 1) / FS_THREADS; ++it) {
                const int e = tid + it * FS_THREADS, r = e / PIECES, c = e % PIECES;
                raw[it] = make_uint4(0, 0, 0, 0);
                if (e < FS_T * PIECES && m0 + r < B) {
                    const i64 src = P.perm[st.base + m0 + r];
                    raw[it] = load_16(P.images + src * FS_INPUTS + c * 16);
                }
            }
#pragma unroll
            for (int it = 0; it < (FS_T * PIECES + FS_THREADS - 1) / FS_THREADS; ++it) {
                const int e = tid + it * FS_THREADS, r = e / PIECES, c = e % PIECES;
                if (e < FS_T * PIECES) {
                    uint4 lo, hi;
                    bytes16_to_f16(raw[it], lo, hi);
                    store_16(panel + r * FS_PANEL_LD + c * 16, lo);
                    store_16(panel + r * FS_PANEL_LD + c * 16 + 8, hi);
                    if (n0 == 0 && m0 + r < B) {
                        half_t* x = Ly.x + (i64)(m0 + r) * FS_INPUTS + c * 16;
                        store_16(x, lo);
                        store_16(x + 8, hi);
                    }
                }
            }
            for (int e = tid; e < FS_T * 3; e += FS_THREADS)  // columns 784..807: 3 pieces of 8 halves per row
                store_16(panel + (e / 3) * FS_PANEL_LD + FS_INPUTS + (e % 3) * 8, make_uint4(0, 0, 0, 0));
            __syncthreads();
            auto load = [&](half_t* buf, int kc) {
                warp_load_tile(buf, W, Ly.out_p, kc * FS_T, n0, Ly.in_p, Ly.out_p, lane);
            };
            auto a_of = [&](half_t*, int kc, int& lda) -> const half_t* {
                lda = FS_PANEL_LD;
                return panel + kc * FS_T;
            };
            cta_block<ROW, ROW, false>(out, panel + FS_T * FS_PANEL_LD, kchunks, load, a_of, smem);
        } else {
            auto load = [&](half_t* buf, int kc) {
                warp_load_tile(buf, Ly.x, Ly.in_p, m0, kc * FS_T, B, Ly.in_p, lane);
                warp_load_tile(buf + FS_TILE, W, Ly.out_p, kc * FS_T, n0, Ly.in_p, Ly.out_p, lane);
            };
            auto a_of = [&](half_t* buf, int, int& lda) -> const half_t* { lda = FS_LD; return buf; };
            cta_block<ROW, ROW, true>(out, reinterpret_cast<half_t*>(smem), kchunks, load, a_of, smem);
        }
        // Epilogue: + bias, ReLU, fp16; a thread writes 2 rows x 2 columns.
        if (col < Ly.out_p) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = tid / 16 + 16 * h, row = m0 + r;
                if (row < B) {
                    const float v0 = fmaxf(out[r * 33 + c] + bias.x, 0.f), v1 = fmaxf(out[r * 33 + c + 1] + bias.y, 0.f);
                    *reinterpret_cast<u32*>(Ly.y + (i64)row * Ly.out_p + col) = pack_f16x2(v0, v1);
                }
            }
        }
        __syncthreads();  // `out` and the panel are reused by the next task
    }
}

// The last layer for rows m0..m0+31: logits = x W + b (rounded to fp16, as the per-kernel step stores them), then
// softmax cross-entropy: per-row loss and hit, and d(logits) scaled by S / B (fp16, to dy).
RG_DEVICE void phase_head(const FsParams& P, int i, const FsStep& st, u8* smem) {
    const FsLayer& Ly = P.layer[i];
    const int B = (int)P.batch, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int classes = (int)P.classes;
    const half_t* W = Ly.w16[st.rd];
    float* out = reinterpret_cast<float*>(smem + FS_RED_BYTES);
    const float scale = (float)P.dlogit_scale;
    const float bias = lane < classes ? load_cg_f32(Ly.b + lane) : 0.f;
    for (int t = blockIdx.x; t < cdiv(B, FS_T); t += gridDim.x) {
        const int m0 = t * FS_T;
        int labels[FS_T / FS_WARPS];  // this warp's rows' labels, fetched (perm, then label) under the K loop
#pragma unroll
        for (int q = 0; q < FS_T / FS_WARPS; ++q) {
            const int row = m0 + warp + q * FS_WARPS;
            labels[q] = row < B ? P.labels[P.perm[st.base + row]] : 0;
        }
        auto load = [&](half_t* buf, int kc) {
            warp_load_tile(buf, Ly.x, Ly.in_p, m0, kc * FS_T, B, Ly.in_p, lane);
            warp_load_tile(buf + FS_TILE, W, Ly.out_p, kc * FS_T, 0, Ly.in_p, Ly.out_p, lane);
        };
        auto a_of = [&](half_t* buf, int, int& lda) -> const half_t* { lda = FS_LD; return buf; };
        cta_block<ROW, ROW, true>(out, reinterpret_cast<half_t*>(smem), cdiv(Ly.in_p, FS_T), load, a_of, smem);
#pragma unroll
        for (int q = 0; q < FS_T / FS_WARPS; ++q) {  // a warp per row, lane c holds class c
            const int r = warp + q * FS_WARPS, row = m0 + r;
            if (row >= B) break;
            const bool cls = lane < classes;
            const float z[1] = {cls ? f16_to_f32(f32_to_f16(out[r * 33 + lane] + bias)) : -__int_as_float(0x7f800000)};
            const XentRow<1> x = softmax_xent_row<32, 1>(z, classes, labels[q], scale);
            if (lane == 0) {
                P.row_loss[row] = x.loss;
                P.row_hit[row] = x.hit ? 1 : 0;
            }
            const float g = x.grad[0];
            if (lane < Ly.out_p) Ly.dy[(i64)row * Ly.out_p + lane] = f32_to_f16(g);
        }
        __syncthreads();
    }
}

// The gradient below the head for the 32x32 block (m0, n0), by one warp: dx = (d(logits) W^T) * relu'(x), K = 16
// (the padded classes): two mma per 16 x 8 column block, every fragment loaded straight from global memory.
RG_DEVICE void warp_head_dx(const FsParams& P, const FsLayer& Ly, const FsStep& st, int m0, int n0) {
    const int B = (int)P.batch, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const half_t* W = Ly.w16[st.rd];
    u32 fa[2][4], fb[4][2], xs[2][4][2];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = m0 + 16 * m + g + 8 * h;
            const bool in = row < B;
            fa[m][h] = in ? load_cg_u32(Ly.dy + (i64)row * Ly.out_p + 2 * t) : 0u;
            fa[m][h + 2] = in ? load_cg_u32(Ly.dy + (i64)row * Ly.out_p + 2 * t + 8) : 0u;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int col = n0 + 8 * j + 2 * t;
                xs[m][j][h] = in && col < Ly.in_p ? load_cg_u32(Ly.x + (i64)row * Ly.in_p + col) : 0u;
            }
        }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int n = n0 + 8 * j + g;  // row n of W is column n of W^T
        fb[j][0] = n < Ly.in_p ? load_cg_u32(W + (i64)n * Ly.out_p + 2 * t) : 0u;
        fb[j][1] = n < Ly.in_p ? load_cg_u32(W + (i64)n * Ly.out_p + 2 * t + 8) : 0u;
    }
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float d[4] = {0.f, 0.f, 0.f, 0.f};
            mma_m16n8k16_f32(d, fa[m], fb[j]);
            const int col = n0 + 8 * j + 2 * t;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = m0 + 16 * m + g + 8 * h;
                if (row < B && col < Ly.in_p) {
                    const float v0 = positive_f16(xs[m][j][h] & 0xFFFF) ? d[2 * h] : 0.f;
                    const float v1 = positive_f16(xs[m][j][h] >> 16) ? d[2 * h + 1] : 0.f;
                    *reinterpret_cast<u32*>(Ly.dx + (i64)row * Ly.in_p + col) = pack_f16x2(v0, v1);
                }
            }
        }
}

// dW = x^T dy for the 32x32 block (m0, n0) of layer Ly, by one warp, with the SGD (momentum) update fused:
// The master weights and the momentum are read before the K loop so their latency overlaps it.
RG_DEVICE void warp_dw_sgd(const FsParams& P, const FsLayer& Ly, const FsStep& st, int m0, int n0, half_t* pipe) {
    const int B = (int)P.batch, lane = threadIdx.x % 32;
    u32 hi2[16], lo2[16];  // the master's halves, joined after the K loop so the loads' latency overlaps it
    float2 m[16];
#pragma unroll
    for (int q = 0; q < 16; ++q) {
        const int row = m0 + acc_row(2 * q, lane), col = n0 + acc_col(2 * q, lane);
        hi2[q] = lo2[q] = 0u;
        m[q] = make_float2(0.f, 0.f);
        if (row < Ly.in_p && col < Ly.out_p) {
            const i64 at = (i64)row * Ly.out_p + col;
            hi2[q] = load_cg_u32(Ly.w16[st.rd] + at);
            lo2[q] = load_cg_u32(Ly.wlo + at);
            if (Ly.mw != nullptr) m[q] = load_cg_f2(Ly.mw + (i64)row * Ly.out_p + col);
        }
    }
    Acc acc;
    zero_acc(acc);
    auto load = [&](half_t* buf, int kc) {
        warp_load_tile(buf, Ly.x, Ly.in_p, kc * FS_T, m0, B, Ly.in_p, lane);    // x^T: [k][m]
        warp_load_tile(buf + FS_TILE, Ly.dy, Ly.out_p, kc * FS_T, n0, B, Ly.out_p, lane);
    };
    auto a_of = [&](half_t* buf, int, int& lda) -> const half_t* { lda = FS_LD; return buf; };
    warp_accumulate<COL, ROW, true>(acc, pipe, 0, 1, cdiv(B, FS_T), load, a_of, lane);
    const float mu = (float)P.mu, lr = st.lr;
    half_t* w16 = Ly.w16[st.rd ^ 1];
#pragma unroll
    for (int q = 0; q < 16; ++q) {
        const int row = m0 + acc_row(2 * q, lane), col = n0 + acc_col(2 * q, lane);
        if (row < Ly.in_p && col < Ly.out_p) {
            float g0 = acc_at(acc, 2 * q), g1 = acc_at(acc, 2 * q + 1);
            const i64 at = (i64)row * Ly.out_p + col;
            if (Ly.mw != nullptr) {
                m[q].x = mu * m[q].x + g0;
                m[q].y = mu * m[q].y + g1;
                *reinterpret_cast<float2*>(Ly.mw + at) = m[q];
                g0 = m[q].x;
                g1 = m[q].y;
            }
            float2 w = master_join2(hi2[q], lo2[q]);
            w.x -= lr * g0;
            w.y -= lr * g1;
            master_split2(w, hi2[q], lo2[q]);
            *reinterpret_cast<u32*>(w16 + at) = hi2[q];
            *reinterpret_cast<u32*>(Ly.wlo + at) = lo2[q];
        }
    }
}

// Bias gradient (column sums of dy, exact in 2^-24 fixed point) and update for columns c0..c0+31, by one warp.
// Lane l reads 8 columns (c0 + 8 (l % 4)) of rows l / 4, l / 4 + 8, ...: 16-byte loads, all in flight at once; the
// 8 lanes of a column group then add up by shuffles. Integer sums are exact, so the order cannot change a bit.
RG_DEVICE void warp_bias_sgd(const FsParams& P, const FsLayer& Ly, const FsStep& st, int c0) {
    const int lane = threadIdx.x % 32, c = c0 + 8 * (lane % 4);
    const bool in = c < Ly.out_p;
    i64 sum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int r0 = lane / 4; r0 < P.batch; r0 += 32) {
        uint4 v[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {  // rows r0, r0 + 8, r0 + 16, r0 + 24
            const int r = r0 + 8 * q;
            v[q] = make_uint4(0, 0, 0, 0);
            if (in && r < P.batch) {
                v[q] = load_cg_16(Ly.dy + (i64)r * Ly.out_p + c);  // out_p % 8 == 0: 16-byte aligned
            }
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const u32 w[4] = {v[q].x, v[q].y, v[q].z, v[q].w};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                sum[2 * k] += f16_fixed24(w[k] & 0xFFFF);
                sum[2 * k + 1] += f16_fixed24(w[k] >> 16);
            }
        }
    }
#pragma unroll
    for (int k = 0; k < 8; ++k)
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) sum[k] += __shfl_xor_sync(0xffffffffu, sum[k], o);
    if (lane >= 4 || !in) return;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        float g = (float)((double)sum[k] * (1.0 / 16777216.0));
        if (Ly.mb != nullptr) {
            g = (float)P.mu * load_cg_f32(Ly.mb + c + k) + g;
            Ly.mb[c + k] = g;
        }
        Ly.b[c + k] = load_cg_f32(Ly.b + c + k) - st.lr * g;
    }
}

// The loss and hit counts of the head's rows, summed in a fixed order and added to the running metrics.
RG_DEVICE void warp_metrics(const FsParams& P) {
    const int lane = threadIdx.x % 32;
    double loss = 0.0;
    int hits = 0;
    for (int r0 = lane; r0 < P.batch; r0 += 128) {
        float l[4];
        u32 h[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int r = r0 + 32 * q;
            l[q] = r < P.batch ? load_cg_f32(P.row_loss + r) : 0.f;
            h[q] = r < P.batch ? load_cg_u32(P.row_hit + r) : 0u;
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) loss += (double)l[q], hits += (int)h[q];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        loss += __shfl_xor_sync(0xffffffffu, loss, o);
        hits += __shfl_xor_sync(0xffffffffu, hits, o);
    }
    if (lane == 0) {
        *P.loss_sum = load_cg_f64(P.loss_sum) + loss;
        *P.correct = (int)load_cg_u32(P.correct) + hits;
    }
}

// Backward through layer i: dx (if i > 0) as CTA tasks; dW + SGD and the bias as warp tasks.
RG_DEVICE void phase_backward(const FsParams& P, int i, const FsStep& st, u8* smem) {
    const FsLayer& Ly = P.layer[i];
    const int B = (int)P.batch, tid = threadIdx.x, lane = tid % 32;
    const half_t* W = Ly.w16[st.rd];
    if (i > 0) {
        const int mt = cdiv(B, FS_T), nt = cdiv(Ly.in_p, FS_T);
        float* out = reinterpret_cast<float*>(smem + FS_RED_BYTES);
        for (int t = blockIdx.x; t < mt * nt; t += gridDim.x) {
            const int m0 = (t / nt) * FS_T, n0 = (t % nt) * FS_T;
            const int c = 2 * (tid % 16), col = n0 + c;
            u32 xs[2];  // the saved activation for relu', loaded before the K loop
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = m0 + tid / 16 + 16 * h;
                xs[h] = col < Ly.in_p && row < B ? load_cg_u32(Ly.x + (i64)row * Ly.in_p + col) : 0u;
            }
            auto load = [&](half_t* buf, int kc) {
                warp_load_tile(buf, Ly.dy, Ly.out_p, m0, kc * FS_T, B, Ly.out_p, lane);
                warp_load_tile(buf + FS_TILE, W, Ly.out_p, n0, kc * FS_T, Ly.in_p, Ly.out_p, lane);  // W^T: [n][k]
            };
            auto a_of = [&](half_t* buf, int, int& lda) -> const half_t* { lda = FS_LD; return buf; };
            cta_block<ROW, COL, true>(out, reinterpret_cast<half_t*>(smem), cdiv(Ly.out_p, FS_T), load, a_of, smem);
            if (col < Ly.in_p) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = tid / 16 + 16 * h, row = m0 + r;
                    if (row < B) {
                        const float v0 = positive_f16(xs[h] & 0xFFFF) ? out[r * 33 + c] : 0.f;
                        const float v1 = positive_f16(xs[h] >> 16) ? out[r * 33 + c + 1] : 0.f;
                        *reinterpret_cast<u32*>(Ly.dx + (i64)row * Ly.in_p + col) = pack_f16x2(v0, v1);
                    }
                }
            }
            __syncthreads();
        }
    }
    // Warp tasks, numbered: dW blocks, then bias blocks.
    const int dw_n = cdiv(Ly.out_p, FS_T), dw = cdiv(Ly.in_p, FS_T) * dw_n, total = dw + dw_n;
    half_t* pipe = reinterpret_cast<half_t*>(smem) + (tid / 32) * FS_STAGES * 2 * FS_TILE;
    for (int u = warp_worker(); u < total; u += gridDim.x * FS_WARPS) {
        if (u < dw) warp_dw_sgd(P, Ly, st, (u / dw_n) * FS_T, (u % dw_n) * FS_T, pipe);
        else        warp_bias_sgd(P, Ly, st, (u - dw) * FS_T);
    }
}

// Below the head (layer i, the last): the gradient dx in 32x32 warp blocks, the head's dW + SGD and bias update,
// and the loss metrics; all of it reads only d(logits) and the saved activations, so it shares one phase.
RG_DEVICE void phase_head_backward(const FsParams& P, int i, const FsStep& st, u8* smem) {
    const FsLayer& Ly = P.layer[i];
    const int mt = cdiv(P.batch, FS_T), nt = cdiv(Ly.in_p, FS_T), dx = mt * nt, dw = cdiv(Ly.in_p, FS_T);
    half_t* pipe = reinterpret_cast<half_t*>(smem) + (threadIdx.x / 32) * FS_STAGES * 2 * FS_TILE;
    for (int u = warp_worker(); u < dx + dw + 2; u += gridDim.x * FS_WARPS) {
        if (u < dx)           warp_head_dx(P, Ly, st, (u / nt) * FS_T, (u % nt) * FS_T);
        else if (u < dx + dw) warp_dw_sgd(P, Ly, st, (u - dx) * FS_T, 0, pipe);
        else if (u == dx + dw) warp_bias_sgd(P, Ly, st, 0);
        else                  warp_metrics(P);
    }
}

#ifdef FS_PROFILE
#define FS_MARK(k)                                                                         \
    if (blockIdx.x == 0 && threadIdx.x == 0 && P.profile != nullptr) {                     \
        u64 t;                                                                             \
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));                              \
        P.profile[1 + (k)] = t;                                                            \
    }
#else
#define FS_MARK(k)
#endif

// n_steps training steps. Launch: FS_THREADS threads, FS_SMEM_BYTES dynamic shared memory, a grid that is all
// resident (cooperative launch), the same grid size for every launch on one barrier counter.
extern "C" __global__ void __launch_bounds__(FS_THREADS, 1) fused_steps(const FsParams* __restrict__ params,
                                                                        int n_steps) {
    extern __shared__ __align__(128) u8 smem[];
    if (dynamic_smem_bytes() < FS_SMEM_BYTES) __trap();  // launcher/kernel mismatch
    const FsParams& P = *params;
    const int L = (int)P.layers;  // linear layers: L - 1 hidden ones, then the head
    const i64 s0 = *P.step;
    FS_MARK(-1);
    for (int k = 0; k < n_steps; ++k) {
        const i64 s = s0 + k;
        FsStep st;
        st.base = (s % P.steps_per_epoch) * P.batch;
        st.rd = (int)(s & 1);
        st.lr = lr_at_step(s, P.lr0, P.lr_min, P.total_steps, P.warmup_steps, (int)P.schedule);
        int phase = k * 2 * L;
        for (int i = 0; i < L - 1; ++i) {
            phase_forward(P, i, st, smem);
            grid_barrier(P.barrier);
            FS_MARK(phase++);
        }
        phase_head(P, L - 1, st, smem);
        grid_barrier(P.barrier);
        FS_MARK(phase++);
        phase_head_backward(P, L - 1, st, smem);
        grid_barrier(P.barrier);
        FS_MARK(phase++);
        for (int i = L - 2; i >= 0; --i) {
            phase_backward(P, i, st, smem);
            if (i > 0 || k + 1 < n_steps) grid_barrier(P.barrier);
            FS_MARK(phase++);
        }
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) *P.step = s0 + n_steps;
}

// n grid barriers and nothing else: what one phase boundary costs (scripts/fused_phases.py measures it).
extern "C" __global__ void grid_barriers(u64* counter, int n) {
    for (int i = 0; i < n; ++i) grid_barrier(counter);
}
