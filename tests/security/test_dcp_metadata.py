"""A capture directory's DCP ``state/.metadata`` comes with the capture: every field later code reads is checked
for the type DCP writes (one line, exit 2, never a traceback, which would read as exit 1); its pickle is scanned
before it is unpickled (nesting depth, and the memory unpickling it could take); the check that a tensor's chunks
tile it stays exact and fast with thousands of chunks of many dimensions."""

from __future__ import annotations

import dataclasses
import pickle
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from nanhunt.distributed._dcp import load_state
from nanhunt._util._errors import InputError
from nanhunt.cli import main
from tests._support.capture_dir import one_rank_capture, read_metadata, write_metadata
from tests._support.peak import run_nanhunt

GIB = 1 << 30


def _chunk(meta: Any) -> Any:
    return meta.state_dict_metadata["model.weight"].chunks[0]


def _weight(meta: Any) -> Any:
    return meta.state_dict_metadata["model.weight"]


def _set(obj: Any, **fields: Any) -> None:
    for k, v in fields.items():
        object.__setattr__(obj, k, v)  # MetadataIndex is a frozen dataclass


def _rekey(meta: Any, **fields: Any) -> None:
    """The storage key of the weight's chunk with ``fields`` set (the dict is built again: the hash changes)."""
    key = next(k for k in meta.storage_data if k.fqn == "model.weight")
    info = meta.storage_data.pop(key)
    _set(key, **fields)
    meta.storage_data[key] = info


def _del(obj: Any, name: str) -> None:
    del vars(obj)[name]


W = "'model.weight'"
DAMAGED: list[tuple[str, Callable[[Any], None], str]] = [
    ("chunk-int", lambda m: _set(_weight(m), chunks=[5]),
     f"a chunk of {W} is an int (5), expected a ChunkStorageMetadata"),
    ("no-properties", lambda m: _del(_weight(m), "properties"),
     f"field 'properties' of {W} is missing, expected a TensorProperties"),
    ("string-offset", lambda m: _set(_chunk(m), offsets="00"),
     f"field 'offsets' of a chunk of {W} is a str ('00'), expected a torch.Size of 2 integers >= 0"),
    ("float-sizes", lambda m: _set(_chunk(m), sizes=(2.0, 4.0)),
     f"field 'sizes' of a chunk of {W} is a tuple (2.0, 4.0), expected a torch.Size of 2 integers >= 0"),
    ("chunks-tuple", lambda m: _set(_weight(m), chunks=tuple(_weight(m).chunks)),
     f"field 'chunks' of {W} is a tuple, expected a list"),
    ("size-list", lambda m: _set(_weight(m), size=[2, 4]),
     f"field 'size' of {W} is a list [2, 4], expected a torch.Size of integers >= 0"),
    ("dtype-string", lambda m: _set(_weight(m).properties, dtype="float32"),
     f"field 'dtype' of {W} is a str ('float32'), expected a torch.dtype"),
    ("no-entries", lambda m: _del(m, "state_dict_metadata"),
     "field 'state_dict_metadata' of the metadata is missing, expected a dict"),
    ("entry-int", lambda m: m.state_dict_metadata.update({"model.weight": 5}),
     f"entry {W} is an int (5), expected a TensorStorageMetadata or BytesStorageMetadata"),
    ("key-offset-text", lambda m: _rekey(m, offset="ab"),
     f"field 'offset' of a storage key of {W} is a str ('ab'), expected None or a torch.Size of integers >= 0"),
    ("storage-meta-int", lambda m: _set(m, storage_meta=5),
     "field 'storage_meta' of the metadata is an int (5), expected None or a StorageMeta"),
    ("planner-list", lambda m: _set(m, planner_data=[]),
     "field 'planner_data' of the metadata is a list [], expected None or a dict"),
    ("planner-place", lambda m: m.planner_data.update({"model.weight": ["model", 1.5]}),
     f"the place of {W} in field 'planner_data' is a list ['model', 1.5], expected a tuple of names and indices"),
]


@pytest.mark.parametrize("damage, said", [d[1:] for d in DAMAGED], ids=[d[0] for d in DAMAGED])
def test_a_field_of_the_wrong_type_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                damage: Callable[[Any], None], said: str) -> None:
    # GIVEN a capture directory whose DCP metadata holds one field of a type DCP never writes
    cap = one_rank_capture(tmp_path / "cap")
    meta = read_metadata(cap)
    damage(meta)
    write_metadata(cap, meta)
    # WHEN it is replayed  THEN one line names the field, what it holds and what it should be: exit 2
    assert main(["replay", str(cap)]) == 2
    assert capsys.readouterr().err.strip() == (f"nanhunt: error: the capture's state '{cap / 'state'}': its "
                                               f".metadata is damaged: {said}")


