"""Pack small integer codes into 32-bit words, and back, with whole-tensor torch ops.

Layout ("planar", chosen so that every pass reads and writes contiguous memory): a stream of
``n`` codes of ``b`` bits is padded with code 0 to ``n'``, a multiple of the codes per 32-bit
word (``32 / b``: 16 for 2-bit codes), and cut into ``p = 8 / b`` planes of ``m = n' / p``
codes. Byte ``j`` of the packed stream holds code ``j + k * m`` of every plane ``k`` in its bits
``b*k .. b*k + b - 1``; four consecutive bytes form one ``int32`` word, so 16 two-bit codes
share a word. Packing is ``p - 1`` shift-or passes over contiguous planes; unpacking is one
broadcast shift and one mask, which writes the planes back in order. No Python loop ever
touches an element, and the intermediates are bytes.

A leading batch shape is kept: codes of shape ``(..., n)`` pack to words ``(..., words)``, each
row on its own (the two-phase exchange packs one row per destination rank this way).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__: list[str] = []

_WORD_BYTES = 4
_SUPPORTED_BITS = (1, 2, 4, 8)


def codes_per_word(bits: int) -> int:
    """How many ``bits``-bit codes one 32-bit word holds."""
    if bits not in _SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {_SUPPORTED_BITS}, got {bits}")
    return 8 * _WORD_BYTES // bits


def packed_words(numel: int, bits: int = 2) -> int:
    """Number of 32-bit words that hold ``numel`` codes of ``bits`` bits (the last one padded)."""
    per_word = codes_per_word(bits)
    return (numel + per_word - 1) // per_word


def pack_bits(codes: Tensor, bits: int = 2) -> Tensor:
    """Pack integer ``codes`` in ``[0, 2**bits)`` (last dimension) into ``int32`` words.

    Args:
        codes: integer or bool tensor of shape ``(..., n)`` (a 0-dim or 1-D tensor is one
            row). ``n`` need not be a multiple of the codes per word: the rows are padded with
            code 0. Only the low ``bits`` bits of each code are kept.
        bits: width of one code (1, 2, 4 or 8).

    Returns:
        ``int32`` tensor of shape ``(..., packed_words(n, bits))``.
    """
    per_word = codes_per_word(bits)
    planes = 8 // bits
    rows = codes.reshape(-1, codes.shape[-1]) if codes.dim() > 1 else codes.reshape(1, -1)
    rows = rows.to(torch.uint8)
    numel = rows.shape[-1]
    words = packed_words(numel, bits)
    if words * per_word != numel:
        rows = torch.nn.functional.pad(rows, (0, words * per_word - numel))
    if bits == 8:
        packed = rows.contiguous()
    else:
        mask = (1 << bits) - 1
        split = rows.reshape(rows.shape[0], planes, -1)  # (rows, planes, bytes)
        packed = split[:, 0] & mask
        # A loop over the (at most 8) planes, each pass a whole contiguous tensor.
        for plane in range(1, planes):
            packed |= (split[:, plane] & mask) << (bits * plane)
    leading = codes.shape[:-1] if codes.dim() > 1 else ()
    return packed.view(torch.int32).reshape(*leading, words)


def unpack_bits(words: Tensor, numel: int, bits: int = 2) -> Tensor:
    """Inverse of :func:`pack_bits`: codes ``(..., numel)`` as ``uint8`` from ``(..., words)``."""
    per_word = codes_per_word(bits)
    if words.shape[-1] * per_word < numel:
        raise ValueError(
            f"{words.shape[-1]} words of {bits}-bit codes hold {words.shape[-1] * per_word} "
            f"codes, fewer than the {numel} asked for"
        )
    stream = words.contiguous().view(torch.uint8)  # (..., bytes)
    if bits == 8:
        return stream[..., :numel]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=words.device).unsqueeze(-1)
    planes = (stream.unsqueeze(-2) >> shifts) & ((1 << bits) - 1)  # (..., planes, bytes)
    return planes.flatten(-2)[..., :numel]


def unpack_signed_2bit(words: Tensor, numel: int, out: Tensor | None = None) -> Tensor:
    """Unpack 2-bit two's-complement codes straight to ``int8`` values in ``{-2, -1, 0, 1}``.

    One shift moves each 2-bit field to the top of its byte, one arithmetic shift brings it
    back sign-extended: half the passes of :func:`unpack_2bit` followed by a sign extension.

    Args:
        words: ``int32`` words of shape ``(..., words)``.
        numel: codes to return per row.
        out: optional ``int8`` buffer of shape ``(..., 16 * words)`` reused across steps.
    """
    if words.shape[-1] * 16 < numel:
        raise ValueError(
            f"{words.shape[-1]} words of 2-bit codes hold {words.shape[-1] * 16} codes, fewer "
            f"than the {numel} asked for"
        )
    stream = words.contiguous().view(torch.uint8)  # (..., bytes)
    # [6, 4, 2, 0] made on the words' device (a list would be copied from the host)
    to_top = torch.arange(6, -1, -2, dtype=torch.uint8, device=words.device).unsqueeze(-1)
    shape = (*stream.shape[:-1], 4, stream.shape[-1])
    target = None if out is None else out.view(torch.uint8).view(shape)
    planes = torch.bitwise_left_shift(stream.unsqueeze(-2), to_top, out=target).view(torch.int8)
    planes.bitwise_right_shift_(6)  # arithmetic on int8: sign extension  (..., 4, bytes)
    return planes.flatten(-2)[..., :numel]


def pack_2bit(codes: Tensor) -> Tensor:
    """Pack 2-bit codes, 16 per ``int32`` word (see :func:`pack_bits`)."""
    return pack_bits(codes, 2)


def unpack_2bit(words: Tensor, numel: int) -> Tensor:
    """Unpack ``numel`` 2-bit codes per row from ``int32`` words (see :func:`unpack_bits`)."""
    return unpack_bits(words, numel, 2)
