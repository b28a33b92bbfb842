"""The sharded format's writer against torch's own: phalanx's ChecksummingWriter (items written
from templates of torch.save's archive, straight from the tensors' memory) must write the very
bytes torch's DCP FileSystemWriter writes (torch.save of each item), and record CRC-32s equal
to zlib's of those bytes; dcp_items' templates equal torch.save for every dtype and shape.
DCP's save plans made once and reused (dcp_plan): the same answers as planning anew."""

import io
import json
import os
import pickle
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import StorageMeta

from phalanx.checkpoint import dcp_items
from phalanx.checkpoint.dcp_engine import BalancedSavePlanner, ChecksummingWriter
from phalanx.checkpoint.dcp_layout import (BLOCK, MIN_BLOCKS, ItemCRC, Written, blocks_of, checksum, pack_crcs,
                                           read_manifest, unpack_crcs, write_manifest)
from phalanx.checkpoint.dcp_plan import Plans
from phalanx.errors import CheckpointError

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int32,
          torch.int64, torch.bool, torch.uint8, torch.complex64, torch.float8_e4m3fn)
SHAPES = ((), (1,), (7,), (3, 5), (64, 33), (2, 3, 4, 5), (300_000,))


def _random(dtype, shape, gen):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    return (torch.randn(shape, generator=gen) * 50).to(dtype)


def _torch_save(tensor):
    out = io.BytesIO()
    torch.save(tensor, out)
    return out.getvalue()


def _template_bytes(tensor):
    found = dcp_items.template(tensor)
    assert found is not None, (tensor.dtype, tuple(tensor.shape))
    data = bytes(dcp_items.storage_bytes(tensor))
    return found.head + data + found.tail_for(zlib.crc32(data))


def test_templates_write_torch_saves_bytes():
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        for shape in SHAPES:
            tensor = _random(dtype, shape, gen)
            assert _template_bytes(tensor) == _torch_save(tensor), (dtype, shape)
    # a view inside a larger storage (fully_shard's shards): torch.save of its copy
    whole = torch.randn(64, 48, generator=gen)
    for view in (whole[5:9], whole[63:], whole[10].view(6, 8)):
        assert _template_bytes(view) == _torch_save(view.clone())


def test_what_templates_leave_to_torch_save():
    base = torch.randn(6, 4)
    for tensor in (base.t(), base[:, 1], torch.zeros(0), torch.randn(3, requires_grad=True),
                   torch.nn.Parameter(torch.randn(3)), torch.randn(2, dtype=torch.complex64).conj(),
                   torch.randn(4, device="meta")):
        assert dcp_items.template(tensor) is None, tensor.shape


def _state(gen):
    whole = torch.randn(40, 30, generator=gen)
    return {
        "model": {"w": whole[10:20], "b": torch.randn(30, generator=gen).bfloat16(),  # a view: copied by DCP
                  "t": whole.t()[2:5],  # not contiguous: torch.save
                  "step": torch.tensor(3.0), "big": torch.randn(600_000, generator=gen),
                  "ids": torch.arange(1000), "mask": torch.rand(17, generator=gen) > 0.5,
                  "empty": torch.zeros(0, 4)},
        "optimizer": {"exp": {"w": torch.randn(3, 7, generator=gen).half()}},
        "count": 7,  # a non-tensor: DCP's byte item
    }