@pytest.mark.subprocess
def test_ten_megabytes_of_empty_sets_are_refused_before_unpickling(tmp_path: Path) -> None:
    # GIVEN a 10 MB .metadata of ten million EMPTY_SET opcodes (unpickled: 2.75 GB of sets)
    cap = one_rank_capture(tmp_path / "cap")
    (cap / "state" / ".metadata").write_bytes(b"\x80\x04" + b"\x8f" * 10_000_000 + b".")
    # WHEN it is replayed in a child process
    code, err, peak = run_nanhunt(["replay", str(cap)], tmp_path)
    # THEN one line refuses it, and the child's peak memory stayed under 1 GiB
    assert (code, err.strip()) == (2, f"nanhunt: error: the capture's state '{cap / 'state'}': its .metadata would "
                                      "take more than 512 MiB of memory to unpickle, which no DCP checkpoint nanhunt "
                                      "reads needs; nanhunt refuses it")
    assert peak < GIB


def _nested_tuple(depth: int) -> bytes:
    """A pickle of a tuple nested ``depth`` deep, used as a dict key (hashing it recursed through the C stack)."""
    return b"\x80\x04}" + b"(" * depth + b")" + b"t" * depth + b"Ns."


def _sparse_memo() -> bytes:
    """A pickle that stores one value under memo key 2**26 (the unpickler sizes its memo table by the key: 1 GiB)."""
    return b"\x80\x04N" + b"r" + struct.pack("<I", 1 << 26) + b"."


@pytest.mark.subprocess
def test_a_key_nested_a_hundred_thousand_deep_is_one_line_not_a_crash(tmp_path: Path) -> None:
    # GIVEN a .metadata whose dict key is a tuple nested 100k deep (hashing it recursed through the C stack)
    cap = one_rank_capture(tmp_path / "cap")
    (cap / "state" / ".metadata").write_bytes(_nested_tuple(100_000))
    # WHEN it is replayed in a child process  THEN one line refuses it before it is unpickled
    code, err, _ = run_nanhunt(["replay", str(cap)], tmp_path)
    assert (code, err.strip()) == (2, f"nanhunt: error: the capture's state '{cap / 'state'}': its .metadata nests "
                                      "values more than 32 deep (DCP's own nest 11); nanhunt refuses it")


def test_a_tuple_of_itself_twice_nested_forty_deep_is_refused(tmp_path: Path) -> None:
    # GIVEN a .metadata that makes (t, t) of a tuple t forty times over (DUP, TUPLE2): 41 deep, 2**40 to hash
    state = one_rank_capture(tmp_path / "cap") / "state"
    (state / ".metadata").write_bytes(b"\x80\x04)" + b"2\x86" * 40 + b".")
    # WHEN its state is read  THEN one line refuses it before it is unpickled
    with pytest.raises(InputError) as info:
        load_state(str(state))
    assert str(info.value) == (f"the capture's state '{state}': its .metadata nests values more than 32 deep (DCP's "
                               "own nest 11); nanhunt refuses it")


@pytest.mark.parametrize("data, said", [
    (_sparse_memo(), "memo key 67108864 skips past the 0 values stored so far"),
    (b"\x80\x04]\x94(h\x00e.", "a list, dict or object changes after it was put in another"),
], ids=["sparse-memo", "cycle"])
def test_a_pickle_pickle_dump_does_not_write_is_refused_before_unpickling(tmp_path: Path, data: bytes,
                                                                          said: str) -> None:
    # GIVEN a .metadata storing a value at memo key 2**26 (a 1 GiB memo table), or a list holding itself
    state = one_rank_capture(tmp_path / "cap") / "state"
    (state / ".metadata").write_bytes(data)
    # WHEN its state is read  THEN one line refuses it before it is unpickled
    with pytest.raises(InputError) as info:
        load_state(str(state))
    assert str(info.value) == (f"the capture's state '{state}': its .metadata is not a pickle as pickle.dump writes "
                               f"it ({said}); nanhunt refuses it")


