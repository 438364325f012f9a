"""Packing of small integer codes into 32-bit words: round trip, layout, word counts."""

from __future__ import annotations

import pytest
import torch

from lightning_parallel.compression import (
    pack_2bit,
    pack_bits,
    unpack_2bit,
    unpack_bits,
    unpack_signed_2bit,
)
from lightning_parallel.compression.packing import codes_per_word, packed_words


@pytest.mark.parametrize("numel", [1, 15, 16, 17, 33, 1000, 12_345])
def test_2bit_round_trip_for_sizes_not_multiple_of_16(numel: int) -> None:
    codes = torch.randint(0, 4, (numel,))
    words = pack_2bit(codes)
    assert words.dtype == torch.int32
    assert words.numel() == (numel + 15) // 16
    assert torch.equal(unpack_2bit(words, numel).long(), codes)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("numel", [1, 7, 31, 257, 4099])
def test_round_trip_every_width(bits: int, numel: int) -> None:
    codes = torch.randint(0, 2**bits, (numel,))
    words = pack_bits(codes, bits)
    assert words.numel() == packed_words(numel, bits) == -(-numel // codes_per_word(bits))
    assert torch.equal(unpack_bits(words, numel, bits).long(), codes)


def test_2bit_planar_layout_16_codes_share_one_word() -> None:
    # 16 codes = 4 planes of 4 bytes: byte j holds codes j, j+4, j+8, j+12 at bits 0, 2, 4, 6.
    codes = torch.zeros(16, dtype=torch.int64)
    codes[0], codes[1], codes[15] = 1, 2, 3
    words = pack_2bit(codes)
    assert words.shape == (1,)
    word = int(words[0]) & 0xFFFFFFFF  # as unsigned (little-endian bytes)
    assert word == 1 | (2 << 8) | (3 << 30)


def test_rows_pack_independently() -> None:
    codes = torch.randint(0, 4, (3, 40))
    words = pack_2bit(codes)
    assert words.shape == (3, 3)
    for row in range(3):
        assert torch.equal(words[row], pack_2bit(codes[row]))


def test_unpack_with_a_leading_rank_dimension() -> None:
    codes = torch.randint(0, 4, (3, 48))
    words = torch.stack([pack_2bit(row) for row in codes])  # (3, 3)
    assert torch.equal(unpack_2bit(words, 48).long(), codes)
    assert torch.equal(unpack_2bit(words, 40).long(), codes[:, :40])


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="bits must be one of"):
        pack_bits(torch.zeros(4, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="fewer than"):
        unpack_2bit(torch.zeros(1, dtype=torch.int32), 17)


@pytest.mark.parametrize("numel", [1, 17, 1000])
def test_signed_unpack_is_unpack_plus_sign_extension(numel: int) -> None:
    codes = torch.randint(0, 4, (2, numel))
    words = pack_2bit(codes)
    expected = torch.where(codes >= 2, codes - 4, codes)  # two's complement of 2 bits
    assert torch.equal(unpack_signed_2bit(words, numel).long(), expected)
