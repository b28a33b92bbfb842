"""The checkpoint file: atomic write, every byte checksummed, safe loading, housekeeping."""

import os
import pickle
import struct
import zlib

import pytest
import torch

import phalanx
from phalanx.checkpoint import file as cf


def _state():
    torch.manual_seed(0)
    return {"w": torch.randn(64, 32), "b": torch.arange(7), "meta": {"epoch": 3, "name": "x"}}


def _write(tmp_path, step=5, state=None):
    path = tmp_path / cf.checkpoint_name(step)
    cf.write_checkpoint(path, _state() if state is None else state)
    return path


def test_round_trip_layout_and_no_temporaries(tmp_path):
    path = _write(tmp_path)
    assert path.name == "ckpt-000000000005.ckpt"
    assert os.listdir(tmp_path) == [path.name]
    raw = path.read_bytes()
    magic, version, size, crc = struct.unpack_from("<8sIQI", raw)
    assert (magic, version, size) == (b"PHALANX\x00", 1, len(raw) - 64)
    assert crc == zlib.crc32(raw[64:])
    loaded = cf.read_checkpoint(path)
    expected = _state()
    assert torch.equal(loaded["w"], expected["w"]) and torch.equal(loaded["b"], expected["b"])
    assert loaded["meta"] == {"epoch": 3, "name": "x"}


