// Training steps with the weights resident in shared memory: one thread-block cluster (sm_90, 8 or 16 CTAs)
// holds the whole model for n_steps steps, so a step reads no weights from memory at all, and the CTAs exchange
// activations and partial sums through distributed shared memory instead of global memory and grid barriers
// (~1 us each, fused_step.cu).
//
// Ownership. CTA c owns columns J = [c n, (c + 1) n) of every hidden layer: its fp32 master slice W_l[:, J] and
// bias b_l[J] live in its shared memory for the whole launch (joined from the master's two halves in global
// memory at the start, master.cuh, and split back at the end, so evaluation and checkpoints see ordinary
// buffers). The head (H x 10) is small: every CTA holds a replica and updates it identically, so the head needs
// no exchange at all.
//
// Exchanges. Every exchange is a set of st.async stores into the receivers' shared memory, each counting its
// bytes on the receiver's mbarrier for that buffer; a receiver waits on its own barrier for the bytes of all C
// slices. Nobody waits for anyone else to arrive, and no release fence drains the sender's stores: a step has no
// cluster-wide barrier, only 2k - 1 receives (k hidden layers).
//
// A step, with hidden layers 0 .. k-1 and the head:
//   forward l       h_l[:, J] = relu(h_{l-1} W_l[:, J] + b_l[J]) (h_{-1}: the gathered batch), stored straight from
//                   the partial-sum reduction into every CTA's copy of h_l (an all-gather)         -> receive h_l
//   head            logits, softmax cross-entropy (8 lanes per row, every row at once) and d(logits),
//                   redundantly in every CTA; dy_{k-1}[:, J] from the replica
//   backward l > 0  partial dx_{l-1} = dy_l[:, J] W_l[:, J]^T (32 x H, fp32) goes column-slice by column-slice to
//                   the CTAs that own those columns (a reduce-scatter); the local update
//                   W_l[:, J] -= lr h_{l-1}^T dy_l[:, J] and the bias (for l = k-1 also the head replica's) runs
//                   while the partials are in flight                                          -> receive partials
//                   dy_{l-1}[:, J] = (sum of the partials in CTA order) * relu'(h_{l-1}[:, J])
//   backward 0      the update of W_0[:, J] and b_0[J] (and the head's, with one hidden layer)
// Weights are used in fp16 as everywhere else: fp16(W) is computed when a fragment is loaded, which is the
// same value the per-layer step's W16 copy holds.
//
// Why no buffer is overwritten early (docs/perf.md walks through it). A CTA sends a buffer's next contents only
// after it received data that the receiver sent after a __syncthreads that follows the receiver's last read of the
// buffer (and its last wait on the buffer's barrier, so a barrier never sees bytes of two phases at once):
//   h_l, l >= 1: the sender needs the receiver's h_{l-1} of the next step first;
//   h_0: read by the update of layer 1 at the step's very end, so it alternates between two buffers by step
//        parity; step s + 2's sender needs the receiver's partials (or h_0, k = 1) of step s + 1 first;
//   partial sums: alternate by layer parity; the sender of layer l - 2's partials needs the receiver's partials
//        of layer l - 1, sent after it summed layer l's.
// dy alternates by layer parity too, so the sum for layer l - 1 can start while this CTA's warps still read dy_l in
// the update.
//
// Input: the next step's batch rows (uint8) are fetched one step ahead by the bulk copy engine, one instruction per
// image row, onto an mbarrier; forward 0 waits on it and each thread converts the 16-byte pieces its warp multiplies
// to fp16 byte/255 (the gather kernel's exact rounding).
#include "common.cuh"
#include "mma.cuh"
#include "ldmatrix.cuh"
#include "cluster.cuh"
#include "tma.cuh"
#include "step_math.cuh"
#include "master.cuh"

#define CS_WARPS 8
#define CS_THREADS (CS_WARPS * 32)
#define CS_ROWS 32          // batch rows held (batch <= 32; rows past the batch are zero)
#define CS_INPUTS 784
#define CS_X_LD 792         // halves per row of the batch in fp16: 784 + 8, conflict-free ldmatrix
#define CS_HEAD_LD 20       // floats per row of the head replica (16 classes + 4: conflict-free)
#define CS_DLOGIT_LD 24     // halves per row of d(logits)
#define CS_MAX_LINEAR 9
// NT (a template parameter): 8-column tiles per CTA, n <= 8 NT; kernels cluster_steps_1, _2 and _4. Sizing the
// register arrays and unrolled loops exactly keeps the code small: a step runs through all of it once, so its
// size is instruction-fetch time.

// kernels/cluster.py writes this table into the arena (every field 8 bytes, in this order) and plans the
// shared-memory layout (byte offsets below).
struct CsLayer {
    short* wlo;     // global master weights [in_p, out_p]: the low half (master.cuh) ...
    half_t* w16;    // ... and the high half, the fp16 working copy (both written at the end of a launch)
    float* b;       // global bias [out_p]
    i64 in_p, out_p;
    i64 rows;       // rows held in shared memory: 784 for layer 0, hs above (the head: hs)
    i64 w_off, b_off;
};

