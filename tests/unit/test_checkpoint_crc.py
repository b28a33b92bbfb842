"""crc32_combine (zlib's, which Python's zlib lacks): the sharded writer's file CRC-32 is
combined from its items' CRC-32s; the oracle is zlib.crc32 of the whole."""

import random
import zlib

from phalanx.checkpoint.dcp_layout import crc32_combine


def test_crc32_combine_equals_the_crc_of_the_concatenation():
    rng = random.Random(0)
    for length_a, length_b in ((0, 0), (0, 5), (7, 0), (1, 1), (1000, 3), (65537, 4096), (3, 1 << 20)):
        a, b = rng.randbytes(length_a), rng.randbytes(length_b)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b), (length_a, length_b)
    # many pieces, as the writer folds a file's items in order
    pieces = [rng.randbytes(rng.randrange(0, 5000)) for _ in range(50)]
    crc = 0
    for piece in pieces:
        crc = crc32_combine(crc, zlib.crc32(piece), len(piece))
    assert crc == zlib.crc32(b"".join(pieces))