def _expect_refused(path, *fragments):
    with pytest.raises(phalanx.CheckpointError) as info:
        cf.read_checkpoint(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message
    return message


@pytest.mark.parametrize("where", ["magic", "header", "header_padding", "payload_start",
                                   "payload_middle", "last_byte"])
def test_a_flipped_byte_anywhere_is_caught(tmp_path, where):
    path = _write(tmp_path)
    raw = bytearray(path.read_bytes())
    offset = {"magic": 2, "header": 13, "header_padding": 40, "payload_start": 64,
              "payload_middle": len(raw) // 2, "last_byte": len(raw) - 1}[where]
    raw[offset] ^= 0x10
    path.write_bytes(bytes(raw))
    expected = {"magic": "not a phalanx checkpoint", "header": "header fails its checksum",
                "header_padding": "header fails its checksum"}.get(where, "checksum mismatch")
    _expect_refused(path, expected)


def test_truncated_empty_missing_and_foreign_files(tmp_path):
    path = _write(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    _expect_refused(path, "truncated", f"{len(raw) // 2} bytes, its header announces {len(raw)}")
    path.write_bytes(raw[:30])
    _expect_refused(path, "truncated: 30 bytes, shorter than its 64-byte header")
    path.write_bytes(b"")
    _expect_refused(path, "is empty (0 bytes)")
    path.write_bytes(raw + b"\x00")
    _expect_refused(path, "too long")
    _expect_refused(tmp_path / "nope.ckpt", "does not exist")
    plain = tmp_path / "plain.pt"
    torch.save(_state(), plain)
    _expect_refused(plain, "not a phalanx checkpoint", "b'PK\\x03\\x04")


class _RunsCode:
    """Unpickling this calls os.system: the classic pickle payload."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _with_valid_header(payload: bytes) -> bytes:
    return cf._header(len(payload), zlib.crc32(payload)) + payload


def test_code_execution_payloads_are_refused_and_never_run(tmp_path):
    marker = tmp_path / "PWNED"
    # 1. torch's zip format, written by our own writer: checksum and header are valid
    zipped = tmp_path / "zip.ckpt"
    cf.write_checkpoint(zipped, {"model": {}, "evil": _RunsCode(marker)})
    message = _expect_refused(zipped, "was refused", "nothing in it was executed", "system")
    # 2. a bare pickle stream (torch's legacy format) behind a valid header
    bare = tmp_path / "bare.ckpt"
    bare.write_bytes(_with_valid_header(pickle.dumps(_RunsCode(marker), protocol=2)))
    _expect_refused(bare, "was refused")
    assert not marker.exists()
    # the same file does run code under plain unsafe pickle: the test payload is real
    pickle.loads(pickle.dumps(_RunsCode(marker)))
    assert marker.exists(), message


def test_framed_format_round_trip_one_frame_at_a_time(tmp_path):
    """Format 2: the state, then one tensor per frame, each handed to ``select`` as soon as it
    is decoded (here: its first row kept); the frame table at the end; one CRC over it all."""
    path = tmp_path / cf.checkpoint_name(1)
    tensors = [torch.randn(4, 3), torch.arange(10), torch.ones(2, 2, dtype=torch.bfloat16)]
    seen = []
    cf.write_checkpoint(path, {"meta": 1}, iter(tensors))
    raw = path.read_bytes()
    _, version, size, crc = struct.unpack_from("<8sIQI", raw)
    assert (version, size, crc) == (2, len(raw) - 64, zlib.crc32(raw[64:]))
    count = struct.unpack_from("<Q", raw, len(raw) - 8)[0]
    assert count == 4  # the state and three frames
    loaded = cf.read_checkpoint(path, select=lambda t: seen.append(t.shape) or t[:1].clone())
    assert loaded["meta"] == 1 and seen == [t.shape for t in tensors]
    assert all(torch.equal(a, b[:1]) for a, b in zip(loaded["frames"], tensors))
    assert all(torch.equal(a, b) for a, b in zip(cf.read_checkpoint(path)["frames"], tensors))


def test_framed_format_refuses_code_and_a_lying_frame_table(tmp_path):
    marker = tmp_path / "PWNED"
    evil = tmp_path / "evil.ckpt"
    cf.write_checkpoint(evil, {"meta": 1}, iter([torch.ones(2), _RunsCode(marker)]))
    _expect_refused(evil, "was refused", "nothing in it was executed")
    assert not marker.exists()
    # a frame table pointing past the payload, behind a valid header and checksum
    good = tmp_path / "good.ckpt"
    cf.write_checkpoint(good, {"meta": 1}, iter([torch.ones(2)]))
    payload = bytearray(good.read_bytes()[64:])
    struct.pack_into("<Q", payload, len(payload) - 16, len(payload) * 2)  # the last frame's end
    lying = tmp_path / "lying.ckpt"
    lying.write_bytes(cf._header(len(payload), zlib.crc32(payload), cf.FRAMED_FORMAT) + bytes(payload))
    _expect_refused(lying, "is corrupt", "frame table")


def test_keep_last_k_and_listing(tmp_path):
    for step in (3, 10, 7, 12):
        _write(tmp_path, step)
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    names = [p.name for p in cf.list_checkpoints(tmp_path)]
    assert names == [cf.checkpoint_name(s) for s in (3, 7, 10, 12)]
    deleted = cf.prune(tmp_path, keep=2)
    assert [p.name for p in deleted] == [cf.checkpoint_name(3), cf.checkpoint_name(7)]
    assert sorted(os.listdir(tmp_path)) == sorted(
        [cf.checkpoint_name(10), cf.checkpoint_name(12), "notes.txt"])
    assert cf.list_checkpoints(tmp_path / "missing") == []


def test_stale_temporaries_are_cleaned_but_a_live_writers_is_not(tmp_path):
    import fcntl

    stale = tmp_path / ".ckpt-000000000004.ckpt.tmp-999-dead"
    stale.write_bytes(b"half a checkpoint")
    live = tmp_path / ".ckpt-000000000005.ckpt.tmp-123-live"
    live.write_bytes(b"being written")
    with open(live, "rb") as writer:
        fcntl.flock(writer.fileno(), fcntl.LOCK_EX)  # what a living writer holds
        removed = cf.clean_stale_temps(tmp_path)
        assert removed == [stale]
        assert live.exists() and not stale.exists()
    assert cf.clean_stale_temps(tmp_path) == [live]
    assert os.listdir(tmp_path) == []


def test_a_failing_write_leaves_no_temporary_and_keeps_the_previous(tmp_path):
    path = _write(tmp_path, 5)
    before = path.read_bytes()

    class Unsaveable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    with pytest.raises(RuntimeError, match="cannot pickle this"):
        cf.write_checkpoint(path, {"x": Unsaveable()})
    assert os.listdir(tmp_path) == [path.name]
    assert path.read_bytes() == before


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs (needs root; skipped otherwise), unmounted afterwards."""
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    where = tmp_path / "small"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], capture_output=True)


def test_a_full_disk_is_named_and_the_previous_checkpoint_stays(small_disk):
    from phalanx import Checkpointer

    model = torch.nn.Linear(8, 8)
    ckpt = Checkpointer(small_disk, model)
    first = ckpt.save(0, 1)
    before = first.read_bytes()
    model.weight = torch.nn.Parameter(torch.zeros(256, 1024))  # 1 MiB: more than the disk
    with pytest.raises(phalanx.CheckpointError) as caught:
        ckpt.save(0, 2)
    message = str(caught.value)
    assert message.startswith(f"Cannot write checkpoint {small_disk}/ckpt-000000000002.ckpt: "
                              "no space left on device (errno 28) after "), message
    assert "bytes free of 262144 on that file system" in message
    assert "inline_container" not in message
    assert first.read_bytes() == before
    assert sorted(os.listdir(small_disk)) == [first.name]  # no temporary left behind