struct CsParams {
    const u8* images;  // [rows, 784]
    const u8* labels;
    const int* perm;
    i64* step;
    double* loss_sum;
    int* correct;
    u64* profile;      // with -DCS_PROFILE: CTA 0 stamps %globaltimer at every mark (scripts/cluster_phases.py)
    i64 batch, steps_per_epoch, layers, schedule, total_steps, warmup_steps, classes;
    i64 hs;          // hidden width padded to ctas x n
    i64 n;           // columns per CTA (a multiple of 8, at most 8 NT)
    i64 act_off, raw_off, x_off, dy_off, dlogit_off, rs_off, scratch_off, misc_off, smem_bytes;
    double lr0, lr_min, dlogit_scale;  // lr0 and lr_min already divided by the loss scale
    CsLayer layer[CS_MAX_LINEAR];
};

// Every exchange lands on an mbarrier of the receiving CTA, one per buffer: h_0's two (0, 1), h_l's (l + 1), the
// partial-sum buffers' two (CS_RS_BAR + parity). The receiver expects the bytes of all C slices (its own included).
#define CS_RS_BAR (CS_MAX_LINEAR)
#define CS_GATHER_BAR (CS_MAX_LINEAR + 2)  // the batch rows' bulk copies
#define CS_BARS (CS_MAX_LINEAR + 3)

// This CTA's share of the model, and its barriers.
struct Geo {
    int c, C, n, nt, hs, J0, B, L;
    u64* bars;
};

RG_DEVICE bool positive_f16(u32 h) { return (h & 0x8000u) == 0 && (h & 0x7FFFu) != 0; }
RG_DEVICE int act_ld(const Geo& G) { return G.hs + 8; }
// Partial sums between warps: 8 K-groups x 32 x n in a forward, 4 K-groups x 32 x 16 classes in the head.
#define CS_HEAD_GROUPS 4

// h_l; h_0 alternates between two buffers by step parity (buf), the layers above have one each.
RG_DEVICE int act_index(int l, int buf) { return l ? l + 1 : buf; }
RG_DEVICE half_t* act_at(const CsParams& P, u8* smem, const Geo& G, int l, int buf) {
    return reinterpret_cast<half_t*>(smem + P.act_off) + (i64)act_index(l, buf) * CS_ROWS * act_ld(G);
}
RG_DEVICE u8* raw_at(const CsParams& P, u8* smem) { return smem + P.raw_off; }
RG_DEVICE half_t* x_at(const CsParams& P, u8* smem) { return reinterpret_cast<half_t*>(smem + P.x_off); }
// The input of layer l (the batch for l = 0) and its row stride.
RG_DEVICE const half_t* in_at(const CsParams& P, u8* smem, const Geo& G, int l, int ab, int& ld) {
    ld = l ? act_ld(G) : CS_X_LD;
    return l ? act_at(P, smem, G, l - 1, ab) : x_at(P, smem);
}
// dy_l[:, J] (32 x n + 8 padding), alternating by layer parity.
RG_DEVICE half_t* dy_at(const CsParams& P, u8* smem, const Geo& G, int l) {
    return reinterpret_cast<half_t*>(smem + P.dy_off) + (l & 1) * CS_ROWS * (G.n + 8);
}
RG_DEVICE float* rs_at(const CsParams& P, u8* smem, const Geo& G, int buf) {
    return reinterpret_cast<float*>(smem + P.rs_off) + (i64)buf * G.C * CS_ROWS * G.n;
}
// misc: labels [32], per-row loss [32] and hit [32]
RG_DEVICE int* labels_at(const CsParams& P, u8* smem) { return reinterpret_cast<int*>(smem + P.misc_off); }
RG_DEVICE float* row_loss_at(const CsParams& P, u8* smem) { return reinterpret_cast<float*>(smem + P.misc_off) + 32; }
RG_DEVICE int* row_hit_at(const CsParams& P, u8* smem) { return reinterpret_cast<int*>(smem + P.misc_off) + 64; }

// ---- fragments (layouts in mma.cuh) ----------------------------------------------------------------------------

// A (16 x 16) at (m0, k0) of a row-major fp16 buffer.
RG_DEVICE void a_rows(u32 (&a)[4], const half_t* s, int ld, int m0, int k0, int lane) {
    const int r8 = lane % 8, q1 = (lane / 8) % 2, q2 = lane / 16;
    ldmatrix_x4(a, shared_address(s + (m0 + r8 + 8 * q1) * ld + k0 + 8 * q2));
}

// A (16 x 16) of the transpose of a row-major fp16 buffer s[k][m], at (m0, k0).
RG_DEVICE void a_cols(u32 (&a)[4], const half_t* s, int ld, int m0, int k0, int lane) {
    const int r8 = lane % 8, q1 = (lane / 8) % 2, q2 = lane / 16;
    ldmatrix_x4_trans(a, shared_address(s + (k0 + r8 + 8 * q2) * ld + m0 + 8 * q1));
}

// B (16 x 8) at columns n0 and n0 + 8 of a row-major fp16 buffer s[k][n], rows k0..k0+15.
RG_DEVICE void b_rows_pair(u32 (&b0)[2], u32 (&b1)[2], const half_t* s, int ld, int k0, int n0, int lane) {
    const int r8 = lane % 8, q1 = (lane / 8) % 2, q2 = lane / 16;
    u32 r[4];
    ldmatrix_x4_trans(r, shared_address(s + (k0 + r8 + 8 * q1) * ld + n0 + 8 * q2));
    b0[0] = r[0], b0[1] = r[1], b1[0] = r[2], b1[1] = r[3];
}