def test_the_file_is_torchs_own(tmp_path):
    state = _state(torch.Generator().manual_seed(1))
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "torch", thread_count=1), no_dist=True)
    ours = ChecksummingWriter(tmp_path / "ours")
    written = []
    write = ours.write
    ours.write = lambda *args: written.append(write(*args)) or written[-1]  # (dcp.save calls write_data)
    dcp.save(state, storage_writer=ours, no_dist=True)
    theirs, mine = (tmp_path / "torch" / "__0_0.distcp").read_bytes(), (tmp_path / "ours" / "__0_0.distcp").read_bytes()
    assert mine == theirs  # byte for byte
    # what the manifest records of the file, as checksum() computes it reading it back
    entry = json.loads(written[0].entry_json((",", ":")))
    blocks = entry.pop("blocks")
    assert entry == checksum(tmp_path / "ours" / "__0_0.distcp", [(o, n) for o, n, _ in entry["items"]])
    assert entry["bytes"] == len(mine) and entry["crc32"] == f"{zlib.crc32(mine):#010x}"
    covered = 0
    for offset, length, crc in entry["items"]:  # every byte in exactly one item
        assert offset == covered and crc == f"{zlib.crc32(mine[offset:offset + length]):#010x}"
        covered += length
    assert covered == len(mine)
    # block CRC-32s: for the one contiguous tensor of MIN_BLOCKS blocks or more ("big"), each
    # BLOCK bytes from its item's start, and where its storage starts (the tensor's bytes)
    assert blocks["bytes"] == BLOCK and len(blocks["items"]) == 1
    (offset, start, packed), = blocks["items"]
    length = next(n for o, n, _ in entry["items"] if o == offset)
    assert blocks_of(length) >= MIN_BLOCKS
    item = mine[offset:offset + length]
    assert list(unpack_crcs(packed)) == [zlib.crc32(item[k:k + BLOCK]) for k in range(0, length, BLOCK)]
    big = state["model"]["big"]
    assert item[start:start + big.nbytes] == big.numpy().tobytes()
    target = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()},
              "optimizer": {"exp": {"w": torch.empty(3, 7, dtype=torch.half)}}, "count": 0}
    dcp.load(target, checkpoint_id=tmp_path / "ours", no_dist=True)
    for key, value in state["model"].items():
        assert torch.equal(target["model"][key], value), key
    assert target["count"] == 7


def test_a_large_storage_goes_in_pieces(tmp_path, monkeypatch):
    """Storages above the gathering threshold are written in pieces, each CRC'd: the same bytes."""
    from phalanx.checkpoint import dcp_engine
    monkeypatch.setattr(dcp_engine, "_GATHER", 4096)
    monkeypatch.setattr(dcp_engine, "_PIECE", 1000)
    monkeypatch.setattr(dcp_engine, "_WRITEBACK", 5000)
    test_the_file_is_torchs_own(tmp_path)


def _planners(states):
    out = []
    for rank, state in enumerate(states):
        planner = BalancedSavePlanner()
        planner.set_up_planner(state, is_coordinator=rank == 0)
        out.append(planner)
    return out


def _round(plans, states):
    """One save's planning on two ranks, as ShardedIO runs it: what crossed, the final plans."""
    planners = _planners(states)
    offers = [p.offer(planner) for p, planner in zip(plans, planners)]
    answers = plans[0].decide(planners[0], offers)
    finals = [p.accept(a) for p, a in zip(plans, answers)]
    return offers, answers, finals, planners


def _fresh(states):
    """What DCP's own planning gives for ``states``: each rank's final plan."""
    planners = _planners(states)
    plans, _ = planners[0].create_global_plan([p.create_local_plan() for p in planners])
    return plans


def _items(plan):
    return [(item.index.fqn, item.type) for item in plan.items]


def test_plans_cross_once_and_follow_the_layout():
    gen = torch.Generator().manual_seed(2)
    shared = {"a": torch.randn(300, generator=gen), "b": torch.randn(20, generator=gen)}
    states = [{"m": {**shared, "own0": torch.randn(500, generator=gen)}},
              {"m": {**shared, "own1": torch.randn(100, generator=gen)}}]
    plans = [Plans(), Plans()]
    offers, answers, finals, _ = _round(plans, states)
    assert all(plan is not None for _, plan in offers) and all(plan is not None for _, plan in answers)
    assert [_items(p) for p in finals] == [_items(p) for p in _fresh(states)]
    # the same layout again (new values): only names cross
    states = [{"m": {k: v + 1 for k, v in s["m"].items()}} for s in states]
    offers, answers, again, _ = _round(plans, states)
    assert all(plan is None for _, plan in offers) and all(plan is None for _, plan in answers)
    assert again[0] is finals[0] and again[1] is finals[1]
    # rank 1's layout changes: its plan crosses, every rank whose final plan changed gets it
    states[1]["m"]["extra"] = torch.randn(2000, generator=gen)
    offers, answers, changed, _ = _round(plans, states)
    assert offers[0][1] is None and offers[1][1] is not None
    assert [_items(p) for p in changed] == [_items(p) for p in _fresh(states)]
    assert answers[1][1] is not None
    # rank 0 forgot (a failed save) but rank 1 did not: the save fails, then plans anew
    plans[0].forget()
    with pytest.raises(CheckpointError, match="unknown to rank 0"):
        _round(plans, states)
    plans[1].forget()
    _, _, anew, _ = _round(plans, states)
    assert [_items(p) for p in anew] == [_items(p) for p in _fresh(states)]


