"""Damaged and foreign checkpoint files: refused with CheckpointError naming the file,
in bounded memory; resuming skips them; temporary files of killed saves are removed.

A real checkpoint of each format (safetensors, and .npz of the earlier format: the file
tests/unit/data/ckpt-version1.npz, written by that format's writer) is damaged
systematically: a byte flipped (two ways) at positions in every part of the file
(safetensors: the header length, the checksum, the metadata JSON, the tensor table,
the array data; .npz: zip local headers, .npy headers, the JSON metadata, array data,
the zip central directory, the end record and its checksum), truncated at many
lengths, extended; then files that lie consistently (a valid checksum over sizes that
do not fit, JSON nested past any stack), and foreign files.
"""

from __future__ import annotations

import collections
import io
import json
import logging
import os
import random
import re
import struct
import subprocess
import sys
import time
import tracemalloc
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from mpitrain import checkpoint
from mpitrain.dtypes import BFLOAT16
from mpitrain.elastic import State
from mpitrain.errors import CheckpointError

END_RECORD = 22  # bytes of a zip end-of-central-directory record
CHECKSUM = len(b"mpitrain-crc32:") + 8  # the zip comment of an .npz checkpoint
PER_REGION = 60  # flipped positions per part of the file (more where a part is smaller)
CRC_FIELD = b'"mpitrain.crc32":"'  # in a safetensors checkpoint's header, then 8 hex digits
LIBRARY = "safetensors cannot read it"  # refused by the safetensors library's checks
LEGACY = Path(__file__).parent / "data" / "ckpt-version1.npz"
LEGACY_PER_RANK = {"r": np.arange(3, dtype=np.uint32),  # what it holds besides sample_state()
                   "gen": np.random.default_rng(0).bit_generator.state}


def sample_state() -> dict[str, Any]:
    """A state with every kind of value a checkpoint holds."""
    state: dict[str, Any] = {
        "w": np.arange(4000.0), "b": np.asfortranarray(np.arange(30, dtype=np.float32)
                                                      .reshape(6, 5)),
        "empty": np.zeros(0, np.int8), "scalar": np.float32(2.5), "big": 2 ** 100,
        "optimizer": {"lr": 0.1, 3: (1, "a", None), "momentum": [np.full(5, 0.5)]},
        "epoch": 3}
    if BFLOAT16 is not None:
        state["bf16"] = np.ones(3, dtype=BFLOAT16)
    return state


def same(got: Any, want: Any) -> bool:
    """Equal values, arrays compared by dtype, shape and contents."""
    if isinstance(want, (np.ndarray, np.generic)):
        return (isinstance(got, type(want)) and got.dtype == want.dtype
                and np.array_equal(got, want))
    if isinstance(want, dict):
        return (isinstance(got, dict) and got.keys() == want.keys()
                and all(same(got[k], v) for k, v in want.items()))
    if isinstance(want, (list, tuple)):
        return (type(got) is type(want) and len(got) == len(want)
                and all(same(g, w) for g, w in zip(got, want)))
    return bool(got == want)