# ------------------------------------------------------------------- chunks
def _chunked(tmp_path: Path, boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], size: tuple[int, ...]) -> Path:
    """A DCP state of one float32 tensor ``size`` stored as the chunks ``boxes`` (offsets, sizes), each chunk's
    4 bytes per element stored in turn in one shard file."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    state = tmp_path / "state"
    state.mkdir()
    chunks, storage, at, sizes = [], {}, 0, {}
    for off, sz in boxes:
        chunk = ChunkStorageMetadata(offsets=torch.Size(off), sizes=sizes.setdefault(sz, torch.Size(sz)))
        chunks.append(chunk)
        key = MetadataIndex("w")
        object.__setattr__(key, "offset", chunk.offsets)  # one object, pickled once
        n = 4 * max(1, chunk.sizes.numel())
        storage[key] = _StorageInfo(relative_path="__0_0.distcp", offset=at, length=n)
        at += n
    (state / "__0_0.distcp").write_bytes(bytes(at))
    md = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size(size), chunks=chunks)
    meta = Metadata(state_dict_metadata={"w": md}, planner_data={"w": ("w",)}, storage_data=storage)
    (state / ".metadata").write_bytes(pickle.dumps(meta))
    return state


def test_four_thousand_chunks_of_two_hundred_dimensions_are_checked_at_once(tmp_path: Path) -> None:
    # GIVEN a tensor of 201 dimensions stored in 4096 chunks that tile it, split along its last dimension (the
    # check compared every pair on every dimension: minutes per tensor)
    n, ones = 4096, (1,) * 200
    state = _chunked(tmp_path, [((*(0,) * 200, i), (*ones, 1)) for i in range(n)], (*ones, n))
    # WHEN its entries are read (not its tensors)  THEN it loads: the chunks tile it
    assert load_state(str(state), tensors=False) == {}


def _grid(a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [((i, j), (1, 1)) for i in range(a) for j in range(b)]


@pytest.mark.parametrize("boxes, size", [
    # one chunk overlaps another it is not next to once sorted by row: (2, 0) lies in both; (2, 1) in none
    ([((0, 0), (4, 1)), ((1, 1), (1, 1)), ((2, 0), (1, 2)), ((0, 1), (1, 1))], (4, 2)),
    # the same rows and columns as a tiling, one chunk shifted onto its neighbour's row
    ([((0, 0), (2, 2)), ((1, 0), (2, 1)), ((3, 0), (1, 2))], (4, 2)),
    # a grid of 64 x 64 chunks of which one is two wide (over the one beside it) and one is left out
    ([((10, 10), (1, 2)) if o == (10, 10) else (o, s) for o, s in _grid(64, 64) if o != (20, 20)], (64, 64)),
], ids=["not-neighbours", "shifted", "grid"])
def test_chunks_that_overlap_are_refused_exactly(tmp_path: Path, boxes: list[Any], size: tuple[int, ...]) -> None:
    # GIVEN chunks whose volumes add up to the tensor's but two of which overlap (and some element is in none)
    state = _chunked(tmp_path, boxes, size)
    # WHEN its entries are read  THEN one line says the chunks do not tile it
    with pytest.raises(InputError) as info:
        load_state(str(state), tensors=False)
    assert str(info.value) == (f"the capture's state '{state}': the chunks of 'w' do not tile its shape {size}; the "
                               "capture is damaged")


@pytest.mark.parametrize("boxes, size", [
    (_grid(64, 64), (64, 64)),
    # rows of different splits (a brick wall), and a pinwheel: no straight cut separates its chunks
    ([((0, 0), (1, 3)), ((0, 3), (1, 5)), ((1, 0), (1, 6)), ((1, 6), (1, 2))], (2, 8)),
    ([((0, 0), (2, 1)), ((0, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 0), (1, 2)), ((1, 1), (1, 1))], (3, 3)),
], ids=["grid", "bricks", "pinwheel"])
def test_chunks_that_tile_load(tmp_path: Path, boxes: list[Any], size: tuple[int, ...]) -> None:
    state = _chunked(tmp_path, boxes, size)
    assert load_state(str(state), tensors=False) == {}


def test_a_dataclass_of_the_metadata_left_as_dcp_writes_it_loads(tmp_path: Path) -> None:
    # GIVEN the metadata DCP wrote, unpickled and written again unchanged  THEN its state loads whole
    cap = one_rank_capture(tmp_path / "cap")
    meta = read_metadata(cap)
    write_metadata(cap, dataclasses.replace(meta))
    state = load_state(str(cap / "state"))
    assert sorted(state["model"]) == ["bias", "weight"]


@pytest.mark.subprocess
def test_an_entry_whose_pickle_nests_a_million_deep_is_one_line_not_a_crash(tmp_path: Path) -> None:
    # GIVEN a capture directory whose weight's stored bytes are a 1.8 kB torch file nesting a key a million deep
    from tests.security.hostile import deep_pickle

    cap = one_rank_capture(tmp_path / "cap")
    meta = read_metadata(cap)
    key = next(k for k in meta.storage_data if k.fqn == "model.weight")
    info = meta.storage_data[key]
    shard = cap / "state" / info.relative_path
    data = deep_pickle(1_000_000)
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(data)
    _set(info, offset=offset, length=len(data))
    write_metadata(cap, meta)
    # WHEN it is replayed in a child process  THEN one line refuses the entry before torch unpickles it
    code, err, peak = run_nanhunt(["replay", str(cap)], tmp_path)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "'model.weight'" in err, err
    assert "deeper than" in err or "nests" in err, err
    assert peak < GIB
