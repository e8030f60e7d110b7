"""MXFP4 (compressed-tensors `mxfp4-pack-quantized`, group 32): K3's routed-expert storage."""

from __future__ import annotations

import numpy as np



E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
_E2M1_MID = (E2M1[1:] + E2M1[:-1]) / 2
MXFP4_GROUP = 32


def quantize_mxfp4(w) -> tuple[np.ndarray, np.ndarray]:
    """Lossy: w [out, in] (in % 32 == 0) -> (packed u8 [out, in/2], scale u8 [out, in/32]).

    Each group of 32 inputs gets the smallest power-of-two scale 2^e with max|w| / 2^e <= 6 (UE8M0
    byte e + 127, e clipped to [-127, 127]); each value is rounded to the nearest E2M1 magnitude
    (ties to the even code), sign in bit 3; the low nibble holds the even input column.
    """
    x = np.asarray(w, np.float32)
    out, n = x.shape
    if n % MXFP4_GROUP:
        raise ValueError(f"MXFP4 needs the input width to be a multiple of {MXFP4_GROUP}, got {n}")
    x = x.reshape(out, n // MXFP4_GROUP, MXFP4_GROUP)
    amax = np.abs(x).max(-1).astype(np.float64)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.ceil(np.log2(amax / 6.0)), -127.0)
    e = np.clip(e, -127, 127)
    e = np.where(amax / np.exp2(e) > 6.0, e + 1, e)  # guard log2 rounding
    e = np.where((e > -127) & (amax / np.exp2(e - 1) <= 6.0), e - 1, e)
    e = e.astype(np.int32)
    y = np.ldexp(x, -e[..., None])
    mag = np.abs(y)
    lo = np.searchsorted(_E2M1_MID, mag, side="left")
    hi = np.searchsorted(_E2M1_MID, mag, side="right")
    idx = np.where((lo != hi) & (lo % 2 == 1), hi, lo).astype(np.uint8)  # exact tie -> even code
    nib = idx | (((y < 0) & (idx > 0)).astype(np.uint8) << 3)
    nib = nib.reshape(out, n)
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
    return packed, (e + 127).astype(np.uint8)


def dequantize_mxfp4(packed, scale, dtype=np.float32) -> np.ndarray:
    """(packed u8 [out, in/2], scale u8 [out, in/32]) -> w [out, in] in `dtype`."""
    packed = np.asarray(packed, np.uint8)
    scale = np.asarray(scale, np.uint8)
    out, half = packed.shape
    n = 2 * half
    if scale.shape != (out, n // MXFP4_GROUP) or n % MXFP4_GROUP:
        raise ValueError(f"MXFP4 scale shape {scale.shape} does not fit packed shape {packed.shape}")
    nib = np.empty((out, n), np.uint8)
    nib[:, 0::2] = packed & 0xF
    nib[:, 1::2] = packed >> 4
    val = np.where(nib & 8, -E2M1[nib & 7], E2M1[nib & 7]).reshape(out, -1, MXFP4_GROUP)
    val = np.ldexp(val, scale.astype(np.int32)[..., None] - 127)
    return val.reshape(out, n).astype(dtype)
