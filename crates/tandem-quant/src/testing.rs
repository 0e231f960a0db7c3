//! Deterministic test inputs that this crate's tests and the crates above share. Not part of the API.
#![doc(hidden)]

/// A deterministic xorshift generator for test inputs (its state must not be 0).
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A value in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// Roughly normal (a sum of uniforms), times `scale`.
    pub fn normal(&mut self, scale: f32) -> f32 {
        (0..4).map(|_| self.uniform()).sum::<f32>() * 0.87 * scale
    }
}
