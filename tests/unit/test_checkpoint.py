"""Checkpoint files: atomic writes, verification, and which checkpoint a restart resumes from. No Ray."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch

from minimind_ray.config import ModelConfig
from minimind_ray.engine.state import RNGState
from minimind_ray.fsio import atomic_write
from minimind_ray.model.minimind import build_model
from minimind_ray.model.presets import preset_values
from minimind_ray.store import checkpoint as ck

LOCAL = pafs.LocalFileSystem()


def _write_checkpoint(run_dir: Path, step: int, world: int = 2) -> Path:
    """What every rank of a ``world``-worker group leaves in storage for one report."""
    d = run_dir / f"checkpoint_2026-11-29_00-00-{step:02d}.000000"
    model = build_model(ModelConfig(**preset_values("tiny")), seed=step)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for r in range(world):
        ck.write_rank_files(d, r, RNGState().state_dict())
    meta = ck.CheckpointMeta(step=step, epoch=0, data_state={}, world_size=world, stage="pretrain", total_steps=8,
                             config={}, prepared_dir="/nowhere")
    ck.write_shared_files(d, model_state=model.state_dict(),
                          train_state={"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, meta=meta)
    return d


def _ckpts(run_dir) -> dict:
    """{step: directory} of a run's checkpoints that verify."""
    return {ck.open_checkpoint(p).step: Path(p) for _, p in ck.checkpoints_in(run_dir)}


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    for step in (4, 8):
        _write_checkpoint(run, step)
    return run


def test_atomic_write_leaves_nothing_when_the_write_fails(tmp_path):
    target = tmp_path / "x.pt"

    def half_then_fail(tmp):
        Path(tmp).write_bytes(b"half a file")
        raise OSError("disk full")

    with pytest.raises(OSError):
        atomic_write(target, half_then_fail)
    assert list(tmp_path.iterdir()) == []