@pytest.fixture(scope="module")
def intact(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The bytes of a checkpoint written by ``checkpoint.save``."""
    directory = tmp_path_factory.mktemp("intact")
    rng_state = checkpoint.capture_rng(np.random.default_rng(0))
    path = checkpoint.save(str(directory), sample_state(), step=7, per_rank=rng_state)
    assert path.endswith(".safetensors"), path
    return Path(path).read_bytes()


@pytest.fixture(scope="module")
def legacy() -> bytes:
    """The bytes of an .npz checkpoint, written by the earlier format's writer."""
    if BFLOAT16 is None:
        pytest.skip("the .npz fixture holds a bfloat16 array: needs ml_dtypes")
    return LEGACY.read_bytes()


def without_checksum(data: bytes) -> bytes:
    """``data`` as files were written before the checksum existed (np.savez: no zip
    comment); otherwise byte for byte the same."""
    if not data[-CHECKSUM:].startswith(b"mpitrain-crc32:"):
        return data
    legacy = bytearray(data[:-CHECKSUM])
    legacy[-2:] = b"\0\0"  # the end record's comment length
    return bytes(legacy)


def header_of(data: bytes) -> tuple[int, dict[str, Any]]:
    """The header length and header of safetensors file ``data``."""
    length = struct.unpack_from("<Q", data)[0]
    return length, json.loads(data[8:8 + length])


def checksum_at(data: bytes) -> int:
    """Where the checksum's 8 hex digits are in safetensors checkpoint ``data`` (the
    library orders the metadata as it likes: anywhere in the header)."""
    return data.index(CRC_FIELD) + len(CRC_FIELD)


def regions(data: bytes) -> dict[str, list[range]]:
    """The byte ranges of each part of safetensors checkpoint ``data``."""
    length, header = header_of(data)
    meta = json.dumps(header["__metadata__"]["mpitrain"]).encode()  # as it is escaped
    meta_at, at = data.index(meta, 8), checksum_at(data)
    table, start = [], 8  # the header around the checksum and the metadata JSON
    for begin, end in sorted([(at, at + 8), (meta_at, meta_at + len(meta))]):
        table.append(range(start, begin))
        start = end
    table.append(range(start, 8 + length))
    return {"header length": [range(0, 8)],
            "checksum": [range(at, at + 8)],
            "metadata JSON": [range(meta_at, meta_at + len(meta))],
            "tensor table": table,
            "array data": [range(8 + length, len(data))]}


def regions_npz(data: bytes) -> dict[str, list[range]]:
    """The byte ranges of each part of .npz checkpoint ``data``."""
    archive = zipfile.ZipFile(io.BytesIO(data))
    parts: dict[str, list[range]] = {"zip local headers": [], "npy headers": [],
                                     "metadata JSON": [], "array data": []}
    for info in archive.infolist():
        name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
        npy = info.header_offset + 30 + name_len + extra_len
        header_len = struct.unpack_from("<H", data, npy + 8)[0] + 10  # .npy version 1.0
        end = npy + info.file_size
        parts["zip local headers"].append(range(info.header_offset, npy))
        parts["npy headers"].append(range(npy, npy + header_len))
        kind = "metadata JSON" if info.filename == "__meta__.npy" else "array data"
        parts[kind].append(range(npy + header_len, end))
    record = data.rindex(b"PK\x05\x06")
    directory = struct.unpack_from("<L", data, record + 16)[0]
    parts["central directory"] = [range(directory, record)]
    parts["end record"] = [range(record, record + END_RECORD)]
    if len(data) > record + END_RECORD:
        parts["checksum"] = [range(record + END_RECORD, len(data))]
    return parts


def positions(parts: dict[str, list[range]]) -> dict[str, list[int]]:
    """Up to PER_REGION positions spread over each of ``parts``; every byte of the
    header length, end record and checksum."""
    chosen = {}
    for name, ranges in parts.items():
        every = [p for r in ranges for p in r]
        step = max(1, len(every) // PER_REGION)
        whole = name in ("header length", "end record", "checksum")
        chosen[name] = every if whole else every[::step]
    return chosen


def refusal(path: Path, data: bytes, load: Callable[[str], Any] = checkpoint.load) -> str:
    """Write ``data`` to ``path``, load it, and return the CheckpointError's message;
    fails unless it names the file and the load's peak memory stays below a few times
    the file's size."""
    path.write_bytes(data)
    tracemalloc.start()
    try:
        load(str(path))
    except CheckpointError as exc:
        message = str(exc)
    else:
        pytest.fail(f"{len(data)} damaged bytes loaded")
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert str(path) in message, message
    assert peak < 4 * len(data) + (128 << 10), f"peak {peak} bytes for {len(data)}: {message}"
    return message


def flips(data: bytes, parts: dict[str, list[range]]) -> Iterator[tuple[str, int, int, bytes]]:
    """``(part, position, mask, damaged bytes)``: each chosen byte of ``parts`` of
    ``data`` with its lowest bit flipped and with all its bits flipped."""
    for part, chosen in positions(parts).items():
        for position in chosen:
            for mask in (0x01, 0xFF):
                damaged = bytearray(data)
                damaged[position] ^= mask
                yield part, position, mask, bytes(damaged)


@pytest.mark.parametrize("kind", ["safetensors", "npz"])
def test_every_flipped_byte_is_refused(kind: str, request: pytest.FixtureRequest,
                                       tmp_path: Path) -> None:
    data = request.getfixturevalue("intact" if kind == "safetensors" else "legacy")
    parts = regions(data) if kind == "safetensors" else regions_npz(data)
    path = tmp_path / f"ckpt-000000007.{kind}"
    tried: dict[str, int] = {}
    for part, position, mask, damaged in flips(data, parts):
        try:
            refusal(path, damaged)
        except BaseException as exc:
            raise AssertionError(f"{part}, byte {position} ^ {mask:#x}: {exc!r}") from exc
        tried[part] = tried.get(part, 0) + 1
    assert all(tried.get(part, 0) >= 16 for part in parts), tried
    assert sum(tried.values()) >= 300, tried
    print(f"{kind}: {sum(tried.values())} flips refused: {tried}")


def test_flips_in_files_without_checksum_never_escape(legacy: bytes, tmp_path: Path) -> None:
    """.npz files written before the checksum existed still load; a flip in one is
    refused by the per-entry CRC-32 of the zip or the structure checks, or lands in a
    field no reader uses (a timestamp, the local header's copy of a size) and changes
    nothing."""
    legacy = without_checksum(legacy)
    assert same(checkpoint.load(_write(tmp_path, legacy)).state, sample_state())
    path = tmp_path / "ckpt-000000007.npz"
    refused, harmless = 0, collections.Counter()
    for part, position, mask, damaged in flips(legacy, regions_npz(legacy)):
        path.write_bytes(damaged)
        try:
            loaded = checkpoint.load(str(path))
        except CheckpointError:
            refusal(path, damaged)  # again, to check the message and the memory
            refused += 1
            continue
        except BaseException as exc:
            raise AssertionError(f"{part}, byte {position} ^ {mask:#x}: {exc!r}") from exc
        assert same(loaded.state, sample_state()), f"{part}, byte {position} ^ {mask:#x}"
        harmless[part] += 1
    assert set(harmless) <= {"zip local headers", "central directory"}, harmless
    print(f"without checksum: {refused + sum(harmless.values())} flips, {refused} refused, "
          f"harmless: {dict(harmless)}")


def _write(directory: Path, data: bytes) -> str:
    path = directory / "ckpt-000000001.npz"
    path.write_bytes(data)
    return str(path)


def test_truncated_and_extended_files_are_refused(intact: bytes, legacy: bytes,
                                                  tmp_path: Path) -> None:
    tried = 0
    length, at = struct.unpack_from("<Q", intact)[0], checksum_at(intact)
    cases = [(intact, "safetensors", {7, 8, at, at + 8, 8 + length - 1, 8 + length,
                                      8 + length + 1}),
             (legacy, "npz", {END_RECORD - 1, END_RECORD, END_RECORD + 1, len(legacy) - CHECKSUM,
                              len(legacy) - CHECKSUM - END_RECORD}),
             (without_checksum(legacy), "npz", {END_RECORD - 1, END_RECORD, END_RECORD + 1})]
    for data, kind, cuts in cases:
        path = tmp_path / f"ckpt-000000007.{kind}"
        cuts |= {0, 1, 2, 4, len(data) - 1, len(data) - 8, len(data) - END_RECORD}
        cuts.update(range(0, len(data), len(data) // 40))
        for cut in sorted(cuts):
            message = refusal(path, data[:cut])
            if cut == 0:
                assert "empty (0 bytes)" in message, message
            if 0 < cut < END_RECORD:
                assert "truncated" in message and "pickle" not in message, message
        for extra in (b"\0", b"x" * 100):
            refusal(path, data + extra)
        tried += len(cuts) + 2
    print(f"{tried} truncated or extended files refused")


def forge_safetensors(tensors: dict[str, tuple[str, list[int], bytes]], meta: bytes,
                      checksum: bool = True, **header: Any) -> bytes:
    """A checkpoint-shaped safetensors file: ``tensors`` (name: (dtype code, shape,
    bytes)) laid out one after the other, ``meta`` as mpitrain's metadata (after the
    checksum, as mpitrain wrote it before the library did), ``header`` replacing entries
    of the header as they are, and the checksum mpitrain writes (a CRC-32 of every byte
    but its 8 hex digits)."""
    table: dict[str, Any] = {"__metadata__": {"mpitrain.crc32": "00000000",
                                              "mpitrain": meta.decode()}}
    offset, data = 0, b""
    for name, (code, shape, raw) in tensors.items():
        table[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset, data = offset + len(raw), data + raw
    table.update(header)
    text = json.dumps(table, separators=(",", ":")).encode()
    file = struct.pack("<Q", len(text)) + text + data
    return with_checksum(file) if checksum else file


def with_checksum(data: bytes) -> bytes:
    """Safetensors checkpoint ``data`` with the checksum mpitrain writes (a CRC-32 of
    every byte but its 8 hex digits) replacing its own."""
    at = checksum_at(data)
    crc = zlib.crc32(data[at + 8:], zlib.crc32(data[:at]))
    return data[:at] + b"%08x" % crc + data[at + 8:]


def forge(entries: dict[str, bytes], checksum: bool = True) -> bytes:
    """An .npz checkpoint-shaped file holding the ``.npy`` bytes ``entries`` as they
    are, with the checksum mpitrain wrote (a CRC-32 of every byte but its 8 hex digits)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as archive:
        if checksum:
            archive.comment = b"mpitrain-crc32:00000000"
        for name, raw in entries.items():
            archive.writestr(f"{name}.npy", raw)
    data = bytearray(buf.getvalue())
    if checksum:
        data[-8:] = b"%08x" % zlib.crc32(data[:-8])
    return bytes(data)


def npy(header: str, payload: bytes = b"", version: int = 1) -> bytes:
    """A .npy entry with the header text ``header`` (not checked) and ``payload``."""
    text = header.encode("latin1")
    length = struct.pack("<H" if version == 1 else "<I", len(text))
    return b"\x93NUMPY" + bytes([version, 0]) + length + text + payload


def meta_json(state: Any, version: int = 2, **fields: Any) -> bytes:
    """The JSON metadata of a checkpoint (of format ``version``) whose state is ``state``."""
    return json.dumps({"format": "mpitrain-checkpoint", "version": version, "step": 1,
                       "state": state, "per_rank": None, **fields}).encode()


def meta(state: Any, version: int = 1, **fields: Any) -> bytes:
    """The ``__meta__`` entry of an .npz checkpoint whose state is ``state``."""
    text = meta_json(state, version, **fields)
    return npy(f"{{'descr': '|u1', 'fortran_order': False, 'shape': ({len(text)},), }}",
               text)


def test_safetensors_sizes_that_do_not_fit_the_file_are_refused_before_allocating(
        tmp_path: Path) -> None:
    """Consistent lies (the checksum matches): each is caught by the safetensors
    library's checks of the format (LIBRARY) or by mpitrain's of its metadata, within
    a few times the file's size of memory."""
    path = tmp_path / "ckpt-000000001.safetensors"
    ref = meta_json({"__array__": {"key": "w"}})
    eight = ("F64", [1], bytes(8))

    def refused(tensors: dict[str, Any], metadata: bytes = ref, **header: Any) -> str:
        return refusal(path, forge_safetensors(tensors, metadata, **header))

    assert LIBRARY in refused({"w": ("F64", [200000000000], bytes(8))})  # shape vs offsets
    huge = {"dtype": "F64", "shape": [200000000000], "data_offsets": [0, 1600000000000]}
    assert LIBRARY in refused({}, w=huge)  # offsets past the end of the file
    assert LIBRARY in refused(  # overlapping tensors
        {"w": eight}, x={"dtype": "U8", "shape": [8], "data_offsets": [0, 8]})
    assert LIBRARY in refused(  # a gap between tensors
        {"w": eight}, x={"dtype": "U8", "shape": [8], "data_offsets": [16, 24]})
    for bad in ({"dtype": "F64", "shape": [-1], "data_offsets": [0, 8]},
                {"dtype": "F64", "shape": [1.0], "data_offsets": [0, 8]},
                {"dtype": "F64", "shape": [1], "data_offsets": [8, 0]},
                {"dtype": "F65", "shape": [1], "data_offsets": [0, 8]},
                {"dtype": "F64", "shape": [[[[[[1]]]]]], "data_offsets": [0, 8]},
                [1, 2], "w"):
        assert LIBRARY in refused({}, w=bad), bad
    # a dtype of the format that mpitrain never writes
    assert "tensor 'w' has the dtype 'F8_E4M3'" in refused({"w": ("F8_E4M3", [8], bytes(8))})
    deep = b"[" * 10000 + b"]" * 10000
    message = refused({"w": eight}, deep)
    assert f"metadata nests more than {checkpoint.MAX_DEPTH} levels" in message
    assert "names array 'w', which the file lacks" in refused({"x": eight})
    assert "'mpitrain' metadata" in refused({"w": eight},
                                            __metadata__={"mpitrain.crc32": "00000000"})
    assert LIBRARY in refused({"w": eight}, __metadata__={"mpitrain.crc32": "00000000",
                                                          "mpitrain": {"format": 1}})
    assert "not valid JSON" in refused({"w": eight}, b"{")
    assert "not an mpitrain checkpoint's" in refused({"w": eight}, b'{"format": 1}')
    for descr, shape in (("|O", [1]), ("|S0", [10 ** 10]), ("<f8", [2]), ("f8,f8", [1]),
                         ("(2,)f4", [1]), ("not a dtype", [8]), (7, [8]), ("|u1", 8)):
        raw_ref = meta_json({"__array__": {"key": "w", "dtype": descr, "shape": shape}})
        assert "inconsistent" in refused({"w": ("U8", [8], bytes(8))}, raw_ref), descr

    # a header length (a u64) far past the end of the file: refused before it is read
    forged = bytearray(forge_safetensors({"w": eight}, ref))
    forged[:8] = struct.pack("<Q", (1 << 64) - 1)
    assert LIBRARY in refusal(path, bytes(forged))


def test_the_library_checks_the_structure_and_mpitrain_the_checksum(
        intact: bytes, tmp_path: Path) -> None:
    """What safetensors itself refuses, whatever the checksum says: a truncated header,
    a header length past the end, an offset past the end, trailing bytes; and what only
    the checksum catches: a change that leaves the structure valid."""
    path = tmp_path / "ckpt-000000001.safetensors"
    length = struct.unpack_from("<Q", intact)[0]
    for cut in (3, 8 + length // 2, 8 + length - 1):  # inside the length, inside the header
        assert LIBRARY in refusal(path, intact[:cut]), cut
    longer = bytearray(intact)
    longer[:8] = struct.pack("<Q", len(intact))  # one byte more than the file holds
    assert LIBRARY in refusal(path, bytes(longer))
    ref = meta_json({"__array__": {"key": "w"}})
    past_end = {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]}
    assert LIBRARY in refusal(path, forge_safetensors({}, ref, w=past_end, x=past_end))
    for extra in (b"\0", b"x" * 100):  # trailing bytes, with a matching checksum
        assert LIBRARY in refusal(path, with_checksum(intact + extra))
    renamed = intact.replace(b'"w":{', b'"v":{', 1)  # still a valid safetensors file
    assert len(renamed) == len(intact) and renamed != intact
    message = refusal(path, renamed)
    assert "do not match their CRC-32" in message and LIBRARY not in message, message
    data = bytearray(intact)
    data[-1] ^= 0x01  # the last byte of the array data
    assert "do not match their CRC-32" in refusal(path, bytes(data))


def test_npz_sizes_that_do_not_fit_the_file_are_refused_before_allocating(
        tmp_path: Path) -> None:
    """Consistent lies (the checksum matches): each is caught by a size check, within a
    few times the file's size of memory (1.46 TiB was asked for before)."""
    ref = {"__array__": {"key": "a0"}}
    path = tmp_path / "ckpt-000000001.npz"
    huge_shape = npy("{'descr': '<f8', 'fortran_order': False, 'shape': (200000000000,), }",
                     b"\0" * 8)
    for checksum in (True, False):
        message = refusal(path, forge({"a0": huge_shape, "__meta__": meta(ref)}, checksum))
        assert "declares shape (200000000000,)" in message, message
        long_header = b"\x93NUMPY\x02\x00" + struct.pack("<I", 0xFFFFFFF0) + b"{}"
        message = refusal(path, forge({"a0": long_header, "__meta__": meta(ref)}, checksum))
        assert "4294967280-byte .npy header" in message, message
        for descr in ("|S0", "<U0"):  # np.empty(n, "S0") allocates n bytes
            header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': (10000000000,), }}"
            refusal(path, forge({"a0": npy(header), "__meta__": meta(ref)}, checksum))
        for header in ("-" * 9000 + "1", "(" * 40 + ")" * 40, "1+" * 4000 + "1"):
            refusal(path, forge({"a0": npy(header), "__meta__": meta(ref)}, checksum))
        message = refusal(path, forge({"__meta__": meta(ref)}, checksum))
        assert "names array 'a0', which the file lacks" in message, message
        deep = npy("{'descr': '|u1', 'fortran_order': False, 'shape': (20000,), }",
                   b"[" * 10000 + b"]" * 10000)
        message = refusal(path, forge({"__meta__": deep}, checksum))
        assert f"nests more than {checkpoint.MAX_DEPTH} levels" in message, message

    # the zip directory claims an entry larger than the file (checksum recomputed)
    data = bytearray(forge({"__meta__": meta(1)}, checksum=False))
    directory = data.rindex(b"PK\x01\x02")
    data[directory + 20:directory + 28] = struct.pack("<LL", 1 << 31, 1 << 31)
    refusal(path, bytes(data))


def test_foreign_files_are_refused(tmp_path: Path) -> None:
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "ckpt-000000001.safetensors"
    other = safetensors_numpy.save({"x": np.ones(3)}, metadata={"format": "pt"})
    assert "another tool's safetensors file" in refusal(path, other)
    for data in (b"not a checkpoint\n" * 10, b"\x89PNG\r\n\x1a\n" + bytes(1000),
                 random.Random(0).randbytes(1024), LEGACY.read_bytes()):
        refusal(path, data)

    path = tmp_path / "ckpt-000000001.npz"
    buf = io.BytesIO()
    np.savez_compressed(buf, __meta__=np.frombuffer(meta_json(1, version=1), np.uint8))
    assert "compressed" in refusal(path, buf.getvalue())
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr("readme.txt", "hello")
    assert "'readme.txt'" in refusal(path, buf.getvalue())
    buf = io.BytesIO()
    np.savez(buf, x=np.ones(3))
    assert "no __meta__ entry" in refusal(path, buf.getvalue())
    buf = io.BytesIO()
    np.savez(buf, a0=np.array([print], dtype=object),
             __meta__=np.frombuffer(meta_json({"__array__": {"key": "a0"}}, version=1),
                                    np.uint8))
    assert "without pickle" in refusal(path, buf.getvalue())
    other = forge({"__meta__": npy("{'descr': '|u1', 'fortran_order': False, "
                                   "'shape': (13,), }", b'{"format": 1}')})
    assert "format 1" in refusal(path, other)
    for data in (b"not a checkpoint\n" * 10, b"\x89PNG\r\n\x1a\n" + bytes(1000),
                 random.Random(0).randbytes(1024), b"PK\x05\x06" + bytes(18),
                 npy("{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }", bytes(16))):
        refusal(path, data)


def test_deep_states_and_other_versions_are_refused_but_not_as_damage(tmp_path: Path) -> None:
    max_depth = 100  # checkpoint.MAX_DEPTH
    deepest: Any = 1  # the metadata and the state's dict take the first two levels
    for _ in range(max_depth - 2):
        deepest = [deepest]
    with pytest.raises(CheckpointError, match=f"more than {max_depth} levels"):
        checkpoint.save(str(tmp_path / "deep"), {"x": [deepest]}, step=1)
    path = checkpoint.save(str(tmp_path / "deep"), {"x": deepest}, step=1)
    assert checkpoint.load(path).state == {"x": deepest}
    assert max_depth == checkpoint.MAX_DEPTH

    for name, data in (("ckpt-000000002.npz", forge({"__meta__": meta(1, version=2)})),
                       ("ckpt-000000003.safetensors",
                        forge_safetensors({}, meta_json(1, version=3)))):
        future = tmp_path / name
        future.write_bytes(data)
        with pytest.raises(CheckpointError, match=r"version [23]") as raised:
            checkpoint.load(str(future))
        assert not isinstance(raised.value, checkpoint.DamagedCheckpointError)
        with pytest.raises(CheckpointError, match=r"version [23]"):  # not skipped when resuming
            checkpoint.load_latest(str(tmp_path))
        future.unlink()


def damage(path: str) -> None:
    """Flip one byte in the middle of ``path``."""
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(path).write_bytes(bytes(data))


def test_resume_skips_a_damaged_newest_checkpoint(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    directory = str(tmp_path)
    for step in (1, 2, 3):
        checkpoint.save(directory, {"w": np.full(100, float(step)), "step": step}, step=step,
                        per_rank={"r": 0}, keep=2)
    newest = checkpoint.path_for(directory, 3)
    damage(newest)
    with pytest.raises(CheckpointError, match=re.escape(newest)):  # no fallback here
        checkpoint.load(newest)
    with caplog.at_level(logging.WARNING, logger="mpitrain"):
        ckpt = checkpoint.load_latest(directory, rank=0)
    assert ckpt is not None and ckpt.step == 2 and ckpt.state["step"] == 2
    assert ckpt.rank_state == {"r": 0} and np.array_equal(ckpt.state["w"], np.full(100, 2.0))
    (record,) = [r for r in caplog.records if r.name == "mpitrain"]
    assert record.levelno == logging.WARNING
    assert f"skipping {newest}" in record.getMessage()
    assert "CRC-32" in record.getMessage(), record.getMessage()
    assert f"trying {checkpoint.path_for(directory, 2)}" in record.getMessage()
    with pytest.raises(CheckpointError, match="per-rank state of 1 ranks"):
        checkpoint.load_latest(directory, rank=1)  # an intact one that does not fit: raised

    caplog.clear()
    damage(checkpoint.path_for(directory, 2))
    with caplog.at_level(logging.WARNING, logger="mpitrain"):
        assert checkpoint.load_latest(directory) is None
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3 and "no older one" in messages[1], messages
    assert "no intact checkpoint" in messages[2] and "as if there were none" in messages[2]

    empty = tmp_path / "empty"
    empty.mkdir()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mpitrain"):
        assert checkpoint.load_latest(str(empty)) is None
        assert checkpoint.load_latest(str(tmp_path / "missing")) is None
    assert caplog.records == []


def test_elastic_state_resumes_from_the_newest_intact_checkpoint(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    w = np.zeros(4)
    state = State(checkpoint=str(tmp_path), w=w, step=0)
    for step in (1, 2, 3):
        w += 1
        state.step = step
        state.commit()
    newest = checkpoint.path_for(str(tmp_path), 3)
    damage(newest)
    fresh = State(checkpoint=str(tmp_path), w=np.zeros(4), step=0)
    with caplog.at_level(logging.WARNING, logger="mpitrain"):
        assert fresh.load_checkpoint()
    assert fresh.commits == 2 and fresh.step == 2 and np.array_equal(fresh.w, np.full(4, 2.0))
    assert any(f"skipping {newest}" in r.getMessage() for r in caplog.records)
    damage(checkpoint.path_for(str(tmp_path), 2))
    with caplog.at_level(logging.WARNING, logger="mpitrain"):
        assert not State(checkpoint=str(tmp_path), w=np.zeros(4)).load_checkpoint()
    assert "no intact checkpoint" in caplog.records[-1].getMessage()


def test_torch_resume_skips_a_damaged_newest_checkpoint(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import mpitrain.torch as hvd

    model = torch.nn.Linear(3, 2)
    for step in (1, 2):
        with torch.no_grad():
            model.weight.fill_(step)
        hvd.save_checkpoint(str(tmp_path), step, model, extra={"step": step})
    damage(checkpoint.path_for(str(tmp_path), 2))
    fresh = torch.nn.Linear(3, 2)
    ckpt = hvd.load_latest_checkpoint(str(tmp_path), fresh, rank=0)
    assert ckpt is not None and ckpt.state["extra"] == {"step": 1}
    assert torch.equal(fresh.weight, torch.ones(2, 3))
    assert hvd.load_latest_checkpoint(str(tmp_path / "none"), fresh) is None


def temp_name(pid: int, host: str, mark: str, suffix: str = ".safetensors") -> str:
    """The name of a temporary file of a save by process ``pid`` of ``host``."""
    return f".tmp-ckpt-{pid}@{host}.{mark}{suffix}"


def test_temporary_files_of_killed_saves_are_removed_at_startup(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    renamed = []
    replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: renamed.append(src) or replace(src, dst))
    checkpoint.save(str(tmp_path), {"x": 1}, step=1)
    monkeypatch.undo()
    name = re.fullmatch(rf"\.tmp-ckpt-{os.getpid()}@(.+)\.[a-z0-9_]+\.safetensors",
                        os.path.basename(renamed[0]))
    assert name, renamed  # a save names its temporary file after its process
    host = name.group(1)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    old = time.time() - 3600  # before this process started
    files = {  # name: (seconds since the epoch it was last written, removed?)
        temp_name(int(dead.stdout), host, "dead1x"): (time.time(), True),
        temp_name(int(dead.stdout), host, "dead2x", ".npz"): (time.time(), True),  # as before
        temp_name(live.pid, host, "live1x"): (old, False),  # a live writer, however slow
        temp_name(os.getpid(), host, "mine1x"): (old, False),
        temp_name(123, "elsewhere", "old1xy"): (old, True),
        temp_name(123, "elsewhere", "new1xy"): (time.time(), False),
        ".tmp-ckpt-ab12cd34.npz": (old, True),  # named as before, by pid-less writers
        ".tmp-ckpt-ef56gh78.npz": (time.time(), False),
        "notes.txt": (old, False),
    }
    try:
        for name, (mtime, _) in files.items():
            (tmp_path / name).write_bytes(b"torn")
            os.utime(tmp_path / name, (mtime, mtime))
        checkpoint.save(str(tmp_path), {"x": 1}, step=1)
        (tmp_path / "ckpt-000000001.safetensors").unlink()
        kept = sorted(name for name, (_, removed) in files.items() if not removed)
        assert sorted(os.listdir(tmp_path)) == kept
        live.kill()
        live.wait()
        assert checkpoint.load_latest(str(tmp_path)) is None
        kept.remove(temp_name(live.pid, host, "live1x"))
        assert sorted(os.listdir(tmp_path)) == kept
    finally:
        live.kill()
        live.wait()