// B (16 x 8) at (k0, n0) of fp32 weights w[k][n], rounded to fp16.
RG_DEVICE void b_from_f32(u32 (&b)[2], const float* w, int ld, int k0, int n0, int lane) {
    const int g = lane / 4, t = lane % 4;
    const float* p = w + (k0 + 2 * t) * ld + n0 + g;
    b[0] = pack_f16x2(p[0], p[ld]);
    b[1] = pack_f16x2(p[8 * ld], p[9 * ld]);
}

// B (16 x 8) of w^T: B[k][n] = w[n0 + n][k0 + k], rounded to fp16; k0 + 8 >= kmax reads the upper half as zero.
RG_DEVICE void b_from_f32_t(u32 (&b)[2], const float* w, int ld, int k0, int n0, int kmax, int lane) {
    const int g = lane / 4, t = lane % 4;
    const float* p = w + (n0 + g) * ld + k0 + 2 * t;
    const float2 lo = *reinterpret_cast<const float2*>(p);
    b[0] = pack_f16x2(lo.x, lo.y);
    b[1] = 0u;
    if (k0 + 8 < kmax) {
        const float2 hi = *reinterpret_cast<const float2*>(p + 8);
        b[1] = pack_f16x2(hi.x, hi.y);
    }
}

// w[m0 + row][n0 + col] -= lr * acc for one 16 x 8 accumulator tile of fp32 weights in shared memory, each result
// rounded as the stored master would round it (master_round), so a launch boundary changes no bit.
RG_DEVICE void sgd_tile(float* w, int ld, int m0, int n0, const float (&acc)[4], float lr, int lane) {
    const int g = lane / 4, t = lane % 4;
    float2* p0 = reinterpret_cast<float2*>(w + (m0 + g) * ld + n0 + 2 * t);
    float2* p1 = reinterpret_cast<float2*>(w + (m0 + g + 8) * ld + n0 + 2 * t);
    float2 u = *p0, v = *p1;
    u.x -= lr * acc[0], u.y -= lr * acc[1], v.x -= lr * acc[2], v.y -= lr * acc[3];
    *p0 = make_float2(master_round(u.x), master_round(u.y)), *p1 = make_float2(master_round(v.x), master_round(v.y));
}

// ---- the input ---------------------------------------------------------------------------------------------------

RG_DEVICE i64 batch_base(const CsParams& P, i64 s) { return (s % P.steps_per_epoch) * P.batch; }

// The pieces a thread converts: row = its lane, 16-byte pieces q = warp + 8 i of the 49 per row, which are exactly
// the columns its warp multiplies in forward 0 (k-steps warp, warp + 8, ...).
constexpr int CS_PIECES = CS_INPUTS / 16;
constexpr int CS_OWN_PIECES = (CS_PIECES + CS_WARPS - 1) / CS_WARPS;

// Wait for the next phase of this CTA's barrier i; `phases` holds, a bit per barrier, the parity this thread waits
// for next.
RG_DEVICE void wait_phase(const Geo& G, u32& phases, int i) {
    cluster_wait_phase(shared_address(G.bars + i), (phases >> i) & 1u);
    phases ^= 1u << i;
}

// Warp 0: the batch rows into the byte buffer by the bulk copy engine, lane r copying image `img` (its row; rows
// past the batch stay zero from the launch's start), counted on the gather barrier. Called after a __syncthreads
// that follows every read of the buffer.
RG_DEVICE void issue_gather(const CsParams& P, u8* smem, const Geo& G, int img) {
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    u64* bar = G.bars + CS_GATHER_BAR;
    if (lane == 0) mbar_arrive_expect_tx(bar, (u32)(G.B * CS_INPUTS));
    __syncwarp();
    fence_proxy_async();
    if (lane < G.B) bulk_load(raw_at(P, smem) + lane * CS_INPUTS, P.images + (i64)img * CS_INPUTS, CS_INPUTS, bar);
}

// Once the rows have landed: this thread's pieces -> the fp16 batch (byte / 255, the gather kernel's rounding);
// then the warp's columns of x are complete (no other warp writes them).
RG_DEVICE void convert_own_pieces(const CsParams& P, u8* smem, const Geo& G, u32& phases) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const u8* raw = raw_at(P, smem) + lane * CS_INPUTS;
    half_t* x = x_at(P, smem) + lane * CS_X_LD;
    wait_phase(G, phases, CS_GATHER_BAR);
    uint4 v[CS_OWN_PIECES];  // every load in flight before the first conversion
#pragma unroll
    for (int i = 0; i < CS_OWN_PIECES; ++i) {
        const int q = warp + i * CS_WARPS;
        if (q < CS_PIECES) v[i] = load_16(raw + 16 * q);
    }