def test_atomic_writes_get_the_mode_of_any_new_file_not_mkstemps_0600(tmp_path):
    import os
    import stat

    from minimind_ray.fsio import write_text_atomic

    old = os.umask(0o027)
    try:
        write_text_atomic(tmp_path / "a.json", "{}")
        (tmp_path / "plain").write_text("{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == stat.S_IMODE((tmp_path / "plain").stat().st_mode) \
        == 0o640


def test_verify_refuses_incomplete_checkpoints(run_dir):
    newest = ck.latest_checkpoint(run_dir)
    assert ck.open_checkpoint(newest).step == 8
    (newest / ck.MODEL).write_bytes((newest / ck.MODEL).read_bytes()[:100])  # cut short
    with pytest.raises(ck.CheckpointError, match="model.pth missing or of the wrong size"):
        ck.open_checkpoint(newest)
    assert ck.open_checkpoint(ck.latest_checkpoint(run_dir)).step == 4  # the newest *complete* one

    older = ck.latest_checkpoint(run_dir)
    (older / "rng" / "rank_1.pt").unlink()
    with pytest.raises(ck.CheckpointError, match="rng/rank_1.pt missing"):
        ck.open_checkpoint(older)
    (older / ck.COMPLETE).unlink()
    with pytest.raises(ck.CheckpointError, match="not finished"):
        ck.open_checkpoint(older)
    assert ck.latest_checkpoint(run_dir) is None


def test_complete_lists_every_ranks_files_and_deep_verify_reads_older_ones(run_dir):
    newest = ck.latest_checkpoint(run_dir)
    rec = json.loads((newest / ck.COMPLETE).read_text())
    # every rank's file with its size (issue 49): an upload keeps no order, COMPLETE.json may come first
    assert {n: s for n, s in rec["files"].items() if n.startswith("rng/")} == {
        f"rng/rank_{r}.pt": (newest / "rng" / f"rank_{r}.pt").stat().st_size for r in (0, 1)}
    rng1 = newest / "rng" / "rank_1.pt"
    rng1.write_bytes(rng1.read_bytes()[:50])  # a rank killed while uploading
    with pytest.raises(ck.CheckpointError, match=f"^{newest}: rng/rank_1.pt missing or of the wrong size; "
                                                 f"checkpoint refused$"):
        ck.open_checkpoint(newest)
    # a COMPLETE.json written before it listed the other ranks' files: their sizes unknown, a deep verify reads them
    rec["files"] = {n: s for n, s in rec["files"].items() if not n.startswith("rng/")}
    (newest / ck.COMPLETE).write_text(json.dumps(rec))
    assert ck.open_checkpoint(newest).step == 8
    with pytest.raises(ck.CheckpointError, match="rank_1.pt: unreadable"):
        ck.open_checkpoint(newest, deep=True)
    assert ck.open_checkpoint(ck.latest_checkpoint(run_dir, deep=True)).step == 4


def test_restart_resumes_from_a_newer_checkpoint_ray_did_not_register(run_dir):
    ckpts = _ckpts(run_dir)
    assert sorted(ckpts) == [4, 8]
    # a hard kill after step 8's upload: Ray's controller only registered step 4
    chosen = ck.choose_restore((str(ckpts[4]), LOCAL), str(run_dir))
    assert chosen.step == 8 and chosen.meta().step == 8
    # nothing registered yet (the crash came before Ray collected the first report)
    assert ck.choose_restore(None, str(run_dir)).step == 8
    # Ray's registered checkpoint is the newest: it is the one used
    assert ck.choose_restore((str(ckpts[8]), LOCAL), str(run_dir)).path == str(ckpts[8])
    # the newer one is unusable: Ray's stands
    (ckpts[8] / "rng" / "rank_0.pt").write_bytes(b"PK")
    assert ck.choose_restore((str(ckpts[4]), LOCAL), str(run_dir)).path == str(ckpts[4])
    # a fresh run: nothing anywhere
    assert ck.choose_restore(None, str(run_dir.parent / "fresh")) is None


def test_checkpoints_on_a_uri_filesystem(run_dir, tmp_path):
    uri = f"file://{run_dir}"
    assert ck.latest_checkpoint(uri) == f"{uri}/{ck.latest_checkpoint(run_dir).name}"
    assert ck.choose_restore(None, uri).step == 8
    shutil.rmtree(run_dir)
    assert ck.latest_checkpoint(uri) is None


def test_prune_untracked_removes_only_what_ray_does_not_keep(run_dir):
    (run_dir / "checkpoint_2026-11-29_00-00-09.000000").mkdir()  # an upload a crash cut short
    names = sorted(p.name for p in run_dir.iterdir())
    kept = {names[1]}  # Ray kept step 8 only; step 4 was never registered
    assert ck.prune_untracked(run_dir, kept) == [names[0], names[2]]
    assert sorted(p.name for p in run_dir.iterdir()) == [names[1]]
    assert ck.prune_untracked(run_dir.parent / "absent", kept) == []


_FILES = '"train_state.pt": 1, "meta.json": 1'


@pytest.mark.parametrize("record", [
    '{"step": 2}', "[]", '{"files": [], "rng_ranks": [0], "step": 8}', "not json",
    # each clause of the shape check alone (the sizes are wrong too: only the shape check keeps it off the list)
    '{"files": {%s, "model.pth": 1}, "rng_ranks": [0], "step": "8"}' % _FILES,
    '{"files": {%s, "model.pth": 1}, "rng_ranks": 0, "step": 8}' % _FILES,
    '{"files": {%s, "model.pth": 1}, "rng_ranks": ["0"], "step": 8}' % _FILES,
    '{"files": {%s, "model.pth": "1"}, "rng_ranks": [0], "step": 8}' % _FILES,
    '{"files": {"train_state.pt": 1, "model.pth": 1}, "rng_ranks": [0], "step": 8}',
    '{"files": {"meta.json": 1, "model.pth": 1}, "rng_ranks": [0], "step": 8}',
    '{"files": {%s}, "rng_ranks": [0], "step": 8}' % _FILES,
])
def test_a_malformed_complete_marker_is_refused_and_the_older_checkpoint_used(run_dir, record):
    """Issue 11, item 10: a malformed COMPLETE.json is a refusal naming the checkpoint, not a crash of
    the search, and the restart falls back to the newest good checkpoint."""
    ckpts = _ckpts(run_dir)
    (ckpts[8] / ck.COMPLETE).write_text(record)
    with pytest.raises(ck.CheckpointError, match=str(ckpts[8].name)):
        ck.open_checkpoint(ckpts[8])
    assert [s for s, _ in ck.checkpoints_in(run_dir)] == [4]
    assert ck.latest_checkpoint(run_dir) == ckpts[4]
    # Ray registered the malformed one: the restart says why it is unusable and takes the older good one
    assert ck.choose_restore((str(ckpts[8]), LOCAL), str(run_dir)).step == 4


def test_meta_round_trips_and_names_the_file_when_malformed(run_dir):
    newest = ck.latest_checkpoint(run_dir)
    meta = ck.open_checkpoint(newest).meta()
    assert meta.step == 8 and meta.world_size == 2 and meta.extra == {}
    d = json.loads((newest / ck.META).read_text())
    assert ck.CheckpointMeta.from_json({**d, "added_later": 1}).to_json() == {**d, "added_later": 1}
    with pytest.raises(ck.CheckpointError, match="meta.json: missing"):
        ck.CheckpointMeta.from_json({"step": 1}, "x/meta.json")


# --------------------------------------------------------------------------- the edges the cases above leave out
# (issue 34: each kills mutants `tests/mutation.sh minimind_ray/store/checkpoint.py` found surviving)


def test_choose_restore_says_why_it_resumes_from_the_run_directory(run_dir, capsys):
    ckpts = _ckpts(run_dir)
    assert ck.choose_restore(None, str(run_dir)).step == 8
    assert capsys.readouterr().out == (f"[minimind-ray] resuming from {ckpts[8]} (step 8), newer than the checkpoint "
                                       "Ray registered (step none)\n")
    assert ck.choose_restore((str(ckpts[4]), LOCAL), str(run_dir)).step == 8
    assert capsys.readouterr().out.endswith("(step 8), newer than the checkpoint Ray registered (step 4)\n")
    # Ray's is the newest: used as it is, nothing said (the run directory's copy of the same step is not "newer")
    assert ck.choose_restore((str(ckpts[8]), LOCAL), str(run_dir)).path == str(ckpts[8])
    assert ck.choose_restore((str(ckpts[8]), LOCAL), None).path == str(ckpts[8])
    assert capsys.readouterr().out == ""
    assert ck.choose_restore(None, None) is None
    # Ray's registered one is unusable: the run directory's newest good one, and the refusal as the reason
    (ckpts[8] / ck.COMPLETE).write_text("[]")
    assert ck.choose_restore((str(ckpts[8]), LOCAL), str(run_dir)).step == 4
    assert capsys.readouterr().out == (f"[minimind-ray] resuming from {ckpts[4]} (step 4), Ray's registered checkpoint "
                                       f"is unusable: {ckpts[8]}: malformed COMPLETE.json (expected files, rng_ranks "
                                       "and step); checkpoint refused\n")


def test_choose_restore_raises_the_refusal_when_nothing_else_verifies(run_dir):
    ckpts = _ckpts(run_dir)
    (ckpts[8] / ck.COMPLETE).write_text("[]")
    (ckpts[4] / ck.COMPLETE).unlink()
    for search in (str(run_dir), None):  # a run directory with nothing better, or none at all
        with pytest.raises(ck.CheckpointError, match=f"{ckpts[8]}: malformed"):
            ck.choose_restore((str(ckpts[8]), LOCAL), search)


def test_newest_complete_stops_at_newer_than_and_skips_what_does_not_verify(run_dir):
    assert ck.newest_complete(run_dir, newer_than=4).step == 8
    assert ck.newest_complete(run_dir, newer_than=8) is None  # the same step is not newer
    assert ck.newest_complete(run_dir, newer_than=3).step == 8
    ckpts = _ckpts(run_dir)
    (ckpts[8] / ck.MODEL).write_bytes(b"")
    assert ck.newest_complete(run_dir).step == 4
    assert ck.newest_complete(run_dir, newer_than=4) is None
    # a URI with a trailing slash names its checkpoint as a URI a user can pass back
    assert ck.newest_complete(f"file://{run_dir}/").location == f"file://{run_dir}/{ckpts[4].name}"
    assert ck.newest_complete(run_dir).location == str(ckpts[4])


def test_unreadable_tensor_files_are_refused_with_the_file_and_the_error(run_dir):
    newest = ck.open_checkpoint(ck.latest_checkpoint(run_dir))

    def rewrite(name: str, data: bytes) -> None:  # same size as COMPLETE.json records, so only a read finds it
        p = Path(newest.path) / name
        p.write_bytes(data.ljust(p.stat().st_size, b"\0"))

    rewrite(ck.TRAIN_STATE, b"garbage")
    with pytest.raises(ck.CheckpointError) as e:
        newest.train_state()
    # the first line of torch's message only: the rest is advice about trusting the file
    assert str(e.value) == (f"{newest.location}/train_state.pt: unreadable (UnpicklingError: Weights only load failed. "
                            "In PyTorch 2.6, we changed the default value of the `weights_only` argument in "
                            "`torch.load` from `False` to `True`. Re-running `torch.load` with `weights_only` set to "
                            "`False` will likely succeed, but it can result in arbitrary code execution. Do it only if "
                            "you got the file from a trusted source.)")
    assert isinstance(e.value.__cause__, Exception)
    (Path(newest.path) / ck.MODEL).write_bytes(b"")  # an empty file: an error without a message
    with pytest.raises(ck.CheckpointError) as e:
        ck.StoredCheckpoint(newest.path, LOCAL, newest.record, "here").model_state()
    assert str(e.value) == "here/model.pth: unreadable (EOFError: )"


class Pickled:  # not a tensor, a dict or a number: weights_only loading refuses it
    pass


def test_a_file_that_pickles_code_is_refused_not_run(run_dir):
    newest = ck.open_checkpoint(ck.latest_checkpoint(run_dir))
    rng0 = Path(newest.path) / "rng" / "rank_0.pt"
    torch.save({"state": Pickled()}, rng0)
    with pytest.raises(ck.CheckpointError, match=r"rng/rank_0.pt: unreadable \(UnpicklingError: Weights only"):
        newest.rng(0)
    assert isinstance(newest.rng(1), dict) and newest.rng(2) is None  # rank 2 was not in that world


def test_meta_from_json_names_what_is_wrong_and_keeps_what_it_does_not_know():
    with pytest.raises(ck.CheckpointError) as e:
        ck.CheckpointMeta.from_json([1])
    assert str(e.value) == "meta.json: expected a JSON object, got list"
    full = dict(step=3, epoch=0, data_state={"a": 1}, world_size=1, stage="sft", total_steps=9, config={"x": 1},
                prepared_dir="/p")
    with pytest.raises(ck.CheckpointError) as e:
        ck.CheckpointMeta.from_json({k: v for k, v in full.items() if k not in ("epoch", "stage")}, "c/meta.json")
    assert str(e.value) == "c/meta.json: missing ['epoch', 'stage']"
    meta = ck.CheckpointMeta.from_json({**full, "new_key": [1]})  # the optional fields may be absent
    assert (meta.step, meta.stage, meta.mlflow_run_id, meta.reported, meta.extra) == (3, "sft", None, {}, {"new_key": [1]})
    assert meta.to_json() == {**full, "mlflow_run_id": None, "reported": {}, "new_key": [1]}
    meta = ck.CheckpointMeta.from_json({**full, "mlflow_run_id": "r1", "reported": {"loss": 2.0}})
    assert (meta.mlflow_run_id, meta.reported, meta.extra) == ("r1", {"loss": 2.0}, {})


def test_an_unreadable_meta_json_is_named(run_dir):
    newest = ck.open_checkpoint(ck.latest_checkpoint(run_dir))
    meta = Path(newest.path) / ck.META
    meta.write_text("{" + " " * (meta.stat().st_size - 1))  # the recorded size, not JSON
    reopened = ck.open_checkpoint(newest.path)
    with pytest.raises(ck.CheckpointError, match=f"^{reopened.location}/meta.json: unreadable"):
        reopened.meta()


def test_parts_beside_the_policy_are_listed_verified_and_read(tmp_path):
    d = _write_checkpoint(tmp_path / "run", 2, world=1)
    assert not ck.is_checkpoint(tmp_path / "run") and ck.is_checkpoint(d) and ck.is_checkpoint(f"file://{d}/")
    plain = ck.open_checkpoint(d)
    assert not plain.has_part("critic") and not plain.sharded
    with pytest.raises(ck.CheckpointError, match=f"^{d}: holds no critic.pth"):
        plain.part_state("critic")
    with pytest.raises(ck.CheckpointError, match="holds model.pth, not sharded state"):
        plain.load_sharded({})
    critic = {"v_head.weight": torch.arange(6.0).reshape(2, 3)}
    meta = plain.meta()
    ck.write_shared_files(d, model_state=plain.model_state(), train_state=plain.train_state(), meta=meta,
                          part_states={"critic": critic})
    rec = json.loads((d / ck.COMPLETE).read_text())
    assert set(rec["files"]) == {"model.pth", "train_state.pt", "meta.json", "critic.pth", "rng/rank_0.pt"}
    assert rec["rng_ranks"] == [0] and rec["step"] == 2
    assert all(rec["files"][n] == (d / n).stat().st_size for n in rec["files"])
    with_part = ck.open_checkpoint(f"{d}/", LOCAL)  # a path on a given filesystem, trailing slash and all
    assert with_part.path == str(d) and with_part.has_part("critic") and not with_part.has_part("actor")
    assert torch.equal(with_part.part_state("critic")["v_head.weight"], critic["v_head.weight"])
    (d / "critic.pth").write_bytes(b"x" * rec["files"]["critic.pth"])
    with pytest.raises(ck.CheckpointError, match="critic.pth: unreadable"):
        with_part.part_state("critic")


def test_only_checkpoint_directories_count(run_dir):
    (run_dir / "checkpoint_a_file").write_text("not a directory")
    (run_dir / "other_dir").mkdir()
    (run_dir / "checkpoint_unfinished").mkdir()
    assert [s for s, _ in ck.checkpoints_in(run_dir)] == [8, 4]
    removed = ck.prune_untracked(run_dir, set())
    assert removed == sorted(removed) and len(removed) == 3 and "checkpoint_a_file" not in removed
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoint_a_file", "other_dir"]
    assert ck.prune_untracked(run_dir / "checkpoint_a_file", set()) == []  # not a directory: nothing to list
    assert ck.checkpoints_in(run_dir / "absent") == []


class _UndeletableFS:
    """A local filesystem whose deletes fail: storage trouble at the end of a run."""

    def __getattr__(self, name):
        return getattr(LOCAL, name)

    def delete_dir(self, path):
        raise OSError(f"permission denied: {path}")


def test_prune_untracked_reports_a_failed_delete_and_goes_on(run_dir, monkeypatch, capsys):
    names = sorted(p.name for p in run_dir.iterdir())
    monkeypatch.setattr(ck, "filesystem", lambda loc: (_UndeletableFS(), str(loc)))
    assert ck.prune_untracked(run_dir, {names[1]}) == []
    out = capsys.readouterr().out.splitlines()
    assert out == [f"[minimind-ray] could not remove {run_dir / names[0]}: permission denied: {run_dir / names[0]}"]
    assert sorted(p.name for p in run_dir.iterdir()) == names


def test_a_sharded_record_has_the_shape_of_a_complete_one(run_dir):
    """FSDP's checkpoints list DCP's metadata instead of model.pth: a candidate, refused only by what is on disk."""
    ckpts = _ckpts(run_dir)
    from minimind_ray.store.sharded import METADATA

    sizes = {n: (ckpts[8] / n).stat().st_size for n in (ck.TRAIN_STATE, ck.META)}
    (ckpts[8] / ck.COMPLETE).write_text(json.dumps({"files": {**sizes, METADATA: 1}, "rng_ranks": [0], "step": 8}))
    assert [s for s, _ in ck.checkpoints_in(run_dir)] == [8, 4]
    with pytest.raises(ck.CheckpointError, match=f"{METADATA} missing or of the wrong size"):
        ck.open_checkpoint(ckpts[8])


def test_a_sharded_checkpoint_written_by_one_process_reads_back_whole(tmp_path):
    """The FSDP layout (store/sharded.py) without a process group: DCP's files listed in COMPLETE.json instead of
    model.pth; the whole weights read back under MiniMind's keys, and a state filled in place."""
    from minimind_ray.store.sharded import write_sharded

    d = tmp_path / "run" / "checkpoint_2026-12-05_00-00-03.000000"
    weights = {"embed_tokens.weight": torch.arange(12.0).reshape(4, 3), "norm.weight": torch.ones(3)}
    files = write_sharded(d, {"model": {k: v.clone() for k, v in weights.items()}, "optimizer": {"t": torch.zeros(2)}})
    ck.write_rank_files(d, 0, RNGState().state_dict())
    ck.write_shared_files(d, model_state=None, train_state={"scheduler": {}}, sharded_files=files,
                          meta=ck.CheckpointMeta(step=3, epoch=0, data_state={}, world_size=1, stage="pretrain",
                                                 total_steps=8, config={}, prepared_dir="/nowhere"))
    assert not (d / ck.MODEL).exists()
    stored = ck.open_checkpoint(d)
    assert stored.sharded and set(stored.record["files"]) == {"train_state.pt", "meta.json", "rng/rank_0.pt", *files}
    got = stored.model_state()
    assert set(got) == set(weights) and all(torch.equal(got[k], weights[k]) for k in weights)
    state = {"model": {k: torch.zeros_like(v) for k, v in weights.items()}, "optimizer": {"t": torch.ones(2)}}
    stored.load_sharded(state)
    assert torch.equal(state["model"]["embed_tokens.weight"], weights["embed_tokens.weight"])
    assert torch.equal(state["optimizer"]["t"], torch.zeros(2))
    shard = next(d / n for n in files if not n.endswith(".metadata"))
    shard.write_bytes(b"\0" * shard.stat().st_size)  # the size COMPLETE.json has, not DCP's bytes
    # DCP raises a CheckpointException, a BaseException that `except Exception` missed: the refusal names the file's
    # own error instead
    for read in (lambda c: c.model_state(), lambda c: c.load_sharded(state)):
        with pytest.raises(ck.CheckpointError) as e:
            read(ck.open_checkpoint(d))
        assert str(e.value).startswith(f"{d}/sharded: unreadable (UnpicklingError: Weights only load failed.")


def test_the_edges_of_names_defaults_and_failures(run_dir, tmp_path, monkeypatch, capsys):
    ckpts = _ckpts(run_dir)
    # a key named like the dataclass's own catch-all is kept in it, not confused with it
    meta = ck.CheckpointMeta.from_json({**json.loads((ckpts[8] / ck.META).read_text()), "extra": 5})
    assert meta.extra == {"extra": 5}
    # a meta.json of the recorded size that lacks fields names itself
    path = ckpts[8] / ck.META
    path.write_text('{"step": 8}'.ljust(path.stat().st_size))
    with pytest.raises(ck.CheckpointError, match=f"^{ckpts[8]}/meta.json: missing"):
        ck.open_checkpoint(ckpts[8]).meta()
    # every rank's RNG file is listed with its size (issue 49): a short one is refused by the default search too
    rng1 = ckpts[8] / "rng" / "rank_1.pt"
    rng1.write_bytes(rng1.read_bytes()[:50])
    assert ck.newest_complete(run_dir).step == 4 and ck.latest_checkpoint(run_dir) == ckpts[4]
    assert ck.newest_complete(run_dir, deep=True).step == 4
    # a directory whose name ends in the characters a slash is stripped from
    odd = tmp_path / "runX" / "checkpoint_X"
    shutil.copytree(ckpts[4], odd)
    assert ck.open_checkpoint(f"{odd}/").step == 4 and ck.is_checkpoint(f"{odd}/")
    assert ck.newest_complete(f"file://{odd.parent}/").location == f"file://{odd.parent}/checkpoint_X"
    assert [s for s, _ in ck.checkpoints_in(f"{odd.parent}/")] == [4]


def test_a_registered_checkpoint_of_step_0_is_named_as_such(tmp_path, capsys):
    run = tmp_path / "run"
    zero, four = _write_checkpoint(run, 0, world=1), _write_checkpoint(run, 4, world=1)
    assert ck.choose_restore((str(zero), LOCAL), str(run)).step == 4
    assert capsys.readouterr().out.endswith("(step 4), newer than the checkpoint Ray registered (step 0)\n")


def test_prune_untracked_tries_every_directory_and_mark_latest_leaves_uris_alone(run_dir, tmp_path, monkeypatch,
                                                                                 capsys):
    names = sorted(p.name for p in run_dir.iterdir())
    monkeypatch.setattr(ck, "filesystem", lambda loc: (_UndeletableFS(), str(loc)))
    assert ck.prune_untracked(run_dir, set()) == []
    assert len(capsys.readouterr().out.splitlines()) == len(names) == 2  # a failed delete does not stop the rest
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file:" / "x").mkdir(parents=True)  # where a URI taken as a path would put the link
    assert ck.mark_latest("file://x/run", "sft") is None and list((tmp_path / "file:" / "x").iterdir()) == []


def test_a_dcp_failure_is_named_by_the_first_ranks_own_error():
    from torch.distributed.checkpoint.api import CheckpointException

    inner = ValueError("bad shard\nmore lines")
    err = ck._unreadable("c/sharded", CheckpointException("load", {1: (inner, None), 0: (KeyError("k"), None)}))
    assert str(err) == "c/sharded: unreadable (ValueError: bad shard)"
    empty = ck._unreadable("c/sharded", CheckpointException("load", {}))  # no failure listed: its own text
    assert str(empty) == "c/sharded: unreadable (CheckpointException: CheckpointException ranks:dict_keys([]))"


def test_a_failing_worker_waits_for_its_last_checkpoint_to_be_whole_before_it_stops(run_dir, tmp_path):
    """CI stop 52: rank 1 raised a step after a checkpoint while Ray Train's thread was still uploading it
    (checkpoint.upload=async); its staging folder was removed mid-copy and the restart refused that checkpoint. A
    failing worker now waits for its own staging folders to go (Ray's thread removes each once uploaded) and for the
    other ranks' files of its last checkpoint to be in storage at their sizes; either wait gives up at its limit."""
    import threading

    from minimind_ray.raytrain import worker

    staging = tmp_path / "staging"
    staging.mkdir()
    worker._STAGING[:] = [str(staging)]
    threading.Timer(0.3, shutil.rmtree, [staging]).start()  # the upload thread, done in 0.3 s
    assert worker.wait_for_uploads(30) and not staging.exists()
    worker._STAGING[:] = [str(tmp_path)]  # a folder that stays: an upload that failed
    assert not worker.wait_for_uploads(0.3)
    worker._STAGING.clear()

    late = _write_checkpoint(run_dir, 12)  # rank 1's RNG file arrives after rank 0's COMPLETE.json
    rng1 = late / "rng" / "rank_1.pt"
    kept = rng1.read_bytes()
    rng1.unlink()
    assert not worker.wait_for_whole_checkpoint(str(run_dir), 12, 0.3)  # step 8 is whole, but older
    threading.Timer(0.3, rng1.write_bytes, [kept]).start()
    assert worker.wait_for_whole_checkpoint(str(run_dir), 12, 30)
    assert worker.wait_for_whole_checkpoint(str(run_dir), 8, 0)  # a newer whole one will do
