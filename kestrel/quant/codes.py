"""Element and scale codes: e2m1 (FP4), e4m3 (FP8, the `fn` variant: no inf, one NaN per sign) and e8m0 (a biased
power-of-two exponent), plus the FP4 nibble packing every FP4 checkpoint uses.

Rounding is round-to-nearest, ties to the even code; values beyond a format's largest finite value saturate to it
(the OCP MX spec's conversion for FP4 and its "saturating" mode for FP8, NVIDIA's `cvt.rn.satfinite`). NaN:
e4m3 keeps it (code 0x7F / 0xFF); e2m1 has no NaN or inf, so a block that holds one is marked by its *scale*
(e8m0 0xFF, e4m3 0x7F), which makes the whole block decode to NaN (the OCP MX rule). Code here is plain torch and
runs on any device.
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_EMAX = 2          # floor(log2(6)): the exponent of e2m1's largest normal
E4M3_EMAX = 8          # floor(log2(448))
E8M0_BIAS = 127
E8M0_NAN = 0xFF

# magnitudes of e2m1 codes 0..7 (code bit 3 is the sign)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# midpoints between neighbouring magnitudes; a value exactly on midpoint i (between codes i and i+1) goes to the
# even one of the two codes: down for even i, up for odd i
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Codes (uint8 0..15, one per element) of x rounded to e2m1: RNE, saturating at +-6; the sign bit follows
    x's sign bit (so -0.0 is code 8). NaN encodes as code 0 (its block's scale carries the NaN)."""
    xf = x.float()
    mag = xf.abs().nan_to_num(nan=0.0)
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for i, m in enumerate(_E2M1_MIDPOINTS):
        code += (mag >= m if i % 2 else mag > m).to(torch.uint8)
    return code | (torch.signbit(xf).to(torch.uint8) << 3)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """fp32 values of e2m1 codes (uint8 0..15)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=code.device)
    c = code.long()
    mag = table[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


def pack_nibbles(code: torch.Tensor) -> torch.Tensor:
    """Two e2m1 codes per byte along the last dim: element 2j in the low nibble, 2j+1 in the high nibble (the order
    compressed-tensors' `pack_fp4_to_uint8` and ModelOpt's NVFP4 export both write)."""
    if code.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even last dimension, got {tuple(code.shape)}")
    return code[..., 0::2] | (code[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_nibbles`: [..., K/2] uint8 -> [..., K] codes."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed FP4 must be uint8, got {packed.dtype}")
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def div_by(x: torch.Tensor, c: float) -> torch.Tensor:
    """x / c, the IEEE (correctly rounded) quotient on every device. On CUDA torch divides by a Python scalar (or
    a CPU 0-dim tensor) as a multiplication by its rounded reciprocal (1344 / 448 gives 2.9999998, not 3; a fifth
    of amax / 2688 land one ulp off), so the divisor is a tensor on x's device; the kernels divide with div_rn
    and must agree with these references bit for bit on every device."""
    return x / torch.full_like(x, c)


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 with IEEE division (`div_by`; 1.0 where amax is 0): the e4m3 scale."""
    return torch.where(amax > 0, div_by(amax, E4M3_MAX), torch.ones_like(amax))


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """x rounded to float8_e4m3fn (RNE), saturating at +-448 (inf too); NaN stays NaN. The explicit clamp makes
    saturation independent of how a torch build casts out-of-range values."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e8m0_encode(exponent: torch.Tensor) -> torch.Tensor:
    """e8m0 codes (uint8) of power-of-two scales 2**exponent; exponents are clamped to the code range
    [-127, 127]; a NaN exponent gives the NaN code 0xFF."""
    e = exponent.float()
    code = (e.nan_to_num(nan=0.0).clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)
    return torch.where(e.isnan(), torch.full_like(code, E8M0_NAN), code)


def e8m0_decode(code: torch.Tensor) -> torch.Tensor:
    """fp32 scales 2**(code - 127) of e8m0 codes (uint8, or float8_e8m0fnu bits); code 0xFF is NaN. Code 0 is
    2**-127, a float32 subnormal (exact)."""
    if code.dtype == torch.float8_e8m0fnu:
        code = code.view(torch.uint8)
    c = code.to(torch.int32)
    scale = torch.ldexp(torch.ones_like(c, dtype=torch.float32), c - E8M0_BIAS)
    return torch.where(c == E8M0_NAN, torch.full_like(scale, float("nan")), scale)


def mx_scale_exponent(amax: torch.Tensor, elem_emax: int, rule: str = "ocp") -> torch.Tensor:
    """The shared power-of-two exponent of an MX block whose largest magnitude is `amax`.

    "ocp" (the OCP MX spec v1.0, section 6.3): floor(log2(amax)) - elem_emax. The block's largest value then lands
    in [2**emax, 2**(emax+1)) and saturates when it exceeds the element's max (e2m1: above 6 of 8; e4m3: above
    448 of 512). "round-up" (compressed-tensors' `generate_mx_scales`, vLLM's MXFP4 reference): amax is first
    rounded to a power of two, up when its mantissa is >= 1.75, which moves those blocks one exponent up so they
    do not saturate (compressed-tensors uses this for MXFP8 too, with the same 1.75 threshold). "ceil"
    (ModelOpt's MXFP4QTensor): ceil(log2(amax / elem_max)), the smallest scale that never saturates (one exponent
    above "ocp" whenever amax's mantissa exceeds elem_max's). A zero block gets the smallest exponent; a block
    with a NaN or inf gets NaN (decodes to a NaN block). All three decode the same way."""
    a = amax.float()
    finite = torch.isfinite(a)
    safe = torch.where(finite & (a > 0), a, torch.ones_like(a))
    mantissa, exp = torch.frexp(safe)          # safe = mantissa * 2**exp, mantissa in [0.5, 1)
    e = (exp - 1).float()                      # floor(log2(safe))
    if rule == "round-up":
        e = e + (mantissa >= 0.875).float()
    elif rule == "ceil":
        elem_max = {E2M1_EMAX: E2M1_MAX, E4M3_EMAX: E4M3_MAX}[elem_emax]
        e = torch.ceil(torch.log2(safe / elem_max)) + elem_emax
    elif rule != "ocp":
        raise ValueError(f"MX scale rule {rule!r}: use 'ocp', 'round-up' or 'ceil'")
    e = e - elem_emax
    e = torch.where(a > 0, e, torch.full_like(e, -E8M0_BIAS))
    return torch.where(finite, e, torch.full_like(e, float("nan")))
