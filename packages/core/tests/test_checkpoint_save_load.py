"""Round trips, describe(), replacing an iteration, and every user-facing load error."""

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from mg.core.checkpoint import (
    CHECKPOINT_VERSION,
    CheckpointError,
    Layout,
    checkpoint_file,
    describe,
    get_rng_state,
    list_iterations,
    load_checkpoint,
    mg_metadata,
    read_latest_iteration,
    rng_state_list,
    save_checkpoint,
    save_checkpoint_shards,
    set_rng_state,
)
from mg.core.checkpoint.serialization import SAFE_GLOBALS

MODEL_CONFIG = {"num_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 32}
TOKENIZER_CONFIG = {"tokenizer_type": "GPT2BPETokenizer", "vocab_size": 32}


def _training_state(iteration: int = 10, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5)
    return {
        "args": {"num_layers": 2, "lr": 1e-3, "seed": seed, "params_dtype": torch.bfloat16},
        "iteration": iteration,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "opt_param_scheduler": scheduler.state_dict(),
        "rng_state": rng_state_list(),
        "num_floating_point_operations_so_far": 123456789.0,
        "mg": mg_metadata(MODEL_CONFIG, TOKENIZER_CONFIG, tp=1, pp=1),
    }


def _assert_equal(a: object, b: object, where: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=where)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: {set(a) ^ set(b)}"
        for key in a:
            _assert_equal(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_round_trip_exact(tmp_path: Path) -> None:
    state = _training_state(10)
    path = save_checkpoint(tmp_path, 10, state)
    assert path == tmp_path / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "10"
    loaded, iteration = load_checkpoint(tmp_path)
    assert iteration == 10
    assert loaded["checkpoint_version"] == CHECKPOINT_VERSION == 3.0
    _assert_equal(state, {k: v for k, v in loaded.items() if k != "checkpoint_version"})
    # the whole thing loads with weights_only=True and only the numpy allowlist (rng state)
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        plain = torch.load(path, weights_only=True)
    assert plain["mg"]["model_config"] == MODEL_CONFIG
    # nothing left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000010",
        "latest_checkpointed_iteration.txt",
    ]


def test_optimizer_and_rng_restore(tmp_path: Path) -> None:
    state = _training_state(5)
    save_checkpoint(tmp_path, 5, state)
    loaded, _ = load_checkpoint(tmp_path)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model.load_state_dict(loaded["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.load_state_dict(loaded["optimizer"])
    assert optimizer.state_dict()["state"][0]["step"] == 1

    set_rng_state(loaded["rng_state"])
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(3)  # move on
    set_rng_state(loaded["rng_state"])
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert expected[:2] == again[:2] and torch.equal(expected[2], again[2])


def test_rng_state_shape_matches_megatron() -> None:
    states = rng_state_list({"model-parallel-rng": torch.zeros(4, dtype=torch.uint8)})
    assert isinstance(states, list) and len(states) == 1
    assert set(states[0]) == {
        "random_rng_state",
        "np_rng_state",
        "torch_rng_state",
        "cuda_rng_state",
        "rng_tracker_states",
    }
    assert states[0]["np_rng_state"][0] == "MT19937"
    single = get_rng_state()
    assert set_rng_state(single) == {}
    # per-data-parallel-rank list: entry dp_rank, else entry 0 (Megatron's rule)
    a, b = get_rng_state(), None
    torch.rand(5)
    b = get_rng_state()
    set_rng_state([a, b], data_parallel_rank=1)
    assert torch.equal(torch.get_rng_state(), b["torch_rng_state"])
    set_rng_state([a], data_parallel_rank=1)
    assert torch.equal(torch.get_rng_state(), a["torch_rng_state"])


def test_latest_follows_saves_and_explicit_iteration(tmp_path: Path) -> None:
    for it in (10, 20, 30):
        save_checkpoint(tmp_path, it, _training_state(it, seed=it))
    assert list_iterations(tmp_path) == [10, 20, 30]
    assert read_latest_iteration(tmp_path) == 30
    state, it = load_checkpoint(tmp_path, iteration=20)
    assert it == 20 and state["iteration"] == 20 and state["args"]["seed"] == 20
    # save without moving the pointer
    save_checkpoint(tmp_path, 40, _training_state(40), update_latest=False)
    assert read_latest_iteration(tmp_path) == 30


def test_resave_same_iteration_replaces(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 10, _training_state(10, seed=1))
    (tmp_path / "iter_0000010" / "stray.txt").write_text("from the first save")
    save_checkpoint(tmp_path, 10, _training_state(10, seed=2))
    state, _ = load_checkpoint(tmp_path)
    assert state["args"]["seed"] == 2
    assert not (tmp_path / "iter_0000010" / "stray.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000010",
        "latest_checkpointed_iteration.txt",
    ]


def test_release_checkpoint(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, "release", {"model": {"w": torch.ones(2)}})
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "release"
    state, it = load_checkpoint(tmp_path)
    assert it == "release" and "iteration" not in state
    assert torch.equal(state["model"]["w"], torch.ones(2))


def test_shards_tp_pp_and_describe(tmp_path: Path) -> None:
    shards = {
        (tp, pp): {
            "model": {"w": torch.full((2, 2), 10.0 * tp + pp)},
            "mg": mg_metadata(MODEL_CONFIG, TOKENIZER_CONFIG, tp=2, pp=3),
        }
        for tp in range(2)
        for pp in range(3)
    }
    folder = save_checkpoint_shards(tmp_path, 7, shards)
    assert sorted(p.name for p in folder.iterdir()) == [
        f"mp_rank_{t:02d}_{p:03d}" for t in range(2) for p in range(3)
    ]
    state, _ = load_checkpoint(tmp_path, tp_rank=1, pp_rank=2)
    assert state["model"]["w"][0, 0] == 12.0
    state, _ = load_checkpoint(tmp_path, tp_rank=0, pp_rank=1, pp_size=3)
    assert state["model"]["w"][0, 0] == 1.0

    info = describe(tmp_path)
    assert info.iteration == 7
    assert info.layout == Layout(tp=2, pp=3)
    assert info.model_config == MODEL_CONFIG
    assert info.tokenizer_config == TOKENIZER_CONFIG
    assert info.parallel == {"tp": 2, "pp": 3, "ep": 1}
    assert info.format_version == 1 and info.checkpoint_version == 3.0
    assert len(info.files) == 6
    assert info.total_bytes == sum(p.stat().st_size for p in info.files) > 0


def test_shards_pp1_ep_disambiguated(tmp_path: Path) -> None:
    # PP=1, EP=2 is written mp_rank_00_000 / mp_rank_00_001, like PP=2; metadata tells them apart
    shards = {(0, 0, e): {"model": {"e": torch.tensor(e)}} for e in range(2)}
    save_checkpoint_shards(tmp_path, 3, shards)
    assert sorted(p.name for p in (tmp_path / "iter_0000003").iterdir()) == [
        "mp_rank_00_000",
        "mp_rank_00_001",
    ]
    assert describe(tmp_path).layout == Layout(tp=1, pp=1, ep=2)
    state, _ = load_checkpoint(tmp_path, ep_rank=1)
    assert state["model"]["e"] == 1


def test_single_rank_of_parallel_save_needs_barrier(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="barrier"):
        save_checkpoint(tmp_path, 1, {}, tp_rank=1, tp_size=2)


def test_simulated_ranks_with_barrier(tmp_path: Path) -> None:
    """Two 'ranks' driven step by step through the save protocol with a shared barrier."""
    import threading

    barrier = threading.Barrier(2)
    results: dict[int, Path] = {}

    def rank(tp: int) -> None:
        results[tp] = save_checkpoint(
            tmp_path,
            9,
            {"model": {"w": torch.tensor(tp)}},
            tp_rank=tp,
            tp_size=2,
            is_writer_of_latest=tp == 0,
            barrier=barrier.wait,
        )

    threads = [threading.Thread(target=rank, args=(tp,)) for tp in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[1] == checkpoint_file(tmp_path, 9, tp_rank=1)
    assert describe(tmp_path).layout == Layout(tp=2, pp=1)
    assert load_checkpoint(tmp_path, tp_rank=1)[0]["model"]["w"] == 1


# ------------------------------------------------------------------ errors users see


def test_error_directory_missing(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"does not exist; check --load"):
        load_checkpoint(tmp_path / "nope")


def test_error_pointer_missing(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no latest_checkpointed_iteration.txt in") as info:
        load_checkpoint(tmp_path)
    assert "not a checkpoint directory, or the first save did not finish" in str(info.value)
    save_checkpoint(tmp_path, 5, {}, update_latest=False)
    with pytest.raises(CheckpointError, match="found iter_0000005; pass iteration=N"):
        load_checkpoint(tmp_path)
    assert load_checkpoint(tmp_path, 5)[1] == 5


def test_error_pointer_garbage(tmp_path: Path) -> None:
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("hello")
    with pytest.raises(CheckpointError, match=r"latest_checkpointed_iteration.txt: expected"):
        load_checkpoint(tmp_path)


def test_error_pointer_names_missing_or_half_written(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 10, {})
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("20")
    with pytest.raises(CheckpointError, match=r"iter_0000020 named by .* does not exist") as info:
        load_checkpoint(tmp_path)
    assert "found iter_0000010" in str(info.value)
    (tmp_path / "iter_0000020.tmp" / "mp_rank_00").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="half-written"):
        load_checkpoint(tmp_path)
    (tmp_path / "iter_0000020.tmp").rename(tmp_path / "iter_0000020.old")
    with pytest.raises(CheckpointError, match="Rename that folder back"):
        load_checkpoint(tmp_path)


def test_error_rank_file_missing(tmp_path: Path) -> None:
    save_checkpoint_shards(tmp_path, 4, {(0, 0): {}, (1, 0): {}})
    with pytest.raises(
        CheckpointError, match=r"saved with TP=2, PP=1; this run asks for tp_rank 3"
    ):
        load_checkpoint(tmp_path, tp_rank=3)
    with pytest.raises(CheckpointError, match=r"saved with TP=2, PP=1; this run asks for PP=2"):
        load_checkpoint(tmp_path, pp_size=2)
    (tmp_path / "iter_0000004" / "mp_rank_01" / "model_optim_rng.pt").unlink()
    (tmp_path / "iter_0000004" / "mp_rank_02").mkdir()
    (tmp_path / "iter_0000004" / "mp_rank_02" / "model_optim_rng.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="that rank's file is missing"):
        load_checkpoint(tmp_path, tp_rank=1)
    empty = tmp_path / "iter_0000005"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=r"holds no mp_rank_\*/model_optim_rng.pt"):
        load_checkpoint(tmp_path, 5)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_error_corrupt_file(tmp_path: Path, damage: str) -> None:
    path = save_checkpoint(tmp_path, 3, _training_state(3))
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00garbage" * 100)
    else:
        path.write_bytes(b"")
    with pytest.raises(CheckpointError, match="truncated or not a torch.save file") as info:
        load_checkpoint(tmp_path)
    assert str(path) in str(info.value)
    with pytest.raises(CheckpointError, match="truncated or not a torch.save file"):
        describe(tmp_path)


def test_error_unknown_format_version(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 3, {})
    state = torch.load(path, weights_only=True)
    state["mg"]["format_version"] = 99
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=r"format_version 99 is not known .* upgrade mg-core"):
        load_checkpoint(tmp_path)


def test_error_not_a_dict(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 3, {})
    torch.save([1, 2], path)
    with pytest.raises(CheckpointError, match="expected a state dict, found a list"):
        load_checkpoint(tmp_path)


@dataclasses.dataclass
class UnlistedArgs:
    """A class no library puts on torch's safe-globals list (megatron-core adds pathlib's)."""

    name: str


def test_error_unsafe_pickle_needs_allow(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 3, {})
    torch.save({"args": UnlistedArgs("x"), "checkpoint_version": 3.0}, path)
    with pytest.raises(
        CheckpointError, match=r"outside the safe allowlist: .*UnlistedArgs.*allow_pickle"
    ):
        load_checkpoint(tmp_path)
    state, _ = load_checkpoint(tmp_path, allow_pickle=True)
    assert state["args"] == UnlistedArgs("x")