#pragma unroll
    for (int i = 0; i < CS_OWN_PIECES; ++i) {
        const int q = warp + i * CS_WARPS;
        if (q < CS_PIECES) {
            uint4 lo, hi;
            bytes16_to_f16(v[i], lo, hi);
            store_16(x + 16 * q, lo);
            store_16(x + 16 * q + 8, hi);
        }
    }
    __syncwarp();
}

// bias[j] -= lr * (column j of fp16 s[32][ld]) for j < cols: a warp per column, lane = row, and the sum exact in
// 2^-24 fixed point (so it is the same in any order, as the other steps' bias gradients).
RG_DEVICE void bias_sgd(float* bias, const half_t* s, int ld, int cols, float lr) {
    const int lane = threadIdx.x % 32;
    for (int j = threadIdx.x / 32; j < cols; j += CS_WARPS) {
        i64 sum = f16_fixed24(s[lane * ld + j]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (lane == 0) bias[j] -= lr * (float)((double)sum * (1.0 / 16777216.0));
    }
}

// ---- phases -------------------------------------------------------------------------------------------------------

// Forward through hidden layer l for this CTA's columns, stored into every CTA's copy of h_l (the caller then
// receives the other slices). Layer 0 first converts the thread's pieces of the batch.
template <int NT>
RG_DEVICE void forward_hidden(const CsParams& P, u8* smem, const Geo& G, int l, int ab, u32& phases) {
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
    if (l == 0) convert_own_pieces(P, smem, G, phases);
    const CsLayer& Ly = P.layer[l];
    const float* W = reinterpret_cast<const float*>(smem + Ly.w_off);
    const int wld = G.n + 4, ksteps = (int)Ly.rows / 16;
    int ild;
    const half_t* in = in_at(P, smem, G, l, ab, ild);
    float acc[2][NT][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
    for (int ks = warp; ks < ksteps; ks += CS_WARPS) {  // the warps split K; partial sums meet below
        u32 a[2][4];
        a_rows(a[0], in, ild, 0, 16 * ks, lane);
        a_rows(a[1], in, ild, 16, 16 * ks, lane);
#pragma unroll
        for (int nj = 0; nj < NT; ++nj) {
            if (nj < G.nt) {
                u32 b[2];
                b_from_f32(b, W, wld, 16 * ks, 8 * nj, lane);
                mma_m16n8k16_f32(acc[0][nj], a[0], b);
                mma_m16n8k16_f32(acc[1][nj], a[1], b);
            }
        }
    }
    float* scr = reinterpret_cast<float*>(smem + P.scratch_off);
    const int sld = G.n;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int nj = 0; nj < NT; ++nj) {
            if (nj < G.nt) {
                float* p = scr + (warp * CS_ROWS + 16 * mi + g) * sld + 8 * nj + 2 * t;
                *reinterpret_cast<float2*>(p) = make_float2(acc[mi][nj][0], acc[mi][nj][1]);
                *reinterpret_cast<float2*>(p + 8 * sld) = make_float2(acc[mi][nj][2], acc[mi][nj][3]);
            }
        }
    __syncthreads();
    half_t* out = act_at(P, smem, G, l, ab);
    const float* bias = reinterpret_cast<const float*>(smem + Ly.b_off);
    const int pairs = G.n / 2;  // 32 x pairs items: whole warps (n is a multiple of 8)
    for (int e = tid; e < CS_ROWS * pairs; e += CS_THREADS) {
        const int r = e / pairs, j = 2 * (e % pairs);
        float2 s = make_float2(0.f, 0.f);
#pragma unroll
        for (int w = 0; w < CS_WARPS; ++w) {  // warp order: a fixed sum
            const float2 v = *reinterpret_cast<const float2*>(scr + (w * CS_ROWS + r) * sld + j);
            s.x += v.x, s.y += v.y;
        }
        const bool row = r < G.B;
        const float v0 = row ? fmaxf(s.x + bias[j], 0.f) : 0.f, v1 = row ? fmaxf(s.y + bias[j + 1], 0.f) : 0.f;
        const u32 h2 = pack_f16x2(v0, v1);
        // Lanes 4i .. 4i + 3 hold one row's 8 columns at 8 (j / 8): each assembles the 16-byte piece and stores it
        // into a quarter of the cluster's copies (its own CTA's included).
        const int base = lane & ~3;
        const uint4 piece = make_uint4(__shfl_sync(0xffffffffu, h2, base), __shfl_sync(0xffffffffu, h2, base + 1),
                                       __shfl_sync(0xffffffffu, h2, base + 2), __shfl_sync(0xffffffffu, h2, base + 3));
        const u32 at = shared_address(out + r * act_ld(G) + G.J0 + (j & ~7));
        const u32 bar = shared_address(G.bars + act_index(l, ab));
        for (int d = lane & 3; d < G.C; d += 4)
            cluster_store_async_16(cluster_address(at, d), piece, cluster_address(bar, d));
    }
}

// Backward through hidden layer l > 0 with dy_l[:, J] in shared memory: the partial dx_{l-1} = dy_l[:, J] W_l[:, J]^T,
// 8 input features per warp task, stored into the owners' partial-sum buffers.
template <int NT>
RG_DEVICE void partial_dx(const CsParams& P, u8* smem, const Geo& G, int l) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    const float* W = reinterpret_cast<const float*>(smem + P.layer[l].w_off);
    const int wld = G.n + 4, dld = G.n + 8;
    const half_t* dy = dy_at(P, smem, G, l);
    float* rs = rs_at(P, smem, G, (l - 1) & 1);
    const u32 bar = shared_address(G.bars + CS_RS_BAR + ((l - 1) & 1));
    const int tiles = G.hs / 8;  // 8 input features (columns of dx) per task, two tasks per warp in flight
    for (int t0 = warp; t0 < tiles; t0 += 2 * CS_WARPS) {
        float acc[2][2][4];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int i0 = 8 * (t0 + u * CS_WARPS);
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) acc[u][mi][0] = acc[u][mi][1] = acc[u][mi][2] = acc[u][mi][3] = 0.f;
            if (i0 >= G.hs) continue;
#pragma unroll
            for (int kk = 0; kk < 8 * NT; kk += 16) {
                if (kk >= G.n) break;
                u32 b[2];
                b_from_f32_t(b, W, wld, kk, i0, G.n, lane);
#pragma unroll
                for (int mi = 0; mi < 2; ++mi) {
                    u32 a[4];
                    a_rows(a, dy, dld, 16 * mi, kk, lane);  // columns n..n+7 are zero padding
                    mma_m16n8k16_f32(acc[u][mi], a, b);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int i0 = 8 * (t0 + u * CS_WARPS);
            if (i0 >= G.hs) continue;
            const int owner = i0 / G.n, j = i0 % G.n + 2 * t;
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float* p = rs + (G.c * CS_ROWS + 16 * mi + g + 8 * h) * G.n + j;
                    cluster_store_async_f2(cluster_address(shared_address(p), owner), acc[u][mi][2 * h],
                                           acc[u][mi][2 * h + 1], cluster_address(bar, owner));
                }
        }
    }
}

