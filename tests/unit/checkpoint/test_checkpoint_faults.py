"""Damaged, foreign and missing checkpoints: every fault is a CheckpointError that names
the file (or the folder looked in), and no file can run code on load unless the user
opts in with ``checkpoint.allow_unsafe_load``."""
from __future__ import annotations

import dataclasses
import io
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks


class MarkerOnLoad:
    """A pickle whose loading runs code: it creates the file ``path``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@dataclasses.dataclass
class LegacyState:
    """A per-rank state object of an older format: harmless, but not plain data."""
    step: int = 7


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _replace_object_entry(d: Path, payload: bytes) -> None:
    """Swap the first pickled-object entry (a ShardedObject) of a shard file for
    ``payload`` and rewrite the index so the checkpoint stays self-consistent."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    index = pickle.loads((d / ".metadata").read_bytes())
    key = next(k for k in index.storage_data
               if isinstance(index.state_dict_metadata[k.fqn], BytesStorageMetadata))
    info = index.storage_data[key]
    f = d / info.relative_path
    data = f.read_bytes()
    f.write_bytes(data[:info.offset] + payload + data[info.offset + info.length:])
    delta = len(payload) - info.length
    for k, i in list(index.storage_data.items()):
        if i.relative_path == info.relative_path and i.offset > info.offset:
            index.storage_data[k] = dataclasses.replace(i, offset=i.offset + delta)
    index.storage_data[key] = dataclasses.replace(info, length=len(payload))
    (d / ".metadata").write_bytes(pickle.dumps(index))


def _compressed_object_entry(d: Path, pickled: bytes) -> None:
    """The crafted checkpoint of issue 38 finding 9: an object entry marked as stored
    zstd-compressed (torch decompresses it, then unpickles it with ``weights_only=False``).
    With ``zstandard`` installed the payload is compressed for real; without it, the raw
    pickle carries the mark all the same (torch would fail to decompress it)."""
    try:
        import zstandard
        payload = zstandard.ZstdCompressor().compress(pickled)
    except ImportError:
        payload = pickled
    _replace_object_entry(d, payload)
    index = pickle.loads((d / ".metadata").read_bytes())
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    key = next(k for k in index.storage_data
               if isinstance(index.state_dict_metadata[k.fqn], BytesStorageMetadata))
    index.storage_data[key] = dataclasses.replace(index.storage_data[key], transform_descriptors=["stream.zstd/1"])
    (d / ".metadata").write_bytes(pickle.dumps(index))


def _shard_outside(d: Path) -> None:
    """The index names a shard file outside the checkpoint directory."""
    index = pickle.loads((d / ".metadata").read_bytes())
    key = next(iter(index.storage_data))
    index.storage_data[key] = dataclasses.replace(index.storage_data[key], relative_path="../outside.distcp")
    (d / ".metadata").write_bytes(pickle.dumps(index))


