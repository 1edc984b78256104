//! numpy's legacy `RandomState`: the only source of randomness in Megatron's indices.
//!
//! MT19937 seeded with `init_genrand`, numpy's masked-rejection `random_interval`, and
//! Fisher–Yates from the end (`_shuffle_raw`). `rand`'s ranges and shuffles use other
//! algorithms and would give other permutations.

const N: usize = 624;
const M: usize = 397;

/// `numpy.random.RandomState(seed)`, bit for bit.
#[derive(Clone)]
pub struct RandomState {
    state: [u32; N],
    index: usize,
}

impl std::fmt::Debug for RandomState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RandomState")
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

impl RandomState {
    /// `RandomState(seed)` for an integer seed (numpy's `init_genrand`).
    pub fn new(seed: u32) -> Self {
        let mut state = [0u32; N];
        state[0] = seed;
        for i in 1..N {
            let previous = state[i - 1];
            state[i] = 1_812_433_253u32
                .wrapping_mul(previous ^ (previous >> 30))
                .wrapping_add(i as u32);
        }
        Self { state, index: N }
    }

    fn regenerate(&mut self) {
        const UPPER: u32 = 0x8000_0000;
        const LOWER: u32 = 0x7fff_ffff;
        const MATRIX_A: u32 = 0x9908_b0df;
        for i in 0..N {
            let y = (self.state[i] & UPPER) | (self.state[(i + 1) % N] & LOWER);
            let mut value = self.state[(i + M) % N] ^ (y >> 1);
            if y & 1 != 0 {
                value ^= MATRIX_A;
            }
            self.state[i] = value;
        }
        self.index = 0;
    }

    /// The next 32-bit output (`genrand_int32`).
    pub fn next_u32(&mut self) -> u32 {
        if self.index >= N {
            self.regenerate();
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// Two outputs, the first as the high half (numpy's `next_uint64`).
    pub fn next_u64(&mut self) -> u64 {
        let high = u64::from(self.next_u32());
        (high << 32) | u64::from(self.next_u32())
    }

    /// A uniform integer in `[0, max]` by masked rejection (numpy's `random_interval`).
    pub fn random_interval(&mut self, max: u64) -> u64 {
        if max == 0 {
            return 0;
        }
        let mut mask = max;
        for shift in [1, 2, 4, 8, 16, 32] {
            mask |= mask >> shift;
        }
        if max <= u64::from(u32::MAX) {
            loop {
                let value = u64::from(self.next_u32()) & mask;
                if value <= max {
                    return value;
                }
            }
        }
        loop {
            let value = self.next_u64() & mask;
            if value <= max {
                return value;
            }
        }
    }

    /// Shuffles in place as `RandomState.shuffle` does a 1-D array (the element type
    /// does not matter).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.random_interval(i as u64) as usize;
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Vectors from numpy 2.4 (`randint(0, 2**32, dtype=uint64)` is the raw stream).
    #[test]
    fn raw_stream_matches_numpy() {
        for (seed, expected) in [
            (1234u32, [822569775u32, 2137449171, 2671936806, 3512589365]),
            (5489, [3499211612, 581869302, 3890346734, 3586334585]),
            (0, [2357136044, 2546248239, 3071714933, 3626093760]),
            (u32::MAX, [419326371, 479346978, 3918654476, 2416749639]),
        ] {
            let mut rs = RandomState::new(seed);
            let got: Vec<u32> = (0..4).map(|_| rs.next_u32()).collect();
            assert_eq!(got, expected, "seed {seed}");
        }
    }

    fn checksum(permutation: &[u64]) -> u64 {
        const P: u128 = (1 << 61) - 1;
        permutation.iter().enumerate().fold(0u128, |s, (i, &v)| {
            (s * 1_000_003 + u128::from(v) * (i as u128 + 1)) % P
        }) as u64
    }

    /// `RandomState(seed).shuffle(arange(n))` from numpy 2.4: first elements and a
    /// checksum of the whole permutation.
    #[test]
    fn shuffles_match_numpy() {
        let cases: [(u32, usize, u64, &[u64]); 12] = [
            (0, 10, 1492612604583069102, &[2, 8, 4, 9, 1]),
            (0, 1000, 1013303751464292048, &[993, 859, 298, 553, 672]),
            (
                0,
                70000,
                2158609630486189790,
                &[10840, 56267, 14849, 62726, 47180],
            ),
            (1234, 10, 77354589276154133, &[7, 2, 9, 1, 0]),
            (1234, 1000, 78113663324112787, &[681, 990, 155, 768, 438]),
            (
                1234,
                70000,
                2132902197148203735,
                &[27504, 57935, 40387, 24455, 66362],
            ),
            (98765, 10, 841499765111992332, &[8, 7, 1, 2, 0]),
            (98765, 1000, 22671847410321867, &[734, 219, 278, 498, 1]),
            (
                98765,
                70000,
                190105661855797628,
                &[44701, 68405, 9448, 25721, 12859],
            ),
            (u32::MAX, 10, 573077783465278409, &[6, 9, 5, 1, 8]),
            (
                u32::MAX,
                1000,
                810602088985197557,
                &[94, 405, 819, 632, 217],
            ),
            (
                u32::MAX,
                70000,
                1025230903856659854,
                &[14972, 66828, 49490, 22806, 60806],
            ),
        ];
        for (seed, n, sum, head) in cases {
            let mut items: Vec<u64> = (0..n as u64).collect();
            RandomState::new(seed).shuffle(&mut items);
            assert_eq!(&items[..5], head, "seed {seed}, n {n}");
            assert_eq!(checksum(&items), sum, "seed {seed}, n {n}");
        }
        let mut spec_example: Vec<u32> = (0..10).collect();
        RandomState::new(1234).shuffle(&mut spec_example);
        assert_eq!(spec_example, [7, 2, 9, 1, 0, 8, 4, 5, 6, 3]);
        for n in [0usize, 1] {
            let mut rs = RandomState::new(1);
            let mut items: Vec<u8> = vec![0; n];
            rs.shuffle(&mut items);
            assert_eq!(
                rs.next_u32(),
                RandomState::new(1).next_u32(),
                "n = {n} draws nothing"
            );
        }
    }

    #[test]
    fn one_stream_across_shuffles_and_wide_intervals() {
        let mut rs = RandomState::new(1234);
        let (mut a, mut b) = ([0, 1, 2, 3], [0, 1, 2, 3]);
        rs.shuffle(&mut a);
        rs.shuffle(&mut b);
        assert_eq!((a, b), ([0, 1, 2, 3], [1, 2, 3, 0]));
        // `randint(0, 2**40, dtype=int64)`: 64-bit draws, high half first.
        let mut rs = RandomState::new(1234);
        let wide: Vec<u64> = (0..5).map(|_| rs.random_interval((1 << 40) - 1)).collect();
        assert_eq!(
            wide,
            [
                204000912083,
                166721346613,
                878802328948,
                656147994617,
                617876871857
            ]
        );
        let mut rs = RandomState::new(7);
        let full: Vec<u64> = (0..3)
            .map(|_| rs.random_interval(u64::from(u32::MAX)))
            .collect();
        assert_eq!(full, [327741615, 976413892, 3349725721]);
    }
}