// The update of hidden layer l's slice: W_l[:, J] -= lr h_{l-1}^T dy_l[:, J] (16-row tasks, several per warp at once),
// and b_l[J]. Reads only this CTA's shared memory.
template <int NT>
RG_DEVICE void update_layer(const CsParams& P, u8* smem, const Geo& G, int l, int ab, float lr) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const CsLayer& Ly = P.layer[l];
    float* W = reinterpret_cast<float*>(smem + Ly.w_off);
    const int wld = G.n + 4, dld = G.n + 8;
    const half_t* dy = dy_at(P, smem, G, l);
    int ild;
    const half_t* in = in_at(P, smem, G, l, ab, ild);
    const int mtiles = (int)Ly.rows / 16;
    u32 b[2][NT + (NT & 1)][2];  // dy as the B operand (K = the 32 rows), the same for every task
#pragma unroll
    for (int kh = 0; kh < 2; ++kh)
#pragma unroll
        for (int nj = 0; nj < NT; nj += 2)
            if (nj < G.nt) b_rows_pair(b[kh][nj], b[kh][nj + 1], dy, dld, 16 * kh, 8 * nj, lane);  // past n: zeros
    constexpr int U = NT == 1 ? 4 : 2;  // tasks in flight at once: shorter chains where the registers allow
    for (int m0 = warp; m0 < mtiles; m0 += U * CS_WARPS) {  // dW[16 rows, n columns] per task
        float acc[U][NT][4];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int j = 0; j < NT; ++j) acc[u][j][0] = acc[u][j][1] = acc[u][j][2] = acc[u][j][3] = 0.f;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int mt = m0 + u * CS_WARPS;
            if (mt < mtiles) {
#pragma unroll
                for (int kh = 0; kh < 2; ++kh) {
                    u32 a[4];
                    a_cols(a, in, ild, 16 * mt, 16 * kh, lane);
#pragma unroll
                    for (int nj = 0; nj < NT; ++nj)
                        if (nj < G.nt) mma_m16n8k16_f32(acc[u][nj], a, b[kh][nj]);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int mt = m0 + u * CS_WARPS;
#pragma unroll
            for (int nj = 0; nj < NT; ++nj)
                if (mt < mtiles && nj < G.nt) sgd_tile(W, wld, 16 * mt, 8 * nj, acc[u][nj], lr, lane);
        }
    }
    bias_sgd(reinterpret_cast<float*>(smem + Ly.b_off), dy, dld, G.n, lr);
}

// Wait until barrier i's phase has all its bytes (thread 0 tells it how many).
RG_DEVICE void receive(const Geo& G, u32& phases, int i, u32 bytes) {
    if (threadIdx.x == 0) mbar_arrive_expect_tx(G.bars + i, bytes);
    wait_phase(G, phases, i);
}