def _written_at(places):
    """A rank's report of its items written at ``places`` (``(offset, length)``, plan order)."""
    out = Written("f", 0, 0)
    for i, (offset, length) in enumerate(places):
        out.add(offset, length, 0, i)
    return out


def test_metadata_bytes_are_reused_only_where_they_are_the_same(tmp_path):
    gen = torch.Generator().manual_seed(3)
    states = [{"m": {"a": torch.randn(30, generator=gen), "own0": torch.randn(5, generator=gen)}},
              {"m": {"a": torch.randn(30, generator=gen), "own1": torch.randn(9, generator=gen)}}]
    plans = [Plans(), Plans()]
    _, _, finals, _ = _round(plans, states)
    placed = [[(1000 * i, 100 + i) for i in range(len(p.items))] for p in finals]

    def fresh(meta):  # planned and pickled without any cache
        other = [Plans(), Plans()]
        _round(other, states)
        return other[0].metadata_file([_written_at(p) for p in placed], meta)

    reused = []
    for name in ("ckpt-000000000001.dcp.tmp-1-aaaaaaaa", "ckpt-000000000002.dcp.tmp-1-bbbbbbbb",
                 "ckpt-000000000003.dcp.tmp-12-cc",  # another length: pickled anew
                 "ckpt-000000000004.dcp.tmp-1-dddddddd"):
        meta = StorageMeta(checkpoint_id=tmp_path / name, save_id=f"{name[-8:]:>36}")
        _round(plans, states)
        data = plans[0].metadata_file([_written_at(p) for p in placed], meta)
        reused.append(id(data))
        assert data == fresh(meta), name
        loaded = pickle.loads(data)
        assert os.fspath(loaded.storage_meta.checkpoint_id) == os.fspath(tmp_path / name)
    assert reused[0] == reused[1] != reused[2]  # the same bytes, changed in place; then anew
    moved = [list(p) for p in placed]
    moved[1][0] = (5, 100)  # an item elsewhere: pickled anew
    meta = StorageMeta(checkpoint_id=tmp_path / "x", save_id="y")
    data = plans[0].metadata_file([_written_at(p) for p in moved], meta)
    assert pickle.loads(data).storage_data[finals[1].items[0].index].offset == 5


def test_the_manifest_written_in_pieces_is_json_dumps_text(tmp_path):
    """write_manifest encodes each rank's Written as it goes: the file is the compact JSON of
    the whole manifest, and its CRC-32 that of json.dumps(body, sort_keys=True)."""
    files = {"__1_0.distcp": _written_at([(0, 700), (700, 1_000_000)]), "__0_0.distcp": Written("__0_0.distcp", 0, 0),
             ".metadata": {"bytes": 5, "crc32": "0x0000abcd"}}
    files["__1_0.distcp"].crcs[1] = 0xFFFFFFFF
    crcs = [0xFFFFFFFF, 0, 0x12345678] + list(range(blocks_of(300_000) - 3))
    files["__1_0.distcp"].add(1_000_700, 300_000, 7, 2, 321, crcs)  # block CRC-32s kept
    files["__1_0.distcp"].add(1_300_700, 3 * BLOCK, 8, 3, 321, [0, 1, 2])  # fewer than MIN_BLOCKS: not kept
    body = {"step": 3, "epoch": 1, "world_size": 2, "layout": 'a "files": 0', "files": files}
    write_manifest(tmp_path, body)
    plain = {**body, "files": {n: json.loads(w.entry_json((",", ":"))) if isinstance(w, Written) else w
                               for n, w in files.items()}}
    assert plain["files"]["__1_0.distcp"]["items"][1] == [700, 1_000_000, "0xffffffff"]
    assert plain["files"]["__1_0.distcp"]["blocks"] == {"bytes": BLOCK, "items": [[1_000_700, 321, pack_crcs(crcs)]]}
    assert list(unpack_crcs(pack_crcs(crcs))) == crcs
    assert plain["files"]["__0_0.distcp"] == {"bytes": 0, "crc32": "0x00000000", "items": []}
    found = read_manifest(tmp_path)  # (checks the CRC-32 against json.dumps's text)
    assert found == {"format": "phalanx-dcp", "version": 1, **plain}
    crc = f"{zlib.crc32(json.dumps(found, sort_keys=True).encode()):#010x}"
    assert (tmp_path / "phalanx-manifest.json").read_text() == json.dumps(
        {**found, "crc32": crc}, sort_keys=True, separators=(",", ":"))


