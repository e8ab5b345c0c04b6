//! A weight as the product loops read it: its format and its data, borrowed from MLX's arrays.

/// Scales or biases of quantized weights, in the dtype the checkpoint stores: [`Floats`].
pub type Params<'a> = Floats<'a>;

/// A weight matrix [n, k], row-major.
#[derive(Clone, Copy)]
pub enum Weight<'a> {
    F32(&'a [f32]),
    /// bfloat16 bit patterns.
    Bf16(&'a [u16]),
    /// float16 bit patterns.
    F16(&'a [u16]),
    Quantized(Quantized<'a>),
}

/// An MLX affine-quantized matrix [n, k]: row o holds k / (32 / bits) words, low bits first;
/// one scale and bias per `group` weights: w = scale · q + bias.
#[derive(Clone, Copy)]
pub struct Quantized<'a> {
    pub packed: &'a [u32],
    pub scales: Params<'a>,
    pub biases: Params<'a>,
    pub bits: u32,
    pub group: usize,
}

impl Quantized<'_> {
    /// The integer q of element i of row o (rows k long).
    pub fn q(&self, o: usize, k: usize, i: usize) -> u32 {
        let per_word = (32 / self.bits) as usize;
        let word = self.packed[(o * k + i) / per_word];
        (word >> (self.bits as usize * (i % per_word))) & ((1u32 << self.bits) - 1)
    }
}

/// x's rows [.., k] with each run of `run` elements as its even elements, then its odd ones:
/// the order in which the low and then the high nibbles of `run / 2` bytes of 4-bit weights
/// come out, so that loops reading them multiply like with like.
pub fn even_then_odd(x: &[f32], run: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for elements in x.chunks_exact(run) {
        out.extend(elements.iter().step_by(2));
        out.extend(elements.iter().skip(1).step_by(2));
    }
    out
}

/// Values of one of MLX's float dtypes as stored, read in place: a KV cache's keys and values,
/// a quantized weight's scales and biases.
#[derive(Clone, Copy)]
pub enum Floats<'a> {
    F32(&'a [f32]),
    /// bfloat16 bit patterns.
    Bf16(&'a [u16]),
    /// float16 bit patterns.
    F16(&'a [u16]),
}

impl Floats<'_> {
    /// Inlined into the product loops, which read one scale and one bias per row and group:
    /// as a call it took an eighth of a quantized decode step.
    #[inline(always)]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            Floats::F32(p) => p[i],
            Floats::Bf16(p) => f32::from_bits((p[i] as u32) << 16),
            Floats::F16(p) => half::f16::from_bits(p[i]).to_f32(),
        }
    }
}

impl<'a> Floats<'a> {
    /// Elements `from..from + len`.
    pub fn range(self, from: usize, len: usize) -> Floats<'a> {
        match self {
            Floats::F32(v) => Floats::F32(&v[from..from + len]),
            Floats::Bf16(v) => Floats::Bf16(&v[from..from + len]),
            Floats::F16(v) => Floats::F16(&v[from..from + len]),
        }
    }

    /// Elements from `from` on.
    pub fn from(self, from: usize) -> Floats<'a> {
        self.range(from, self.len() - from)
    }

    pub fn len(&self) -> usize {
        match self {
            Floats::F32(v) => v.len(),
            Floats::Bf16(v) | Floats::F16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values as a weight [n, k] for the product loops.
    pub fn weight(self) -> Weight<'a> {
        match self {
            Floats::F32(v) => Weight::F32(v),
            Floats::Bf16(v) => Weight::Bf16(v),
            Floats::F16(v) => Weight::F16(v),
        }
    }
}