// dy_l[:, J] = (sum of the partials the CTAs sent, in CTA order) * relu'(h_l[:, J]).
RG_DEVICE void collect_dy(const CsParams& P, u8* smem, const Geo& G, int l, int ab) {
    const float* rs = rs_at(P, smem, G, l & 1);
    const half_t* h = act_at(P, smem, G, l, ab);
    half_t* dy = dy_at(P, smem, G, l);
    const int pairs = G.n / 2;
    for (int e = threadIdx.x; e < CS_ROWS * pairs; e += CS_THREADS) {
        const int r = e / pairs, j = 2 * (e % pairs);
        float2 s = make_float2(0.f, 0.f);
        for (int src = 0; src < G.C; ++src) {  // CTA order: a fixed sum
            const float2 v = *reinterpret_cast<const float2*>(rs + (src * CS_ROWS + r) * G.n + j);
            s.x += v.x, s.y += v.y;
        }
        const u32 hv = *reinterpret_cast<const u32*>(h + r * act_ld(G) + G.J0 + j);
        *reinterpret_cast<u32*>(dy + r * (G.n + 8) + j) =
            pack_f16x2(positive_f16(hv & 0xFFFF) ? s.x : 0.f, positive_f16(hv >> 16) ? s.y : 0.f);
    }
    __syncthreads();
}

// The head, identically in every CTA: logits (rounded to fp16, as the per-kernel step stores them), softmax
// cross-entropy, per-row loss and hit, d(logits) scaled by S / B.
RG_DEVICE void head_loss(const CsParams& P, u8* smem, const Geo& G, int ab, int label) {
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
    const CsLayer& Ly = P.layer[G.L - 1];
    float* W3 = reinterpret_cast<float*>(smem + Ly.w_off);
    float* b3 = reinterpret_cast<float*>(smem + Ly.b_off);
    const half_t* h = act_at(P, smem, G, G.L - 2, ab);
    half_t* dl = reinterpret_cast<half_t*>(smem + P.dlogit_off);
    int* labels = labels_at(P, smem);
    // Logits: warp w takes classes 8 (w % 2) .. + 7 and the k-steps w / 2 + 4 i; 4 partial sums per logit.
    const int nj = warp % 2, kg = warp / 2;
    float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    for (int ks = kg; ks < G.hs / 16; ks += CS_HEAD_GROUPS) {
        u32 a[2][4], b[2];
        a_rows(a[0], h, act_ld(G), 0, 16 * ks, lane);
        a_rows(a[1], h, act_ld(G), 16, 16 * ks, lane);
        b_from_f32(b, W3, CS_HEAD_LD, 16 * ks, 8 * nj, lane);
        mma_m16n8k16_f32(acc[0], a[0], b);
        mma_m16n8k16_f32(acc[1], a[1], b);
    }
    if (tid < CS_ROWS) labels[tid] = label;  // its load was issued when the step began
    float* scr = reinterpret_cast<float*>(smem + P.scratch_off);
    constexpr int sld = 16;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
        float* p = scr + (kg * CS_ROWS + 16 * mi + g) * sld + 8 * nj + 2 * t;
        *reinterpret_cast<float2*>(p) = make_float2(acc[mi][0], acc[mi][1]);
        *reinterpret_cast<float2*>(p + 8 * sld) = make_float2(acc[mi][2], acc[mi][3]);
    }
    __syncthreads();
    const int classes = (int)P.classes;
    const float scale = (float)P.dlogit_scale;
    float* row_loss = row_loss_at(P, smem);
    int* row_hit = row_hit_at(P, smem);
    {  // 8 lanes per row, every row at once: lane q of a row's group holds classes q and q + 8
        const int r = tid / 8, q = tid % 8;
        const bool row = r < G.B;
        float z[2];
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            const int c = q + 8 * p;
            float sum = 0.f;
#pragma unroll
            for (int w = 0; w < CS_HEAD_GROUPS; ++w) sum += scr[(w * CS_ROWS + r) * sld + c];
            z[p] = c < classes ? f16_to_f32(f32_to_f16(sum + b3[c])) : -__int_as_float(0x7f800000);
        }
        const XentRow<2> x = softmax_xent_row<8, 2>(z, classes, labels[r], scale);
        if (q == 0) {
            row_loss[r] = row ? x.loss : 0.f;
            row_hit[r] = row && x.hit ? 1 : 0;
        }
#pragma unroll
        for (int p = 0; p < 2; ++p) dl[r * CS_DLOGIT_LD + q + 8 * p] = f32_to_f16(row ? x.grad[p] : 0.f);
    }
    __syncthreads();
}

// Below the head, identically in every CTA: the step's metrics (CTA 0) and dy of the top hidden layer for this
// CTA's columns.
RG_DEVICE void head_dy(const CsParams& P, u8* smem, const Geo& G, int ab, double& run_loss, int& run_hits) {
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
    const float* W3 = reinterpret_cast<const float*>(smem + P.layer[G.L - 1].w_off);
    const half_t* h = act_at(P, smem, G, G.L - 2, ab);
    const half_t* dl = reinterpret_cast<const half_t*>(smem + P.dlogit_off);
    const float* row_loss = row_loss_at(P, smem);
    const int* row_hit = row_hit_at(P, smem);
    if (G.c == 0 && warp == 0) {  // the step's metrics, summed in a fixed order
        double loss = (double)row_loss[lane];
        int hits = row_hit[lane];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            loss += __shfl_xor_sync(0xffffffffu, loss, o);
            hits += __shfl_xor_sync(0xffffffffu, hits, o);
        }
        run_loss += loss, run_hits += hits;
    }
    // dy of the top hidden layer, this CTA's columns: (d(logits) W3[J, :]^T) * relu'(h[:, J]); K = 16 classes.
    half_t* dy = dy_at(P, smem, G, G.L - 2);
    for (int u = warp; u < 2 * G.nt; u += CS_WARPS) {
        const int mi = u % 2, nj = u / 2;
        u32 a[4], b[2];
        a_rows(a, dl, CS_DLOGIT_LD, 16 * mi, 0, lane);
        b_from_f32_t(b, W3, CS_HEAD_LD, 0, G.J0 + 8 * nj, 16, lane);
        float d[4] = {0.f, 0.f, 0.f, 0.f};
        mma_m16n8k16_f32(d, a, b);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = 16 * mi + g + 8 * hh, col = 8 * nj + 2 * t;
            const u32 hv = *reinterpret_cast<const u32*>(h + r * act_ld(G) + G.J0 + col);
            *reinterpret_cast<u32*>(dy + r * (G.n + 8) + col) =
                pack_f16x2(positive_f16(hv & 0xFFFF) ? d[2 * hh] : 0.f, positive_f16(hv >> 16) ? d[2 * hh + 1] : 0.f);
        }
    }
    __syncthreads();  // dy is complete, and every read of W3 is done before its update
}

