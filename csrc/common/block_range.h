// Which tiles of the (query, key) plane an attention window touches, in one place for both directions: the key
// blocks of a query tile (forward), the query blocks of a key tile (backward), and whether a tile needs its mask.
// Both ranges come from one predicate (some row of the tile sees some column of it), so a backward CTA visits exactly
// the query tiles whose forward visits it, which the deterministic dQ ordering relies on.
#pragma once

#include <cute/int_tuple.hpp>

namespace flash {

struct Interval {
    int lo, hi;  // [lo, hi)
    __host__ __device__ bool empty() const { return hi <= lo; }
};

// Split-KV: chunk `split` of a block range cut into `splits` contiguous chunks of equal length (the last ones
// shorter or empty).
__host__ __device__ inline Interval split_chunk(Interval r, int split, int splits) {
    int const per = (r.hi - r.lo + splits - 1) / splits;
    int const lo = r.hi < r.lo + split * per ? r.hi : r.lo + split * per;
    return {lo, r.hi < lo + per ? r.hi : lo + per};
}

// Query i sees key j iff i + off - left <= j <= i + off + right, off = sk - sq (bottom-right), 0 <= j < sk; a bound
// of -1 is absent.
struct AttnWindow {
    int sq, sk, left, right;

    __host__ __device__ int diag_offset() const { return sk - sq; }

    // Keys that some row in [r0, r1] sees.
    __host__ __device__ Interval keys_of_rows(int r0, int r1) const {
        int const lo = left >= 0 ? cute::max(0, r0 + diag_offset() - left) : 0;
        int const hi = right >= 0 ? cute::min(sk, r1 + diag_offset() + right + 1) : sk;
        return {lo, cute::max(lo, hi)};
    }

    // Rows that see some key in [c0, c1].
    __host__ __device__ Interval rows_of_keys(int c0, int c1) const {
        int const lo = right >= 0 ? cute::max(0, c0 - diag_offset() - right) : 0;
        int const hi = left >= 0 ? cute::min(sq, c1 - diag_offset() + left + 1) : sq;
        return {lo, cute::max(lo, hi)};
    }
};

__host__ __device__ inline int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

template <int kBlockM, int kBlockN>
struct BlockRange {
    // Key blocks [lo, hi) that query rows [r0, r1] visit.
    __host__ __device__ static Interval n_blocks_of_rows(AttnWindow const& w, int r0, int r1) {
        Interval const keys = w.keys_of_rows(r0, r1);
        return keys.empty() ? Interval{0, 0} : Interval{keys.lo / kBlockN, (keys.hi + kBlockN - 1) / kBlockN};
    }

    // Key blocks [lo, hi) that query tile m_block visits.
    __host__ __device__ static Interval n_blocks(AttnWindow const& w, int m_block) {
        int const r0 = m_block * kBlockM;
        return n_blocks_of_rows(w, r0, cute::min(w.sq, r0 + kBlockM) - 1);
    }

    // Query blocks [lo, hi) that key tile n_block is visited by.
    __host__ __device__ static Interval m_blocks(AttnWindow const& w, int n_block) {
        int const c0 = n_block * kBlockN;
        Interval const rows = w.rows_of_keys(c0, cute::min(w.sk, c0 + kBlockN) - 1);
        return rows.empty() ? Interval{0, 0} : Interval{rows.lo / kBlockM, (rows.hi + kBlockM - 1) / kBlockM};
    }

    // Whether some score of tile (m_block, n_block) must be masked: keys past sk, or a window edge crossing the tile.
    // Conservative on the last query tile (rows past sq count as real), which only costs a mask.
    __host__ __device__ static bool needs_mask(AttnWindow const& w, int m_block, int n_block) {
        return needs_mask_of_rows(w, m_block * kBlockM, m_block * kBlockM + kBlockM - 1, n_block);
    }

    // The same for query rows [r0, r1].
    __host__ __device__ static bool needs_mask_of_rows(AttnWindow const& w, int r0, int r1, int n_block) {
        int const c0 = n_block * kBlockN;
        return c0 + kBlockN > w.sk ||
               (w.right >= 0 && c0 + kBlockN - 1 > r0 + w.diag_offset() + w.right) ||
               (w.left >= 0 && c0 < r1 + w.diag_offset() - w.left);
    }

    // The key blocks [lo, hi) of query tile m_block for which needs_mask is false (not clipped to n_blocks), so that
    // a main loop can run them without mask code.
    __host__ __device__ static Interval unmasked_n_blocks(AttnWindow const& w, int m_block) {
        int const r0 = m_block * kBlockM;
        int hi = w.sk / kBlockN;
        if (w.right >= 0) { hi = cute::min(hi, floor_div(r0 + w.diag_offset() + w.right + 1, kBlockN)); }
        int const lo = w.left >= 0 ? -floor_div(-(r0 + kBlockM - 1 + w.diag_offset() - w.left), kBlockN) : 0;
        return {lo, cute::max(lo, hi)};
    }
};

}  // namespace flash
