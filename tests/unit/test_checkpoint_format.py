"""The checkpoint file format: safetensors that other tools read by name, every dtype
round-trips under its safetensors code (bfloat16 included), and checkpoints of earlier
writers (the hand-written safetensors writer, the .npz format) still load and resume."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_checkpoint_damage import (
    LEGACY,
    LEGACY_PER_RANK,
    damage,
    forge_safetensors,
    meta_json,
    same,
    sample_state,
    with_checksum,
)

from mpitrain import checkpoint
from mpitrain.dtypes import BFLOAT16

safetensors = pytest.importorskip("safetensors")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
# written by the safetensors writer of mpitrain before the library wrote the files
BEFORE_LIBRARY = Path(__file__).parent / "data" / "ckpt-version2.safetensors"
CODES = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "uint16": "U16", "int16": "I16",
         "float16": "F16", "uint32": "U32", "int32": "I32", "float32": "F32",
         "complex64": "C64", "uint64": "U64", "int64": "I64", "float64": "F64"}


def test_another_tool_reads_the_arrays_by_name(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    layer1 = {"weight": rng.standard_normal((4, 3)).astype(np.float32),
              "bias": rng.standard_normal(4).astype(np.float32)}
    state = {"model": {f"layer1.{k}": v for k, v in layer1.items()},
             "optimizer": {"state": {0: {"momentum": np.full(4, 0.5)}}, "lr": 0.1},
             "history": [np.arange(3, dtype=np.int64), (np.int32(7), "x")], "epoch": 2}
    path = checkpoint.save(str(tmp_path), state, step=42, per_rank={"seed": np.uint64(9)})
    assert path == str(tmp_path / "ckpt-000000042.safetensors")

    tensors = safetensors_numpy.load_file(path)
    want = {"model.layer1.weight": layer1["weight"], "model.layer1.bias": layer1["bias"],
            "optimizer.state.0.momentum": np.full(4, 0.5),
            "history.0": np.arange(3, dtype=np.int64), "history.1.0": np.array(7, np.int32),
            "per_rank.0.seed": np.array(9, np.uint64)}
    assert sorted(tensors) == sorted(want)
    for name, value in want.items():
        assert same(tensors[name], value), name

    from safetensors import safe_open

    with safe_open(path, framework="np") as f:
        meta = json.loads(f.metadata()["mpitrain"])
        assert np.array_equal(f.get_tensor("model.layer1.weight"), layer1["weight"])
    assert meta["format"] == "mpitrain-checkpoint" and meta["version"] == 2
    assert meta["step"] == 42 and meta["state"]["epoch"] == 2
    assert meta["state"]["model"]["layer1.weight"] == {"__array__": {"key": "model.layer1.weight"}}
    loaded = checkpoint.load(path, rank=0)
    assert same(loaded.state, state) and loaded.step == 42
    assert same(loaded.rank_state, {"seed": np.uint64(9)})


def test_every_dtype_round_trips(tmp_path: Path) -> None:
    arrays: dict[str, Any] = {
        dtype: np.arange(6).astype(dtype).reshape(2, 3)
        for dtype in ("bool", "uint8", "int8", "uint16", "int16", "float16", "uint32",
                      "int32", "float32", "complex64", "uint64", "int64", "float64")}
    stored_as_bytes = {  # dtypes safetensors lacks: stored as bytes, restored by mpitrain
        "complex128": np.arange(3) * (1 + 2j), "strings": np.array(["ab", "c"]),
        "bytes": np.array([b"xyz", b""]), "dates": np.array(["2024-01-02"], "datetime64[D]"),
        "longdouble": np.arange(2, dtype=np.longdouble)}
    arrays.update(stored_as_bytes)
    arrays["fortran"] = np.asfortranarray(np.arange(12.0).reshape(3, 4))
    arrays["strided"] = np.arange(20)[::3]
    arrays["zero_d"] = np.array(1.5)
    arrays["empty"] = np.zeros((0, 5), np.float32)
    if BFLOAT16 is not None:
        arrays["bf16"] = np.array([1.5, -2.0, 3.25], BFLOAT16)
    path = checkpoint.save(str(tmp_path), arrays, step=1)
    assert same(checkpoint.load(path).state, arrays)

    big_endian = np.arange(4, dtype=">i4")  # stored little-endian, as safetensors is
    loaded = checkpoint.load(checkpoint.save(str(tmp_path), {"x": big_endian}, step=2))
    assert loaded.state["x"].dtype == np.dtype("<i4")
    assert np.array_equal(loaded.state["x"], big_endian)

    tensors = safetensors_numpy.load_file(path)
    assert tensors["complex128"].dtype == np.uint8 and tensors["complex128"].size == 48
    assert same(tensors["float16"], arrays["float16"])
    if BFLOAT16 is not None:  # safetensors' own BF16
        assert same(tensors["bf16"], arrays["bf16"])

    structured = np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")])
    with pytest.raises(checkpoint.CheckpointError, match=r"state\.bad .*structured"):
        checkpoint.save(str(tmp_path), {"bad": structured}, step=3)


def test_names_that_collide_get_a_suffix(tmp_path: Path) -> None:
    state = {"a.b": np.ones(1), "a": {"b": np.zeros(1)}, "__metadata__": np.full(1, 2.0),
             "x": {3: np.full(1, 3.0), "3": np.full(1, 4.0)}}
    path = checkpoint.save(str(tmp_path), state, step=1)
    tensors = safetensors_numpy.load_file(path)
    assert sorted(tensors) == ["__metadata__#2", "a.b", "a.b#2", "x.3", "x.3#2"]
    assert same(checkpoint.load(path).state, state)
    assert same(checkpoint.load(checkpoint.save(str(tmp_path), np.ones(2), step=2)).state,
                np.ones(2))


def test_npz_checkpoints_of_the_earlier_format_still_load_and_resume(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    if BFLOAT16 is None:
        pytest.skip("the .npz fixture holds a bfloat16 array: needs ml_dtypes")
    old = tmp_path / "ckpt-000000007.npz"
    shutil.copy(LEGACY, old)
    loaded = checkpoint.load(str(old), rank=0)
    assert loaded.step == 7 and loaded.ranks == 1
    assert same(loaded.state, sample_state()) and same(loaded.rank_state, LEGACY_PER_RANK)
    assert checkpoint.load_latest(str(tmp_path)).path == str(old)  # type: ignore[union-attr]

    new = checkpoint.save(str(tmp_path), {"w": np.ones(2)}, step=8, keep=0)
    assert checkpoint.list_checkpoints(str(tmp_path)) == [(7, str(old)), (8, new)]
    assert checkpoint.latest(str(tmp_path)) == new
    damage(new)
    with caplog.at_level(logging.WARNING, logger="mpitrain"):
        resumed = checkpoint.load_latest(str(tmp_path), rank=0)
    assert resumed is not None and resumed.path == str(old)
    assert f"skipping {new}" in caplog.records[0].getMessage()
    checkpoint.save(str(tmp_path), {"w": np.ones(2)}, step=9, keep=1)  # old files pruned too
    assert [s for s, _ in checkpoint.list_checkpoints(str(tmp_path))] == [9]


def test_torch_models_are_read_by_their_state_dict_names(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    import mpitrain.torch as hvd

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)).to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    path = hvd.save_checkpoint(str(tmp_path), 1, model, optimizer)
    tensors = safetensors_torch.load_file(path)
    for name, value in model.state_dict().items():
        assert torch.equal(tensors[f"model.{name}"], value), name
        assert tensors[f"model.{name}"].dtype == torch.bfloat16
    assert "optimizer.state.0.momentum_buffer" in tensors
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)).to(torch.bfloat16)
    hvd.load_checkpoint(path, fresh, rank=0)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                 model.state_dict().values()))


def before_library_state() -> dict[str, Any]:
    """What BEFORE_LIBRARY holds (per rank: LEGACY_PER_RANK)."""
    return {**sample_state(), "complex128": np.arange(3) * (1 + 2j),
            "names": np.array(["ab", "c"])}


def test_checkpoints_of_the_earlier_safetensors_writer_still_load(tmp_path: Path) -> None:
    if BFLOAT16 is None:
        pytest.skip("the fixture holds a bfloat16 array: needs ml_dtypes")
    old = tmp_path / "ckpt-000000007.safetensors"
    shutil.copy(BEFORE_LIBRARY, old)
    assert old.read_bytes()[8:43] == b'{"__metadata__":{"mpitrain.crc32":"'  # its layout
    loaded = checkpoint.load(str(old), rank=0)
    assert loaded.step == 7 and loaded.ranks == 1
    assert same(loaded.state, before_library_state())
    assert same(loaded.rank_state, LEGACY_PER_RANK)
    resumed = checkpoint.load_latest(str(tmp_path), rank=0)
    assert resumed is not None and resumed.path == str(old)


def test_every_dtype_is_stored_under_its_safetensors_code(tmp_path: Path) -> None:
    arrays: dict[str, Any] = {name: (np.arange(-3, 3) % 2 == 0 if name == "bool" else
                                     np.arange(-3, 3).astype(name)).reshape(2, 3)
                              for name in CODES}
    want = dict(CODES)
    if BFLOAT16 is not None:
        arrays["bfloat16"] = np.array([[1.5, -2.0, 3.25], [0.0, 1e-40, 65504.0]], BFLOAT16)
        want["bfloat16"] = "BF16"
    path = checkpoint.save(str(tmp_path), arrays, step=1)
    stored = dict(safetensors.deserialize(Path(path).read_bytes()))
    for name, code in want.items():
        assert stored[name]["dtype"] == code, name
        assert stored[name]["shape"] == [2, 3], name
        assert bytes(stored[name]["data"]) == arrays[name].tobytes(), name
    loaded = checkpoint.load(path).state
    assert same(loaded, arrays)
    for name, value in loaded.items():  # the arrays are the process's own, to update
        assert value.flags.writeable and value.flags.c_contiguous, name
        value += value


def test_bfloat16_round_trips_bit_for_bit(tmp_path: Path) -> None:
    if BFLOAT16 is None:
        pytest.skip("needs ml_dtypes")
    bits = np.array([0x0000, 0x8000, 0x3FC0, 0xC000, 0x0001, 0x807F, 0x7F7F, 0x7F80,
                     0xFF80, 0x7FC0, 0x7FC1, 0xFFFF], np.uint16)  # zeros, subnormals, inf, NaNs
    values = bits.view(BFLOAT16).reshape(3, 4)
    path = checkpoint.save(str(tmp_path), {"x": values, "s": values[1, 2]}, step=1)
    loaded = checkpoint.load(path).state
    assert loaded["x"].dtype == BFLOAT16 and loaded["x"].shape == (3, 4)
    assert np.array_equal(loaded["x"].view(np.uint16).reshape(-1), bits)
    assert isinstance(loaded["s"], np.generic) and loaded["s"].dtype == BFLOAT16
    assert loaded["s"].view(np.uint16) == bits[6]
    info = dict(safetensors.deserialize(Path(path).read_bytes()))["x"]
    assert info["dtype"] == "BF16" and bytes(info["data"]) == bits.tobytes()


def test_the_checksum_is_found_wherever_the_metadata_puts_it(tmp_path: Path) -> None:
    """The library orders the metadata as it likes; a checkpoint loads either way."""
    path = tmp_path / "ckpt-000000001.safetensors"
    meta = meta_json({"__array__": {"key": "w"}}).decode()
    for order in ({"mpitrain.crc32": "00000000", "mpitrain": meta},
                  {"mpitrain": meta, "mpitrain.crc32": "00000000"}):
        path.write_bytes(forge_safetensors({"w": ("F64", [2], np.ones(2).tobytes())}, b"",
                                           __metadata__=order))
        assert np.array_equal(checkpoint.load(str(path)).state, np.ones(2))
    for _ in range(3):  # and every save, whatever order the library chose this time
        saved = checkpoint.save(str(tmp_path), {"w": np.ones(2)}, step=2)
        assert np.array_equal(checkpoint.load(saved).state["w"], np.ones(2))
    assert with_checksum(Path(saved).read_bytes()) == Path(saved).read_bytes()


def test_bfloat16_without_ml_dtypes_is_refused_but_not_as_damage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if BFLOAT16 is None:
        pytest.skip("needs ml_dtypes to write the file")
    path = checkpoint.save(str(tmp_path), {"x": np.ones(2, BFLOAT16)}, step=1)
    monkeypatch.delitem(checkpoint._DTYPES, "BF16")  # as without ml_dtypes
    with pytest.raises(checkpoint.CheckpointError, match="pip install ml_dtypes") as raised:
        checkpoint.load(path)
    assert not isinstance(raised.value, checkpoint.DamagedCheckpointError)