// The head replica's update, identically in every CTA: W3 -= lr h^T d(logits), b3 -= lr (column sums).
RG_DEVICE void head_update(const CsParams& P, u8* smem, const Geo& G, int ab, float lr) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const CsLayer& Ly = P.layer[G.L - 1];
    float* W3 = reinterpret_cast<float*>(smem + Ly.w_off);
    float* b3 = reinterpret_cast<float*>(smem + Ly.b_off);
    const half_t* h = act_at(P, smem, G, G.L - 2, ab);
    const half_t* dl = reinterpret_cast<const half_t*>(smem + P.dlogit_off);
    for (int mt = warp; mt < G.hs / 16; mt += CS_WARPS) {  // dW3 = h^T d(logits): M = hs, N = 16, K = 32
        float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int kk = 0; kk < CS_ROWS; kk += 16) {
            u32 a[4], b0[2], b1[2];
            a_cols(a, h, act_ld(G), 16 * mt, kk, lane);
            b_rows_pair(b0, b1, dl, CS_DLOGIT_LD, kk, 0, lane);
            mma_m16n8k16_f32(d0, a, b0);
            mma_m16n8k16_f32(d1, a, b1);
        }
        sgd_tile(W3, CS_HEAD_LD, 16 * mt, 0, d0, lr, lane);
        sgd_tile(W3, CS_HEAD_LD, 16 * mt, 8, d1, lr, lane);
    }
    bias_sgd(b3, dl, CS_DLOGIT_LD, 16, lr);
}

// ---- start and end of a launch: global <-> shared ------------------------------------------------------------------

// Hidden layer l's column slice (or, for the head, the whole replica) between global and shared memory.
template <bool LOAD>
RG_DEVICE void move_layer(const CsParams& P, u8* smem, const Geo& G, int l) {
    const CsLayer& Ly = P.layer[l];
    const bool head = l == G.L - 1;
    const int ld = head ? CS_HEAD_LD : G.n + 4, cols = head ? 16 : G.n, c0 = head ? 0 : G.J0;
    float* W = reinterpret_cast<float*>(smem + Ly.w_off);
    float* bias = reinterpret_cast<float*>(smem + Ly.b_off);
    const int pairs = cols / 2;
    for (int e = threadIdx.x; e < (int)Ly.rows * pairs; e += CS_THREADS) {
        const int r = e / pairs, j = 2 * (e % pairs), col = c0 + j;
        if (r >= Ly.in_p || col >= Ly.out_p) continue;  // padding: zero in shared memory, absent in global
        float2* s = reinterpret_cast<float2*>(W + r * ld + j);
        const i64 at = (i64)r * Ly.out_p + col;
        if (LOAD) {
            *s = master_join2(*reinterpret_cast<const u32*>(Ly.w16 + at), *reinterpret_cast<const u32*>(Ly.wlo + at));
        } else {
            u32 hi2, lo2;
            master_split2(*s, hi2, lo2);
            *reinterpret_cast<u32*>(Ly.w16 + at) = hi2;
            *reinterpret_cast<u32*>(Ly.wlo + at) = lo2;
        }
    }
    for (int j = threadIdx.x; j < cols; j += CS_THREADS) {
        if (c0 + j >= Ly.out_p) continue;
        if (LOAD) bias[j] = Ly.b[c0 + j];
        else      Ly.b[c0 + j] = bias[j];
    }
}

#ifdef CS_PROFILE
#define CS_MARK()                                                                          \
    if (G.c == 0 && threadIdx.x == 0 && P.profile != nullptr) {                            \
        u64 now;                                                                           \
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));                            \
        P.profile[mark++] = now;                                                           \
    }
#else
#define CS_MARK()
#endif