def _corrupt_tensor_entry(d: Path) -> None:
    """Overwrite the start of one tensor entry (its zip header) in place: same length."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    index = pickle.loads((d / ".metadata").read_bytes())
    info = next(i for k, i in index.storage_data.items()
                if isinstance(index.state_dict_metadata[k.fqn], TensorStorageMetadata))
    f = d / info.relative_path
    b = bytearray(f.read_bytes())
    b[info.offset:info.offset + 64] = b"\xff" * 64
    f.write_bytes(bytes(b))


def _faults(rank, world, root, marker):
    from grpo_mega.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from grpo_mega.config import ModelConfig, OptimizerConfig
    from grpo_mega.distributed.state import init_parallel
    from grpo_mega.models import build_model
    from grpo_mega.optim.adamw import ParallelAdamW

    m = ModelConfig(family="qwen2", vocab_size=50, hidden_size=32, num_layers=2, num_attention_heads=4,
                    num_query_groups=2, ffn_hidden_size=64, make_vocab_size_divisible_by=4)
    ps = init_parallel(1, 1, seed=3)
    model = build_model(m, ps)
    opt = ParallelAdamW(model, OptimizerConfig(lr=1e-2), ps)
    good = save_checkpoint(f"{root}/good", 1, model, opt, ps, {"data": [1]})
    evil = _torch_bytes(MarkerOnLoad(marker))
    variants = {
        "intact": lambda d: None,
        "no shard files": lambda d: [f.unlink() for f in d.glob("*.distcp")],
        "truncated shard": lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[:500]),
        "corrupt tensor entry": _corrupt_tensor_entry,
        "corrupt object entry": lambda d: _replace_object_entry(d, b"\x00" * 40),
        "corrupt index": lambda d: (d / ".metadata").write_bytes(b"not a pickle"),
        "corrupt meta json": lambda d: (d / "grpo_meta.json").write_bytes(b"\xff{"),
        "no rank file": lambda d: (d / "rank_00000.pt").unlink(),
        "corrupt rank file": lambda d: (d / "rank_00000.pt").write_bytes(b"PK\x03\x04 truncated"),
        "code in rank file": lambda d: (d / "rank_00000.pt").write_bytes(evil),
        "code in common.pt": lambda d: (d / "common.pt").write_bytes(evil),
        "code in index": lambda d: (d / ".metadata").write_bytes(pickle.dumps(MarkerOnLoad(marker))),
        "code in object entry": lambda d: _replace_object_entry(d, evil),
        "code in compressed object entry": lambda d: _compressed_object_entry(d, evil),
        "shard outside the directory": _shard_outside,
        "legacy rank file": lambda d: torch.save(
            dict(torch.load(d / "rank_00000.pt"), legacy=LegacyState()), d / "rank_00000.pt"),
    }
    out = {}
    for name, damage in variants.items():
        d = Path(root) / name.replace(" ", "_")
        shutil.copytree(good, d)
        damage(d)
        Path(marker).unlink(missing_ok=True)  # each variant reports only its own code run
        try:
            load_checkpoint(d, model, opt, ps, m)
            out[name] = ("loaded", "", Path(marker).exists())
        except CheckpointError as e:
            out[name] = ("CheckpointError", str(e), Path(marker).exists())
        except BaseException as e:  # noqa: BLE001 - any other escape is the bug under test
            out[name] = (type(e).__name__, str(e), Path(marker).exists())
    # Conversion and model.init_checkpoint read the same index through megatron.
    from grpo_mega.checkpoint import convert
    from tests import REPO
    init = Path(root) / "code_in_init_checkpoint_index"
    shutil.copytree(good, init)
    (init / ".metadata").write_bytes(pickle.dumps(MarkerOnLoad(marker)))
    for name, call in [("init checkpoint", lambda: convert.load_mcore_weights(model, init, ps, m)),
                       ("mcore_to_hf", lambda: convert.mcore_to_hf(
                           init, Path(root) / "hf_out", hf_config_dir=REPO / "grpo_mega/assets/demo_v1/hf"))]:
        Path(marker).unlink(missing_ok=True)
        try:
            call()
            out[f"code in index, {name}"] = ("loaded", "", Path(marker).exists())
        except BaseException as e:  # noqa: BLE001 - any escape but CheckpointError is the bug
            out[f"code in index, {name}"] = (type(e).__name__, str(e), Path(marker).exists())
    # issue 38 finding 8: a re-publish of step 1 killed after the old copy was moved aside
    # and before the new one was renamed into place leaves a checkpoint resume loads.
    from grpo_mega.runtime import faults
    from grpo_mega.checkpoint import latest_checkpoint
    republish = Path(root) / "republish"
    shutil.copytree(good.parent, republish)
    faults._FAULT = faults.parse("checkpoint.republish:raise")
    try:
        save_checkpoint(republish, 1, model, opt, ps, {"data": [2]})
        out["republish killed"] = ("not killed", "", False)
    except faults.FaultInjected:
        faults._FAULT = None
        found = latest_checkpoint(republish)
        out["republish killed"] = ("loaded", str(found), False)
        load_checkpoint(found, model, opt, ps, m)
    finally:
        faults._FAULT = None
    # issue 38 finding 10: NaN or infinite weights are refused, naming them, unless allowed.
    weight = dict(model.named_parameters())["embedding.word_embeddings.weight"]
    kept = weight.detach().clone()
    with torch.no_grad():
        weight[0, 0] = float("nan")
        weight[1, 1] = float("inf")
    nan_dir = save_checkpoint(f"{root}/nan", 1, model, opt, ps, {"data": [1]})
    with torch.no_grad():
        weight.copy_(kept)
    try:
        load_checkpoint(nan_dir, model, opt, ps, m)
        out["nan weights"] = ("loaded", "", bool(torch.isnan(weight).any()))
    except CheckpointError as e:
        out["nan weights"] = ("CheckpointError", str(e), bool(torch.isnan(weight).any()))
    load_checkpoint(nan_dir, model, opt, ps, m, allow_nonfinite=True)
    out["nan weights, allowed"] = ("loaded", "", bool(torch.isnan(weight).any()))
    try:  # the same checkpoint as model.init_checkpoint
        convert.load_mcore_weights(model, nan_dir, ps, m)
        out["nan weights, init checkpoint"] = ("loaded", "", False)
    except CheckpointError as e:
        out["nan weights, init checkpoint"] = ("CheckpointError", str(e), False)
    with torch.no_grad():
        weight.copy_(kept)
    # The opt-in does what it says: an older-format file loads with it.
    legacy = Path(root) / "legacy_rank_file"
    Path(marker).unlink(missing_ok=True)
    load_checkpoint(legacy, model, opt, ps, m, allow_unsafe_load=True)
    out["legacy rank file, opted in"] = ("loaded", "", Path(marker).exists())
    return out


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    marker = root / "code_ran"
    (res,) = run_ranks(1, _faults, str(root), str(marker), timeout=300)
    return res, root


NAMED_FILE = {
    "no shard files": ("__0_0.distcp", "missing"),
    "truncated shard": ("__0_0.distcp", "truncated"),
    "corrupt tensor entry": (".distcp", "corrupt"),
    "corrupt object entry": (".distcp", "corrupt"),
    "corrupt index": (".metadata", "corrupt"),
    "corrupt meta json": ("grpo_meta.json", "corrupt"),
    "no rank file": ("rank_00000.pt", "incomplete"),
    "corrupt rank file": ("rank_00000.pt", "corrupt"),
}


@pytest.mark.parametrize("fault", sorted(NAMED_FILE))
def test_checkpoint_fault_names_the_damaged_file(faults, fault):
    """Guards against a damaged checkpoint surfacing as a bare StopIteration (no rank
    files), torch's BaseException CheckpointException escaping every handler (missing
    or corrupt shards), or a message that does not say which file to look at."""
    res, root = faults
    kind, msg, _ = res[fault]
    name, word = NAMED_FILE[fault]
    assert kind == "CheckpointError", (fault, kind, msg)
    assert str(root / fault.replace(" ", "_")) in msg and name in msg and word in msg, msg


@pytest.mark.parametrize("fault", ["code in rank file", "code in common.pt", "code in index",
                                   "code in object entry", "code in index, init checkpoint",
                                   "code in index, mcore_to_hf"])
def test_unsafe_checkpoint_file_is_refused_before_it_runs_code(faults, fault):
    """Guards against unpickling checkpoint files unrestricted (torch.load with
    weights_only=False of the per-rank files, megatron's plain pickle.load of the
    index and torch's weights_only=False load of ShardedObject entries): a checkpoint
    from someone else could run code on every rank. The crafted file creates a marker
    file when unpickled; it must be refused, name the flag, and the marker must not exist."""
    res, _ = faults
    kind, msg, marker_exists = res[fault]
    assert kind == "CheckpointError" and "--checkpoint.allow_unsafe_load" in msg, (kind, msg)
    if "mcore_to_hf" in fault:
        assert "--allow-unsafe-load" in msg, msg
    assert "builtins.open" in msg or "io.open" in msg, msg
    assert not marker_exists, f"{fault}: the crafted pickle ran code"


def test_compressed_object_entry_is_refused_before_torch_decodes_it(faults):
    """Guards against the object-entry check skipping entries marked compressed (issue 38
    finding 9): torch decompresses such an entry and unpickles it with
    ``weights_only=False``, so with ``zstandard`` or ``pyzstd`` installed a crafted
    checkpoint ran code. It must be refused for its mark, naming the file, the entry and
    the flag, and the payload (which creates a file when unpickled) must not have run."""
    res, root = faults
    kind, msg, marker_exists = res["code in compressed object entry"]
    assert not marker_exists, "the crafted compressed pickle ran code"
    assert kind == "CheckpointError" and "stored compressed (stream.zstd/1)" in msg, (kind, msg)
    assert str(root / "code_in_compressed_object_entry") in msg and "--checkpoint.allow_unsafe_load" in msg, msg


def test_legacy_checkpoint_needs_the_unsafe_flag_and_loads_with_it(faults):
    """Guards against an older-format per-rank file (Python objects beyond tensors)
    failing with torch's raw weights_only message, or the opt-in flag being ignored;
    and against the default checks refusing an intact checkpoint."""
    res, _ = faults
    assert res["intact"][0] == "loaded", res["intact"]
    kind, msg, _ = res["legacy rank file"]
    assert kind == "CheckpointError" and "--checkpoint.allow_unsafe_load=true" in msg, msg
    assert "LegacyState" in msg and "rank_00000.pt" in msg, msg
    assert res["legacy rank file, opted in"][0] == "loaded"


def test_resume_modes_must_never_auto(tmp_path):
    """Guards against a mistyped --checkpoint.dir silently starting a fresh run when the
    user needs a resume (``must``), ``never`` resuming anyway, and a file given as the
    directory; the error names the folder looked in."""
    from grpo_mega.checkpoint import CheckpointError
    from grpo_mega.checkpoint.trainer_state import resume_checkpoint

    typo = tmp_path / "chekpoints"
    assert resume_checkpoint(typo, "auto") is None
    with pytest.raises(CheckpointError, match=f"{typo}.*does not exist.*--checkpoint.dir"):
        resume_checkpoint(typo, "must")
    typo.mkdir()
    with pytest.raises(CheckpointError, match=f"{typo}.*no 'latest'"):
        resume_checkpoint(typo, "must")
    (typo / "step_00000003").mkdir()
    (typo / "step_00000003" / "grpo_meta.json").write_text(json.dumps({"step": 3}))
    (typo / "latest").write_text("step_00000003\n")
    assert resume_checkpoint(typo, "must") == typo / "step_00000003"
    assert resume_checkpoint(typo, "auto") == typo / "step_00000003"
    assert resume_checkpoint(typo, "never") is None
    with pytest.raises(CheckpointError, match="checkpoint.resume='sometimes'"):
        resume_checkpoint(typo, "sometimes")
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(CheckpointError, match="is a file"):
        resume_checkpoint(afile, "auto")


def test_republish_killed_midway_leaves_a_checkpoint_that_loads(faults):
    """Guards against re-publishing a step (a finished command run again) deleting the
    published copy before its replacement is in place (issue 38 finding 8): a kill in
    that window left ``latest`` naming a missing directory and nothing to resume."""
    res, root = faults
    kind, found, _ = res["republish killed"]
    assert kind == "loaded", res["republish killed"]
    assert Path(found).parent == root / "republish", found


def test_nonfinite_weights_are_refused_naming_them_and_load_with_the_flag(faults):
    """Guards against a checkpoint with NaN or infinite weights loading silently (issue 38
    finding 10): the run trained on from garbage. The refusal names the tensor and the
    flag; with the flag the values load as stored."""
    res, _ = faults
    kind, msg, _ = res["nan weights"]
    assert kind == "CheckpointError" and "embedding.word_embeddings.weight" in msg, (kind, msg)
    assert "--checkpoint.allow_nonfinite_weights=true" in msg, msg
    assert res["nan weights, allowed"] == ("loaded", "", True)
    kind, msg, _ = res["nan weights, init checkpoint"]
    assert kind == "CheckpointError" and "embedding.word_embeddings.weight" in msg, (kind, msg)


def test_shard_named_outside_the_checkpoint_directory_is_refused(faults):
    """Guards against a crafted index naming a shard file outside the checkpoint directory
    (``../x``), which torch's reader opens as given (issue 38 finding 10)."""
    res, _ = faults
    kind, msg, _ = res["shard outside the directory"]
    assert kind == "CheckpointError" and "outside the checkpoint directory" in msg, (kind, msg)


def test_weights_only_is_forced_on_torch_loads_inside_a_checkpoint_load(tmp_path):
    """Guards against the second line of defence of issue 38 finding 9 being inert: torch
    and megatron load a checkpoint's object entries with ``weights_only=False``; within
    ``weights_only_loads`` (around megatron's load) such a call must refuse a pickle that
    runs code (here one that creates a file), and the setting must not outlive the block."""
    import os

    from grpo_mega.checkpoint.io import weights_only_loads

    marker = tmp_path / "code_ran"
    evil = _torch_bytes(MarkerOnLoad(str(marker)))
    before = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    with weights_only_loads():
        with pytest.raises(pickle.UnpicklingError):
            torch.load(io.BytesIO(evil), map_location="cpu", weights_only=False)
    assert not marker.exists(), "the pickle ran code inside weights_only_loads"
    assert os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") == before
    with weights_only_loads(enabled=False):  # the user's opt-in (allow_unsafe_load) leaves torch as is
        torch.load(io.BytesIO(evil), map_location="cpu", weights_only=False)
    assert marker.exists()