def test_the_reader_takes_a_tensor_from_its_archive_only_when_it_is_the_template_s():
    """Template.storage_in: the storage's bytes of torch.save's archive of a contiguous tensor
    (what torch.load would give), None for any other archive of that dtype and shape."""
    import io as _io

    from phalanx.checkpoint.dcp_items import template_for

    gen = torch.Generator().manual_seed(0)
    for dtype, shape in ((torch.float32, (3, 5)), (torch.bfloat16, (70,)), (torch.int64, ()), (torch.bool, (4, 2))):
        tensor = torch.randint(0, 2, shape, generator=gen).to(dtype)
        archive = _io.BytesIO()
        torch.save(tensor, archive)
        found = template_for(dtype, shape)
        storage = found.storage_in(bytearray(archive.getvalue()))
        assert storage is not None, (dtype, shape)
        assert torch.equal(torch.frombuffer(bytearray(storage), dtype=dtype).view(shape), tensor)
        assert template_for(dtype, (99,)).storage_in(archive.getvalue()) is None  # another shape
    wide = torch.randn(5, 3, generator=gen)
    for other in (wide.t(), wide.t()[1:]):  # the same shape as a view: another pickle
        archive = _io.BytesIO()
        torch.save(other, archive)
        assert template_for(torch.float32, tuple(other.shape)).storage_in(archive.getvalue()) is None
    archive = _io.BytesIO()
    torch.save(torch.randn(3, 5, generator=gen), archive)
    data = bytearray(archive.getvalue())
    data[-30] ^= 1  # the central directory's fixed bytes
    assert template_for(torch.float32, (3, 5)).storage_in(data) is None
    assert template_for(torch.float32, ()) is not None and template_for(torch.float32, (0,)) is None


def test_a_sharded_load_decodes_phalanx_s_items_without_torch_load(tmp_path, monkeypatch):
    """Every tensor item of phalanx's checkpoint is read from its checked bytes; torch.load runs
    for none of them, and the model loads bit for bit."""
    from phalanx.checkpoint import Checkpointer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    Checkpointer(tmp_path, model, opt, format="sharded").save(0, 1)
    loads = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(1) or real(*a, **k))
    fresh = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    Checkpointer(tmp_path, fresh, fresh_opt, format="sharded").load()
    assert loads == [1]  # the state file's (its own format): no DCP item
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(opt.state.values(), fresh_opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_item_crcs_are_zlib_s_of_each_block_whatever_the_pieces():
    """ItemCRC: bytes given in pieces of any size (a template archive: head, storage in pieces
    between mark() and marked(), tail): each BLOCK's CRC-32 from the item's start, the item's,
    and the marked storage's, equal to zlib's of those bytes."""
    import random

    rng = random.Random(0)
    for length, head, tail in ((10, 3, 2), (BLOCK, 100, 0), (BLOCK + 1, 0, 1), (5 * BLOCK - 7, 777, 300),
                               (3 * BLOCK, BLOCK, BLOCK), (9 * BLOCK + 5000, 2 * BLOCK + 1, 10)):
        data = rng.randbytes(length)
        found = ItemCRC()
        found.update(data[:head])
        found.mark()
        at = head
        while at < length - tail:
            n = min(rng.choice((1, 1000, BLOCK - 1, BLOCK, 3 * BLOCK + 17)), length - tail - at)
            found.update(memoryview(data)[at:at + n])
            at += n
        assert found.marked() == zlib.crc32(data[head:length - tail]), length
        found.update(data[length - tail:])
        assert found.finish() == zlib.crc32(data), length
        assert list(found.blocks) == [zlib.crc32(data[k:k + BLOCK]) for k in range(0, length, BLOCK)], length