// n_steps training steps. Launch: one cluster of C CTAs (grid = C), CS_THREADS threads, P.smem_bytes of dynamic
// shared memory, the layout planned by kernels/cluster.py for this C.
template <int NT>
RG_DEVICE void run_steps(const CsParams* __restrict__ params, int n_steps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) u8 smem[];
    __shared__ CsParams P;  // every phase reads the table: from shared memory, not through the cache hierarchy
    __shared__ __align__(8) u64 bars[CS_BARS];
    for (int i = threadIdx.x; i < (int)(sizeof(CsParams) / 8); i += CS_THREADS)
        reinterpret_cast<u64*>(&P)[i] = reinterpret_cast<const u64*>(params)[i];
    if (threadIdx.x == 0) {
        for (int i = 0; i < CS_BARS; ++i) mbar_init(bars + i, 1);  // one arrival: thread 0's, with the byte count
        fence_mbarrier_init_cluster();
        fence_proxy_async();  // and to the bulk copy engine
    }
    __syncthreads();
    Geo G;
    G.bars = bars;
    G.c = (int)cluster_rank(), G.C = (int)cluster_ctas(), G.n = (int)P.n, G.nt = G.n / 8, G.hs = (int)P.hs;
    G.J0 = G.c * G.n, G.B = (int)P.batch, G.L = (int)P.layers;
    if (dynamic_smem_bytes() < P.smem_bytes || (int)gridDim.x != G.C || G.C * G.n != G.hs) __trap();  // launcher mismatch
    const int tid = threadIdx.x;
    for (i64 i = 16 * tid; i < P.smem_bytes; i += 16 * CS_THREADS) store_16(smem + i, make_uint4(0, 0, 0, 0));
    __syncthreads();
    for (int l = 0; l < G.L; ++l) move_layer<true>(P, smem, G, l);
    const i64 s0 = *P.step;
    int img = tid < G.B ? P.perm[batch_base(P, s0) + tid] : 0;  // warp 0: lane r holds row r's image index
    issue_gather(P, smem, G, img);
    cluster_sync();  // every CTA is set up before anyone stores into its shared memory
#ifdef CS_PROFILE
    int mark = 0;  // stamps the start, then kernels/cluster.py:marks(layers) per step, then SM cycles start/end
    const u64 cycles0 = clock64();
#endif
    CS_MARK();
    double run_loss = 0.0;
    int run_hits = 0;
    const int top = G.L - 2;
    const u32 slice_bytes = (u32)(G.C * CS_ROWS * G.n);  // every CTA's 32 x n slice: x 2 bytes (h), x 4 (partials)
    u32 phases = 0;
    for (int k = 0; k < n_steps; ++k) {
        const i64 s = s0 + k;
        const int ab = (int)(s & 1);  // h_0's buffer
        const bool more = k + 1 < n_steps;
        const float lr = lr_at_step(s, P.lr0, P.lr_min, P.total_steps, P.warmup_steps, (int)P.schedule);
        int label = 0, next = 0;  // warp 0's loads in flight; used in the head (label) and for the next gather
        if (tid < G.B) {
            label = P.labels[img];
            if (more) next = P.perm[batch_base(P, s + 1) + tid];
        }
        __syncthreads();  // the last step's update of W_0 (which reads x) is done
        for (int l = 0; l <= top; ++l) {
            forward_hidden<NT>(P, smem, G, l, ab, phases);
            if (l == top && more) issue_gather(P, smem, G, next);  // the next step's rows (raw is free since
                                                                   // forward 0), issued while h_top is in flight
            CS_MARK();
            receive(G, phases, act_index(l, ab), 2 * slice_bytes);
            CS_MARK();
        }
        head_loss(P, smem, G, ab, label);
        CS_MARK();
        head_dy(P, smem, G, ab, run_loss, run_hits);
        CS_MARK();
        for (int l = top; l > 0; --l) {
            partial_dx<NT>(P, smem, G, l);
            __syncthreads();  // every read of W_l is done before its update
            CS_MARK();
            update_layer<NT>(P, smem, G, l, ab, lr);  // while the partials are in flight
            if (l == top) head_update(P, smem, G, ab, lr);
            CS_MARK();
            receive(G, phases, CS_RS_BAR + ((l - 1) & 1), 4 * slice_bytes);
            CS_MARK();
            collect_dy(P, smem, G, l - 1, ab);
            CS_MARK();
        }
        update_layer<NT>(P, smem, G, 0, ab, lr);
        if (top == 0) head_update(P, smem, G, ab, lr);
        CS_MARK();
        img = next;
    }
#ifdef CS_PROFILE
    if (G.c == 0 && tid == 0 && P.profile != nullptr) P.profile[mark] = cycles0, P.profile[mark + 1] = clock64();
#endif
    cluster_sync();  // nobody stores into this CTA's shared memory any more
    for (int l = 0; l < G.L; ++l) {
        if (l < G.L - 1 || G.c == 0) move_layer<false>(P, smem, G, l);
    }
    if (G.c == 0 && tid == 0) {
        *P.loss_sum += run_loss;
        *P.correct += run_hits;
        *P.step = s0 + n_steps;
    }
#else
    __trap();  // thread-block clusters need sm_90; kernels/cluster.py never launches this below it
#endif
}

#define CS_INSTANCE(NT)                                                                                  \
    extern "C" __global__ void __launch_bounds__(CS_THREADS, 1) cluster_steps_##NT(                    \
        const CsParams* __restrict__ params, int n_steps) {                                              \
        run_steps<NT>(params, n_steps);                                                                  \
    }
CS_INSTANCE(1)
CS_INSTANCE(2)
CS_INSTANCE(4)
