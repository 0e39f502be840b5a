"""The MLA latent cache's page formats: how one token's latent `[c_kv (L) | k_pe (R)]` is stored in a page row.

A layer's pages are one tensor `[num_pages, page_size, width]`; page copies, transfers and the block table never
look inside a row. Plain formats store the row as it is (`bf16`, `fp16`, `fp32`: width L + R in that dtype).
Quantized formats store a row as bytes (uint8, width `row_bytes`), in this order, so that every field is aligned
for its own dtype when the page tensor is viewed as that dtype (`views`):

| format | fp32 scales | k_pe | c_kv values | block scales | K3 / Kimi Linear bytes per token |
|---|---|---|---|---|---|
| fp8 | one per group of 128 channels (L / 128) | bf16 | e4m3, L bytes | - | 16 + 128 + 512 = 656 (bf16: 1152) |
| nvfp4 | one per token (the second level) | bf16 | e2m1, two per byte | e4m3 per 16 | 4 + 128 + 256 + 32 = 420 -> 432 |

Rows are padded to a multiple of 16 bytes (one GPU vector load). Scales are chosen per token (a token is written
once and never rescaled):
- FP8: per group of `min(128, L)` channels, scale = amax / 448 (quant.formats' per-row FP8 over [T * L/128, 128]),
  so a value x decodes with |x - x'| <= max(2^-4 |x|, 2^-10 s), s = the group's amax / 448 (half an e4m3 ulp:
  3 mantissa bits; the subnormal step 2^-9 s below 2^-6 s). A group of 128 rather than one scale per token keeps
  a large channel from flattening the rest (vLLM's and FlashMLA's FP8 MLA caches use the same 128-groups).
- NVFP4: quant.formats' NVFP4 with ModelOpt's multiplier convention and one fp32 second-level scale per token
  (amax / (448 * 6)): e2m1 keeps 1 mantissa bit, so |x - x'| <= 2^-2 |x| + the e4m3 rounding of the block scale
  (2^-4 relative) on the block's largest values, and values below a quarter of the block's scale step vanish.
- k_pe (the 64 positional dims that every head scores against) stays bf16 in both: it is 10% of the bf16 row, and
  keeping it exact keeps the position-carrying part of the score as bf16 KV has it (vLLM's and FlashMLA's FP8 MLA
  caches keep it 16-bit too).

`decode` is the reference dequantize every kernel that reads these pages is checked against: fp32 math
(values * scale), rounded once to the dtype asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.quant.formats import NVFP4_BLOCK, dequantize_fp8, dequantize_nvfp4, quantize_fp8, quantize_nvfp4

PLAIN = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
QUANTIZED = ("fp8", "nvfp4")
KV_CACHE_DTYPES = ("auto", "bf16", "fp8", "nvfp4")       # the --kv-cache-dtype choices
FP8_GROUP = 128
ROW_ALIGN = 16
PE_DTYPE = torch.bfloat16


def dtype_name(dtype: torch.dtype) -> str:
    """The plain format of a model dtype (`--kv-cache-dtype auto`)."""
    for name, d in PLAIN.items():
        if d == dtype:
            return name
    raise ValueError(f"no plain KV page format for {dtype}")


@dataclass(frozen=True)
class KvPageFormat:
    kind: str              # bf16 | fp16 | fp32 | fp8 | nvfp4
    kv_lora_rank: int      # L: c_kv width
    rope_dim: int          # R: k_pe width

    def __post_init__(self) -> None:
        if self.kind not in PLAIN and self.kind not in QUANTIZED:
            raise ValueError(f"KV page format {self.kind!r}: use one of {', '.join([*PLAIN, *QUANTIZED])}")
        why = self.unsupported(self.kind, self.kv_lora_rank)
        if why:
            raise ValueError(why)

    @staticmethod
    def unsupported(kind: str, kv_lora_rank: int) -> str | None:
        """Why a latent of this width cannot be stored in `kind`, or None."""
        if kind == "fp8" and kv_lora_rank % min(FP8_GROUP, kv_lora_rank):
            return f"an FP8 KV cache needs kv_lora_rank {kv_lora_rank} to be a multiple of {FP8_GROUP} (or below it)"
        if kind == "nvfp4" and kv_lora_rank % NVFP4_BLOCK:
            return f"an NVFP4 KV cache needs kv_lora_rank {kv_lora_rank} to be a multiple of {NVFP4_BLOCK}"
        return None

    # ---- layout ----------------------------------------------------------------------------------------------
    @property
    def quantized(self) -> bool:
        return self.kind in QUANTIZED

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.quantized else PLAIN[self.kind]

    @property
    def group(self) -> int:
        """Channels per fp32 scale (fp8) or per e4m3 block scale (nvfp4)."""
        return min(FP8_GROUP, self.kv_lora_rank) if self.kind == "fp8" else NVFP4_BLOCK

    @property
    def num_fp32(self) -> int:
        """fp32 scales at the head of a row: one per group (fp8) or the token's second-level scale (nvfp4)."""
        return self.kv_lora_rank // self.group if self.kind == "fp8" else 1

    @property
    def pe_offset(self) -> int:
        return 4 * self.num_fp32

    @property
    def values_offset(self) -> int:
        return self.pe_offset + 2 * self.rope_dim

    @property
    def value_bytes(self) -> int:
        return self.kv_lora_rank if self.kind == "fp8" else self.kv_lora_rank // 2

    @property
    def block_scale_offset(self) -> int:
        """nvfp4: the e4m3 block scales follow the packed values."""
        return self.values_offset + self.value_bytes

    @property
    def row_bytes(self) -> int:
        if not self.quantized:
            return (self.kv_lora_rank + self.rope_dim) * PLAIN[self.kind].itemsize
        end = self.block_scale_offset + (self.kv_lora_rank // NVFP4_BLOCK if self.kind == "nvfp4" else 0)
        return -(-end // ROW_ALIGN) * ROW_ALIGN

    @property
    def width(self) -> int:
        """The page tensor's last dimension."""
        return self.row_bytes if self.quantized else self.kv_lora_rank + self.rope_dim

    def allocate(self, num_pages: int, page_size: int, device: torch.device | str) -> torch.Tensor:
        return torch.zeros(num_pages, page_size, self.width, dtype=self.storage_dtype, device=device)

    def matches(self, pages: torch.Tensor) -> bool:
        return pages.dtype == self.storage_dtype and pages.shape[-1] == self.width

    def views(self, pages: torch.Tensor) -> dict[str, torch.Tensor]:
        """A quantized page tensor [..., row_bytes] as its fields, each a view of the same bytes:
        `scale` fp32 [..., num_fp32], `k_pe` bf16 [..., R], `values` (fp8: float8_e4m3fn [..., L]; nvfp4: packed
        uint8 [..., L/2]) and, for nvfp4, `block_scale` float8_e4m3fn [..., L/16]."""
        if not self.quantized:
            raise ValueError(f"{self.kind} pages hold plain rows")
        L, R = self.kv_lora_rank, self.rope_dim
        v = {"scale": pages[..., :self.pe_offset].view(torch.float32),
             "k_pe": pages[..., self.pe_offset:self.values_offset].view(PE_DTYPE)}
        vals = pages[..., self.values_offset:self.values_offset + self.value_bytes]
        if self.kind == "fp8":
            v["values"] = vals.view(torch.float8_e4m3fn)
        else:
            v["values"] = vals
            v["block_scale"] = pages[..., self.block_scale_offset:self.block_scale_offset + L // NVFP4_BLOCK] \
                .view(torch.float8_e4m3fn)
        assert v["k_pe"].shape[-1] == R
        return v

    # ---- encode / decode (plain torch: the reference) ----------------------------------------------------------
    def encode(self, latent: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        """Rows [T, width] in the storage dtype of latents [T, L] and k_pe [T, R]."""
        if not self.quantized:
            return torch.cat([latent, k_pe], dim=-1).to(self.storage_dtype)
        T, L = latent.shape
        pe = k_pe.to(PE_DTYPE).contiguous().view(torch.uint8)
        if self.kind == "fp8":
            q, s = quantize_fp8(latent.float().reshape(T * L // self.group, self.group), "channel")
            fields = [s.reshape(T, -1).view(torch.uint8), pe, q.reshape(T, L).view(torch.uint8)]
        else:
            packed, block, second = quantize_nvfp4(latent.float(), "modelopt", per_row=True)
            fields = [second.reshape(T, 1).view(torch.uint8), pe, packed, block.view(torch.uint8)]
        row = torch.cat(fields, dim=-1)
        return torch.nn.functional.pad(row, (0, self.row_bytes - row.shape[-1]))

    def decode(self, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[..., L + R] in `dtype` of stored rows [..., width]: values * scale in fp32, rounded once."""
        if not self.quantized:
            return rows.to(dtype)
        v = self.views(rows)
        L = self.kv_lora_rank
        if self.kind == "fp8":
            vals = v["values"].unflatten(-1, (-1, self.group))
            c = dequantize_fp8(vals, v["scale"].unsqueeze(-1), "channel").flatten(-2)
        else:
            c = dequantize_nvfp4(v["values"], v["block_scale"], v["scale"], divisor=False)
        assert c.shape[-1] == L
        return torch.cat([c, v["k_pe"].float()], dim=-1).to(dtype)


def page_format(kind: str, kv_lora_rank: int, rope_dim: int) -> KvPageFormat:
    return KvPageFormat(kind, kv_lora_rank, rope_dim)
